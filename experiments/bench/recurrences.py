"""Speed and memory of the recurrence families (additive decay, GLA, DeltaNet, Gated
DeltaNet, KDA, Mamba-2's SSD, the mLSTM), chunked and as a per-token scan, against non-causal linear
attention: forward ms, forward+backward ms and forward+backward scratch memory per
length, as a markdown table. ``--cpu-groups`` times the chunked forms with several
chunks batched per group on CPU (``chunking.GROUP_TOKENS_CPU``, one chunk by default;
GPU and TPU batch ``chunking.GROUP_TOKENS``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp

import linattn_jax as la
from experiments.bench.timing import scratch_mib, time_ms, write_table
from linattn_jax.ops import chunking

RECURRENCES = {
    # name: (form, gate shape: None, "head" or "channel")
    "additive_decay": ("additive", "head"),
    "gla": ("additive", "channel"),
    "deltanet": ("delta", None),
    "gated_deltanet": ("delta", "head"),
    "kda": ("delta", "channel"),
    # Mamba-2's SSD (ops.ssd): h heads of p = d channels, one B/C group of n = d (so its
    # q, k, v have additive_decay's shapes), the per-head log-decay dt A.
    "ssd": ("ssd", None),
    "mlstm": ("mlstm", "head"),
}


def recurrence_case(
    name: str, method: str, t: int, b: int = 1, h: int = 8, d: int = 64, chunk_size=None
):
    """``(fn, args)`` for one recurrence: ``fn(*args) -> out``, differentiable in every arg
    (``chunk_size`` None: the family's default)."""
    form, gated = RECURRENCES[name]
    keys = jax.random.split(jax.random.PRNGKey(t), 5)
    q, k, v = (jax.random.normal(kk, (b, t, h, d), jnp.float32) for kk in keys[:3])
    gate_shape = {None: None, "head": (b, t, h), "channel": (b, t, h, d)}[gated]
    gate = None if gate_shape is None else -jax.nn.softplus(jax.random.normal(keys[3], gate_shape))
    if form == "ssd":
        dt = jax.nn.softplus(jax.random.normal(keys[3], (b, t, h)))
        A = -jnp.exp(jax.random.normal(keys[4], (h,)))
        fn = lambda x, dt, A, B, C: la.ssd(x, dt, A, B, C, method=method, chunk_size=chunk_size)
        return fn, (v, dt, A, k[:, :, :1], q[:, :, :1])
    if form == "mlstm":  # the gate pre-activations: exp input gate, sigmoid forget gate
        i, f = jax.random.normal(keys[3], (b, t, h)), 3.0 + jax.random.normal(keys[4], (b, t, h))
        fn = lambda q, k, v, i, f: la.mlstm(q, k, v, i, f, method=method, chunk_size=chunk_size)
        return fn, (q, k, v, i, f)
    if form == "additive":
        fn = lambda q, k, v, gate: la.causal_linear_attention(
            q, k, v, gate=gate, method=method, chunk_size=chunk_size
        )
        return fn, (q, k, v, gate)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
    fn = lambda q, k, v, beta, gate: la.delta_rule(
        q, k, v, beta, gate=gate, method=method, chunk_size=chunk_size
    )
    return fn, (q, k, v, beta, gate)


@contextlib.contextmanager
def cpu_group(tokens: int | None):
    """Traces inside batch ``tokens`` per group of chunks on CPU (None: the default)."""
    default = chunking.GROUP_TOKENS_CPU
    chunking.GROUP_TOKENS_CPU = default if tokens is None else tokens
    try:
        yield
    finally:
        chunking.GROUP_TOKENS_CPU = default


def measure(
    lengths,
    repeats: int,
    scan_max: int,
    names=tuple(RECURRENCES),
    chunk_sizes=(None,),
    groups=(None,),
) -> list[dict]:
    """Forward and forward+backward of every recurrence family, chunked (at each of
    ``chunk_sizes``, None: the default, and each of ``groups`` tokens per group on CPU)
    and scan (up to ``scan_max``), one row each, printed as it is measured."""
    rows = []
    for t in lengths:
        key = jax.random.PRNGKey(t)
        q, k, v = (jax.random.normal(kk, (1, t, 8, 64)) for kk in jax.random.split(key, 3))
        cases = [("noncausal", "", None, la.linear_attention, (q, k, v))]
        for name in names:
            for size in chunk_sizes:
                for group in groups:
                    method = "chunked" + ("" if size is None else f" C={size}")
                    method += "" if group is None else f" G={group}"
                    case = recurrence_case(name, "chunked", t, chunk_size=size)
                    cases.append((name, method, group, *case))
            if t <= scan_max:
                cases.append((name, "scan", None, *recurrence_case(name, "scan", t)))
        for name, method, group, fn, args in cases:
            argnums = tuple(i for i, a in enumerate(args) if a is not None)
            grad = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a)), argnums=argnums)
            row = dict(t=t, recurrence=name, method=method)
            with cpu_group(group):
                row["fwd_ms"], row["fwd_cpu_ms"] = time_ms(jax.jit(fn), args, repeats)
                row["fwd_bwd_ms"], row["fwd_bwd_cpu_ms"] = time_ms(jax.jit(grad), args, repeats)
                row["fwd_bwd_scratch_mib"] = scratch_mib(grad, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (ending in a newline)."""
    lines = [
        "| t | recurrence | method | fwd ms (CPU ms) | fwd+bwd ms (CPU ms) | fwd+bwd scratch MiB |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['t']} | {r['recurrence']} | {r['method']} | {r['fwd_ms']:.1f} "
        f"({r.get('fwd_cpu_ms', float('nan')):.1f}) | {r['fwd_bwd_ms']:.1f} "
        f"({r.get('fwd_bwd_cpu_ms', float('nan')):.1f}) | {r['fwd_bwd_scratch_mib']:.1f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def write(rows: list[dict], out: Path) -> str:
    """``recurrences.md`` in ``out``; returns its table."""
    return write_table(out, "recurrences.md", table(rows))


def run(args: argparse.Namespace, command: str) -> None:
    """Measures at ``args.lengths``, writes to ``args.out`` and prints the table."""
    ints = lambda s: [int(x) for x in s.split(",") if x]
    names = tuple(args.families.split(",")) if args.families else tuple(RECURRENCES)
    # The flat command line's --chunk-sizes are the forms suite's; the subcommand's are these.
    own = getattr(args, "suite", None) == "recurrences" and args.chunk_sizes
    sizes = tuple(ints(args.chunk_sizes)) if own else (None,)
    groups = tuple(ints(getattr(args, "cpu_groups", "") or "")) or (None,)
    rows = measure(ints(args.lengths), args.repeats, args.scan_max, names, sizes, groups)
    print(write(rows, Path(args.out)))
