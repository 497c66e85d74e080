"""The delta rule's unit-lower-triangular systems, batched over every chunk of a sequence
as the chunked form solves them: ``(I + L) X = R`` with ``L [b, h, n, c, c]`` (strictly
lower, ``beta * K K^T`` of unit keys) and ``R [b, h, n, c, dk + dv]``, forward and
forward+backward (grad of a sum of ``sin(X)`` w.r.t. L and R), float32 and bfloat16
inputs (solved in float32, as the chunked form does), for each method:

* ``xla``: ``lax.linalg.triangular_solve`` (LAPACK on CPU, cuBLAS trsm on GPU);
* ``inverse``: ``(I + L)^{-1}`` by ``triangular_solve`` on the identity, then a matmul
  (MaxText's ``jax_chunk_gated_delta_rule``);
* ``series``: the nilpotent product series ``(I - L)(I + L^2)(I + L^4)...`` (log2 c
  matmuls; unstable for beta near 2 with repeated keys);
* ``blocked``: blocked forward substitution with a hand-written gradient (the library's
  CPU choice, ``ops.delta.chunked.blocked_solve``).

Each (method, dtype) runs in its own process under a time limit: XLA's CPU triangular
solve has hung in this benchmark and inside the chunk scan's gradient.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments.bench.timing import time_ms, write_table

METHODS = ("blocked", "series", "xla", "inverse")


def _series(lower, rhs):
    c = lower.shape[-1]
    p, x, k = -lower, rhs, 1
    while k < c:
        x, k = x + p @ x, 2 * k
        if k < c:
            p = p @ p
    return x


def _inverse(lower, rhs):
    from linattn_jax.ops.delta.chunked import xla_solve

    eye = jnp.broadcast_to(jnp.eye(lower.shape[-1], dtype=lower.dtype), lower.shape)
    return xla_solve(lower, eye) @ rhs


def solver(method: str):
    """``(lower, rhs) -> X`` for one method."""
    from linattn_jax.ops.delta import chunked

    return dict(
        xla=chunked.xla_solve, inverse=_inverse, series=_series, blocked=chunked.blocked_solve
    )[method]


def system(t: int, c: int, dtype, h: int = 8, d: int = 64):
    """``(L, R)`` of a sequence of ``t`` tokens in chunks of ``c``."""
    keys = jax.random.split(jax.random.PRNGKey(c), 3)
    k = jax.random.normal(keys[0], (1, h, t // c, c, d))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(jax.random.normal(keys[1], (1, h, t // c, c, 1)))
    lower = jnp.tril(beta * (k @ jnp.swapaxes(k, -1, -2)), -1)
    rhs = jax.random.normal(keys[2], (1, h, t // c, c, 2 * d))
    return lower.astype(dtype), rhs.astype(dtype)


def measure_one(method: str, t: int, c: int, dtype: str, repeats: int) -> dict:
    lower, rhs = system(t, c, jnp.dtype(dtype))
    solve = solver(method)
    fn = lambda lower, rhs: solve(lower.astype(jnp.float32), rhs.astype(jnp.float32))
    grad = jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1))
    ref = solver("blocked")(lower.astype(jnp.float32), rhs.astype(jnp.float32))
    x = jax.jit(fn)(lower, rhs)
    error = float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))
    row = dict(t=t, c=c, dtype=dtype, method=method)
    row["fwd_ms"], row["fwd_cpu_ms"] = time_ms(jax.jit(fn), (lower, rhs), repeats)
    row["fwd_bwd_ms"], row["fwd_bwd_cpu_ms"] = time_ms(jax.jit(grad), (lower, rhs), repeats)
    row["error_vs_blocked"] = error
    return row


def measure(t: int, chunk_sizes, repeats: int, limit_s: float) -> list[dict]:
    rows = []
    for c in chunk_sizes:
        for dtype in ("float32", "bfloat16"):
            for method in METHODS:
                args = [sys.executable, "-m", "experiments.bench.triangular", "--one"]
                args += [method, str(t), str(c), dtype, str(repeats)]
                row = dict(t=t, c=c, dtype=dtype, method=method)
                try:
                    done = subprocess.run(args, capture_output=True, text=True, timeout=limit_s)
                    lines = done.stdout.strip().splitlines()
                    if lines:
                        row = json.loads(lines[-1])
                    else:
                        row["failed"] = (done.stderr.strip().splitlines() or [""])[-1]
                except subprocess.TimeoutExpired:
                    row["hung_after_s"] = limit_s
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| c | inputs | method | fwd ms | fwd+bwd ms | error vs blocked |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "hung_after_s" in r:
            cells = f"did not finish in {r['hung_after_s']:.0f} s | | "
        elif "failed" in r:
            cells = f"failed: {r['failed'][:60]} | | "
        else:
            cells = f"{r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | {r['error_vs_blocked']:.1e}"
        lines.append(f"| {r['c']} | {r['dtype']} | {r['method']} | {cells} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, command: str) -> None:
    """Measures at the first of ``args.lengths``, writes ``triangular.md`` to ``args.out``."""
    t = int(args.lengths.split(",")[0])
    sizes = [int(x) for x in args.chunk_sizes.split(",") if x]
    text = table(measure(t, sizes, args.repeats, args.limit_s))
    print(write_table(Path(args.out), "triangular.md", text, command))


if __name__ == "__main__" and sys.argv[1:2] == ["--one"]:
    method, t, c, dtype, repeats = sys.argv[2:]
    print(json.dumps(measure_one(method, int(t), int(c), dtype, int(repeats))))
