"""A mixture of experts' training step against a dense SwiGLU of the same active parameters.

For each width ``D`` of ``--moe-widths``: ``layers.MoE`` with ``E = 8`` experts of hidden
width ``D``, ``k = 2`` per token, against ``layers.SwiGLU`` of hidden width ``k * D`` (the
parameters one token goes through are the same, the router's ``D x E`` apart), on
``--tokens`` tokens; the MoE in its default grouped-matmul form (``"auto"``: tiled on
CPU) and with ``method="ragged"`` (``jax.lax.ragged_dot``, the form before the tiles).
Each is timed forward+backward (the gradient of a sum of the outputs with respect to the
parameters and the input), the calls interleaved repeat by repeat so that the ratios see
the same load; XLA's compiled scratch memory of each; and the
dispatch alone (the router, the sort by expert, the gather of the rows and the weighted
scatter back, without the experts' matmuls), whose time over the MoE's is its share.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.bench.timing import write_table
from linattn_jax.layers import MoE, SwiGLU
from linattn_jax.layers import moe as moe_lib

EXPERTS, TOP_K = 8, 2


def apply(module):
    """``(params, x) -> module(x)`` (a ``MoE``'s without recording its losses) and the
    module's parameters."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def fn(params, x):
        layer = nnx.merge(graphdef, params, rest)
        return layer(x, record=False) if isinstance(layer, MoE) else layer(x)

    return fn, params


def _loss(module):
    """``(params, x) -> sum(module(x))`` and the module's parameters."""
    fn, params = apply(module)
    return lambda params, x: jnp.sum(fn(params, x).astype(jnp.float32)), params


def _dispatch_only(layer: MoE):
    """``(params, x) -> a scalar`` through the MoE's routing and dispatch, the grouped
    matmuls left out (each row passes through unchanged)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def dispatch(params, x):
        routing, _ = nnx.merge(graphdef, params, rest).route(x)
        n, k = routing.experts.shape
        plan = moe_lib.dispatch(routing.experts, None, EXPERTS)
        rows = jnp.take(x, plan.order // k, axis=0)
        weights = jnp.take(routing.weights.reshape(n * k), plan.order)
        out = rows * weights[:, None].astype(rows.dtype)
        out = jnp.take(out, plan.inverse, axis=0).reshape(n, k, -1).sum(1)
        return jnp.sum(out.astype(jnp.float32))

    return dispatch, params


def measure(width: int, tokens: int, repeats: int) -> dict:
    rngs = nnx.Rngs(0)
    layer = MoE(width, EXPERTS, TOP_K, width, rngs=rngs)
    dense = SwiGLU(width, TOP_K * width, rngs=rngs)
    ragged = MoE(width, EXPERTS, TOP_K, width, method="ragged", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (tokens, width), jnp.float32)
    cases = {
        "moe": _loss(layer),
        "ragged": _loss(ragged),
        "dense": _loss(dense),
        "dispatch": _dispatch_only(layer),
    }
    row = dict(width=width, tokens=tokens, experts=EXPERTS, top_k=TOP_K)
    steps = {}
    for name, (fn, params) in cases.items():  # compiled once: timed, and its memory read
        compiled = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(params, x).compile()
        row[f"{name}_scratch_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
        steps[name] = (compiled, params)
        jax.block_until_ready(compiled(params, x))  # warm up
    times = {name: [] for name in steps}
    for _ in range(repeats):  # interleaved: each repeat times all four under the same load
        for name, (step, params) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(params, x))
            times[name].append(1e3 * (time.perf_counter() - start))
    for name, values in times.items():
        row[f"{name}_ms"] = statistics.median(values)
    row["moe_over_dense"] = statistics.median(
        m / d for m, d in zip(times["moe"], times["dense"], strict=True)
    )
    row["ragged_over_moe"] = statistics.median(
        r / m for r, m in zip(times["ragged"], times["moe"], strict=True)
    )
    row["dispatch_share"] = statistics.median(
        s / m for s, m in zip(times["dispatch"], times["moe"], strict=True)
    )
    active = lambda module: sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))
    row["moe_params"], row["dense_params"] = active(layer), active(dense)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        f"| D | tokens | MoE ({EXPERTS} experts, top-{TOP_K}) fwd+bwd ms | dense SwiGLU "
        f"({TOP_K}D) ms | MoE / dense | ragged_dot MoE ms | ragged / MoE | dispatch ms | "
        "dispatch share | MoE scratch MiB | ragged scratch MiB | dense scratch MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['tokens']} | {r['moe_ms']:.2f} | {r['dense_ms']:.2f} | "
            f"{r['moe_over_dense']:.2f}x | {r['ragged_ms']:.2f} | {r['ragged_over_moe']:.2f}x | "
            f"{r['dispatch_ms']:.2f} | {100 * r['dispatch_share']:.0f}% | "
            f"{r['moe_scratch_mib']:.1f} | {r['ragged_scratch_mib']:.1f} | "
            f"{r['dense_scratch_mib']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, command: str) -> None:
    """Measures each of ``args.moe_widths``, writes ``moe.md`` to ``args.out``."""
    widths = [int(w) for w in args.moe_widths.split(",") if w]
    rows = [measure(w, args.tokens, args.repeats) for w in widths]
    print(write_table(Path(args.out), "moe.md", table(rows), command))
