"""A model's depth scanned (``scan_layers=True``) against the same model unrolled.

For each layout of ``--layouts`` (``linear``, ``gated_deltanet``, ``3 gated_deltanet : 1
softmax``): a ``LanguageModel`` of ``--depth`` layers and width ``--width`` (heads of 64),
unrolled, and scanned holding the same parameters (layer ``i * p + j`` at index ``i`` of
block ``j``, as ``models.stack`` lays them out; their logits are checked equal first). Each
is timed on the forward of ``--prefill`` tokens and on ``--decode-steps`` greedy decoding
steps in one ``lax.fori_loop`` (as ``generate``'s loop runs them; ms per token), batch
``--decode-batch``. The calls are interleaved repeat by repeat, so each ratio scanned /
unrolled is the median of ratios taken under the same load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.bench.timing import write_table
from linattn_jax import models

LAYOUTS = "linear,gated_deltanet,3 gated_deltanet : 1 softmax"
VOCAB, HEAD_DIM = 256, 64


def build(layout: str, depth: int, width: int) -> tuple[models.LanguageModel, ...]:
    """``(unrolled, scanned)``: the same parameters, the scanned ones stacked."""
    make = lambda scan: models.LanguageModel(
        VOCAB, width, depth, max(1, width // HEAD_DIM), attention=layout, mlp="swiglu",
        scan_layers=scan, rngs=nnx.Rngs(0),
    )  # fmt: skip
    unrolled, scanned = make(False), make(True)
    models.stack.stack_layers(unrolled.blocks, scanned.blocks)
    for name in ("embed", "norm"):
        nnx.update(getattr(scanned, name), nnx.state(getattr(unrolled, name)))
    return unrolled, scanned


def _programs(model, batch: int, prefill: int, steps: int, tokens: jax.Array) -> dict:
    """The model's compiled forward and decoding loop, with their arguments."""
    graphdef, variables = nnx.split(model)

    def forward(variables, tokens):
        return nnx.merge(graphdef, variables)(tokens)

    def decode(variables, token, state):
        model = nnx.merge(graphdef, variables)

        def step(_, carry):
            token, state = carry
            logits, state = model(token, state=state, return_state=True)
            return jnp.argmax(logits, -1).astype(jnp.int32), state

        return jax.lax.fori_loop(0, steps, step, (token, state))

    state = model.init_state(batch, steps + 1)
    token = tokens[:, :1]
    return {
        "forward": (jax.jit(forward).lower(variables, tokens).compile(), (variables, tokens)),
        "decode": (
            jax.jit(decode).lower(variables, token, state).compile(),
            (variables, token, state),
        ),
    }


def measure(
    layout: str, depth: int, width: int, batch: int, prefill: int, steps: int, repeats: int
) -> dict:
    """One row: the medians (ms; decode per token) and ratios scanned / unrolled."""
    unrolled, scanned = build(layout, depth, width)
    tokens = jax.random.randint(jax.random.key(1), (batch, prefill), 0, VOCAB)
    runs = {
        name: _programs(model, batch, prefill, steps, tokens)
        for name, model in (("unrolled", unrolled), ("scanned", scanned))
    }
    logits = [fn(*args) for fn, args in (run["forward"] for run in runs.values())]
    np.testing.assert_allclose(*logits, atol=1e-4, rtol=1e-4)
    times = {(name, part): [] for name in runs for part in ("forward", "decode")}
    for key in times:  # warm up
        fn, args = runs[key[0]][key[1]]
        jax.block_until_ready(fn(*args))
    for _ in range(repeats):  # interleaved: every case under the same load
        for name, part in times:
            fn, args = runs[name][part]
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            per = steps if part == "decode" else 1
            times[name, part].append(1e3 * (time.perf_counter() - start) / per)
    row = dict(layout=layout, depth=depth, width=width, period=scanned.period)
    for (name, part), values in times.items():
        row[f"{part}_{name}_ms"] = statistics.median(values)
    for part in ("forward", "decode"):
        pairs = zip(times["scanned", part], times["unrolled", part], strict=True)
        row[f"{part}_ratio"] = statistics.median(s / u for s, u in pairs)
    return row


def table(rows: list[dict], batch: int, prefill: int, steps: int) -> str:
    lines = [
        f"| layout | depth | width | period | forward ({batch}x{prefill}) unrolled ms | "
        f"scanned ms | scanned / unrolled | decode ({steps} steps, batch {batch}) unrolled "
        "ms/token | scanned ms/token | scanned / unrolled |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['depth']} | {r['width']} | {r['period']} | "
            f"{r['forward_unrolled_ms']:.2f} | {r['forward_scanned_ms']:.2f} | "
            f"{r['forward_ratio']:.2f}x | {r['decode_unrolled_ms']:.3f} | "
            f"{r['decode_scanned_ms']:.3f} | {r['decode_ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, command: str) -> None:
    """Measures each of ``args.layouts``, writes ``scan_layers.md`` to ``args.out``."""
    layouts = [layout.strip() for layout in args.layouts.split(",") if layout.strip()]
    shape = (args.decode_batch, args.prefill, args.decode_steps)
    rows = [measure(layout, args.depth, args.width, *shape, args.repeats) for layout in layouts]
    print(write_table(Path(args.out), "scan_layers.md", table(rows, *shape), command))
