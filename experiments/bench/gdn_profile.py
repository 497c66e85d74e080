"""Where Gated DeltaNet's chunked form spends its time on CPU: each piece of the chunk
body timed in isolation, in a ``lax.scan`` over the chunks of a ``t``-token sequence
(as ``chunking.scan`` runs it: one chunk of ``[b, h, c, .]`` per step), beside the whole
forward and forward+backward, and the float32 rate of the chunk's matmul shapes (batched
over the heads, in the same scan) against one large matmul's.

``python -m experiments.bench.gdn_profile --length 8192 --repeats 5`` (run it pinned,
``taskset -c 1``); process CPU ms, the minimum of ``--repeats`` calls after a warm-up.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from experiments.bench.recurrences import recurrence_case
from linattn_jax.ops import chunking
from linattn_jax.ops.delta import chunked


def cpu_ms(fn, args, repeats: int) -> float:
    """The minimum process CPU ms of ``fn(*args)`` over ``repeats`` calls (after one)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        jax.block_until_ready(fn(*args))
        best = min(best, time.process_time() - start)
    return 1e3 * best


def _total(tree) -> jax.Array:
    return sum(jnp.sum(y) for y in jax.tree.leaves(tree))


def over_chunks(piece):
    """``piece(*chunk)`` for every chunk of chunk-major inputs ``[n, ...]``, in a scan
    whose carry sums every output (so nothing is dropped)."""

    def run(*xs):
        def step(acc, x):
            return acc + _total(piece(*x)), None

        return jax.lax.scan(step, jnp.zeros(()), xs)[0]

    return jax.jit(run)


def chunk_inputs(t: int, c: int, b: int = 1, h: int = 8, d: int = 64):
    """The chunk-major inputs of every piece: ``[n, b, h, c, .]``."""
    _, (q, k, v, beta, gate) = recurrence_case("gated_deltanet", "chunked", t, b, h, d)
    n = t // c
    heads = lambda x: jnp.moveaxis(x, 1, 2)  # [b, t, h, .] -> [b, h, t, .]
    cut = lambda x: jnp.moveaxis(x.reshape(x.shape[:2] + (n, c) + x.shape[3:]), 2, 0)
    q, k, v = (cut(heads(x)) for x in (q, k, v))
    beta, g = cut(heads(beta[..., None]))[..., 0], cut(heads(gate[..., None]))
    s = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (n, b, h, d, d))
    return q, k, v, beta, g, s


def pieces(c: int):
    """``name -> (function of one chunk, which inputs)``."""

    def scores(q, k, v, beta, g):
        dec = chunking.decays(g, None, q.shape[:3], q.dtype)
        qk = chunking.decayed_scores(q, k, dec, diagonal=True)
        kk = chunking.decayed_scores(k, k, dec, diagonal=False)
        return qk, kk, q * dec.into, k * dec.out_of

    def solve(q, k, v, beta, g):
        lower = jnp.tril(beta[..., None] * jnp.einsum("...id,...jd->...ij", k, k), -1)
        rhs = beta[..., None] * jnp.concatenate([v, k], -1)
        return chunked.unit_lower_solve(lower, rhs)

    def lower_rhs(q, k, v, beta, g):  # what ``solve`` costs beyond the solve itself
        lower = jnp.tril(beta[..., None] * jnp.einsum("...id,...jd->...ij", k, k), -1)
        return lower, beta[..., None] * jnp.concatenate([v, k], -1)

    def parts(q, k, v, beta, g):
        return chunked.chunk_parts((q, k, v, beta, g, None))

    def transition(q, k, v, beta, g, s):  # M = K^T W, B = K^T U and one state step
        m = jnp.einsum("bhck,bhcl->bhkl", k, q)
        b_ = jnp.einsum("bhck,bhcv->bhkv", k, v)
        return g[..., 0, :, None] * s - jnp.einsum("bhkl,bhlv->bhkv", m, s) + b_

    def outputs(q, k, v, beta, g, s):
        scores = jnp.tril(jnp.einsum("...id,...jd->...ij", q, k))
        return chunked.chunk_outputs((q, scores, k, v), s)

    def body(q, k, v, beta, g, s):
        return chunked.group_body(s, (q, k, v, beta, g, None), c=c, groups=1)

    def body_bwd(q, k, v, beta, g, s):
        out = v
        return chunked.group_body_bwd(s, (s, (q, k, v, beta, g, None), out, v), c=c, groups=1)

    def parts_vjp(q, k, v, beta, g):
        x = (q, k, v, beta, g, None)
        p, vjp = jax.vjp(lambda x: chunked.chunk_parts(x), x)
        return vjp(jax.tree.map(jnp.ones_like, p))

    def solve_bwd(q, k, v, beta, g):
        lower = jnp.tril(beta[..., None] * jnp.einsum("...id,...jd->...ij", k, k), -1)
        rhs = beta[..., None] * jnp.concatenate([v, k], -1)
        x, vjp = jax.vjp(chunked.unit_lower_solve, lower, rhs)
        return vjp(x)

    def direct(q, k, v, beta, g, s):
        return chunked.chunk_body(s, (q, k, v, beta, g, None), c=c, groups=1)

    def direct_bwd(q, k, v, beta, g, s):
        return chunked.chunk_body_bwd(s, (s, (q, k, v, beta, g, None), v, v), c=c, groups=1)

    def local_vjp(q, k, v, beta, g):
        local = functools.partial(chunked.chunk_local, c=c, groups=1)
        p, vjp = jax.vjp(local, (q, k, v, beta, g, None))
        return vjp(jax.tree.map(jnp.ones_like, p))

    def local(q, k, v, beta, g):
        return chunked.chunk_local((q, k, v, beta, g, None), c=c, groups=1)

    five, six = (0, 1, 2, 3, 4), (0, 1, 2, 3, 4, 5)
    return {
        "decays, Q K^T, K K^T (masked)": (scores, five),
        "triangular solve [U|W] (incl. forming it)": (solve, five),
        "  forming the system only": (lower_rhs, five),
        "chunk_parts (all of the above + M, B)": (parts, five),
        "M, B and one state step": (transition, six),
        "chunk_outputs (U - W S, Q S, scores U)": (outputs, six),
        "group_body (one chunk, forward)": (body, six),
        "group_body_bwd (one chunk)": (body_bwd, six),
        "  vjp of chunk_parts (fwd + bwd)": (parts_vjp, five),
        "  solve fwd + bwd": (solve_bwd, five),
        "chunk_body (one chunk, direct update)": (direct, six),
        "  chunk_local (scores, decays, solve)": (local, five),
        "chunk_body_bwd (one chunk)": (direct_bwd, six),
        "  vjp of chunk_local (fwd + bwd)": (local_vjp, five),
    }


MATMULS = {  # name: (einsum, a's shape, b's shape), per chunk, batched over b=1, h=8
    "[32,32]x[32,64]  (scores U, solve rhs)": ("bhij,bhjv->bhiv", (1, 8, 32, 32), (1, 8, 32, 64)),
    "[32,64]x[64,32]  (Q K^T, K K^T)": ("bhif,bhjf->bhij", (1, 8, 32, 64), (1, 8, 32, 64)),
    "[32,64]x[64,64]  (W S, Q S)": ("bhck,bhkv->bhcv", (1, 8, 32, 64), (1, 8, 64, 64)),
    "[64,32]x[32,64]  (K^T U, K^T W)": ("bhck,bhcv->bhkv", (1, 8, 32, 64), (1, 8, 32, 64)),
    "[64,64]x[64,64]  (M S)": ("bhkl,bhlv->bhkv", (1, 8, 64, 64), (1, 8, 64, 64)),
    "[64,64]x[64,64], one per step": ("kl,lv->kv", (64, 64), (64, 64)),
}


def matmul_rates(n: int, repeats: int) -> list[tuple[str, float, float]]:
    """``(shape, CPU ms for n, GFLOP/s)`` of each chunk shape in a scan of ``n`` steps,
    and of one 1024^3 matmul."""
    rows = []
    key = jax.random.PRNGKey(0)
    for name, (spec, sa, sb) in MATMULS.items():
        a = jax.random.normal(key, (n, *sa))
        b = jax.random.normal(key, (n, *sb))
        fn = over_chunks(functools.partial(jnp.einsum, spec))
        ms = cpu_ms(fn, (a, b), repeats)
        out = jax.eval_shape(functools.partial(jnp.einsum, spec), a[0], b[0])
        ins, res = spec.split("->")
        first = ins.split(",")[0]
        inner = [sa[i] for i, letter in enumerate(first) if letter not in res][0]
        flops = 2 * n * out.size * inner
        rows.append((name, ms, flops / ms / 1e6))
    x = jax.random.normal(key, (1024, 1024))
    ms = cpu_ms(jax.jit(jnp.dot), (x, x), repeats)
    rows.append(("[1024,1024]x[1024,1024], one call", ms, 2 * 1024**3 / ms / 1e6))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    t, c, r = args.length, args.chunk_size, args.repeats
    fn, whole = recurrence_case("gated_deltanet", "chunked", t, chunk_size=c)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2, 3, 4)))
    fwd_ms, both_ms = cpu_ms(jax.jit(fn), whole, r), cpu_ms(grad, whole, r)
    print(f"| whole forward (la.delta_rule) | {fwd_ms:.1f} | 100% of fwd |")
    print(f"| whole forward+backward | {both_ms:.1f} | 100% of fwd+bwd |")
    xs = chunk_inputs(t, c)
    for name, (piece, which) in pieces(c).items():
        ms = cpu_ms(over_chunks(piece), tuple(xs[i] for i in which), r)
        print(f"| {name} | {ms:.1f} | {100 * ms / fwd_ms:.0f}% / {100 * ms / both_ms:.0f}% |")
    empty = over_chunks(lambda q: q)
    print(f"| scan over chunks, summing q only | {cpu_ms(empty, xs[:1], r):.1f} | |")
    for name, ms, rate in matmul_rates(t // c, r):
        print(f"| {name} | {ms:.2f} | {rate:.1f} GFLOP/s |")


if __name__ == "__main__":
    main()
