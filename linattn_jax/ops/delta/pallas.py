"""The delta rule and Gated DeltaNet as a Pallas kernel: ``causal(..., method="pallas")``.

One kernel program per (batch, value head) walks that head's chunks in order with the
state ``S [dk, dv]`` in float32 in registers (or VMEM). Inside a chunk of C tokens it does
what ``chunked.py`` does for every chunk at once, the gated UT transform:

* the decays from the chunk's cumulative log-gates ``G`` and its runs between resets
  (``r``, the resets so far inside the chunk), masked before ``exp``;
* ``A = I + tril(diag(beta) (K K^T * D), -1)`` and its inverse ``T = A^{-1}`` by forward
  substitution, one row per step, on the ``[C, C]`` tile (row selections by iota masks,
  no dynamic indexing of values, so the same code lowers to Triton, Mosaic TPU and the
  interpreter);
* ``U = T diag(beta) V``, ``W = T diag(beta) (exp(G) * K)``, the writes ``U - W S``, the
  outputs ``O = (exp(G) * Q) S + (Q K^T * D) (U - W S)`` and the next state
  ``S' = exp(G_C) S + (exp(G_C - G) * K)^T (U - W S)``.

What stays in XLA around the kernel (``causal_chunks``): the non-finite screening of
``chunked._finite_inputs`` and ``chunking.nan_from`` (the kernel sees finite inputs only),
key masks (zeroed tokens, by the caller), padding to whole chunks (zero tokens are
inert), head grouping (q and k repeated to the value heads), and the gates' cumulative sums
per chunk and the reset runs, so that the kernel reads two ``[C, 1]`` columns per chunk.

Backends (``jax.lax.platform_dependent``): on GPU the Triton lowering of Pallas (the
kernel is plain array code: ``jnp.dot``, ``exp``, ``where``, reductions; Mosaic GPU's
warpgroup model would need a rewrite); on TPU Mosaic TPU; on CPU the Pallas interpreter
(slow: for tests, the XLA ``"chunked"`` form is the one to use there).

The gradient: ``jax.custom_vjp`` whose backward is the XLA chunked form's own hand-written
backward (``chunked.causal_chunks`` under ``jax.vjp``, from the saved inputs); it is exact
(the same function) but recomputes the forward in XLA. A backward kernel is not written yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from linattn_jax.ops import chunking
from linattn_jax.ops.delta import chunked
from linattn_jax.ops.delta.state import repeat_heads
from linattn_jax.typing import Array

# The chunk sizes the kernel takes: Triton wants power-of-two tiles of at least 16 for its
# dots, Mosaic TPU multiples of 8 on the sublane axis.
CHUNK_SIZES = (16, 32, 64, 128)
CHUNK_SIZE = 64


def check_supported(*, chunk_size, gate_channels: int, dtype, dk: int, dv: int) -> int:
    """The chunk size ``method="pallas"`` runs with, or a ``ValueError`` naming the option
    it does not support."""
    if gate_channels > 1:
        raise ValueError(
            'method="pallas" supports a gate per head ([batch, length, heads]) or none, got '
            f"a gate per key channel (width {gate_channels}): use method='chunked' for KDA"
        )
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f'method="pallas" supports float32, bfloat16 and float16 q, got {dtype}')
    for name, d in (("key", dk), ("value", dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(
                f'method="pallas" needs a {name} head width that is a power of two >= 16, got {d}'
            )
    size = CHUNK_SIZE if chunk_size is None else chunk_size
    if size not in CHUNK_SIZES:
        raise ValueError(f'method="pallas" needs chunk_size in {CHUNK_SIZES}, got {chunk_size}')
    return size


def causal_chunks(xs, state: Array, chunk_size: int, length: int, *, groups: int = 1):
    """``chunked.causal_chunks`` (same arguments and results, heads-first layout) by the
    Pallas kernel; the gradient is the chunked form's (see the module's docstring)."""
    return _causal(chunk_size, length, groups, xs, state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _causal(chunk_size, length, groups, xs, state):
    xs, first_v = chunked._finite_inputs(xs, groups)
    out, final = _run(xs, state, chunk_size, length, groups)
    out = chunking.nan_from(first_v, out, 2)
    return out, jnp.where(first_v < length, jnp.full((), jnp.nan, final.dtype), final)


def _causal_fwd(chunk_size, length, groups, xs, state):
    return _causal(chunk_size, length, groups, xs, state), (xs, state)


def _causal_bwd(chunk_size, length, groups, residuals, cotangents):
    xs, state = residuals
    run = functools.partial(chunked.causal_chunks, length=length, groups=groups)
    _, vjp = jax.vjp(lambda x, s: run(x, s, chunk_size), xs, state)
    return vjp(cotangents)


_causal.defvjp(_causal_fwd, _causal_bwd)


def _run(xs, state: Array, c: int, length: int, groups: int):
    """The kernel on finite inputs: pads, folds the heads into the batch, and forms the
    per-chunk cumulative log-gates and reset runs."""
    q, k, v, beta, g, r = xs
    q, k = (repeat_heads(y, groups, 1) for y in (q, k))
    b, h, _, dk = q.shape
    dv = v.shape[-1]
    n = max(1, -(-length // c))
    pad = n * c - length
    dtype = state.dtype

    def padded(x, width):  # [b, h', t, width] -> [b, h, n*c, width], float32 (or f64)
        x = jnp.broadcast_to(x, (b, h, length, width)).astype(dtype)
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))

    q, k, v = padded(q, dk), padded(k, dk), padded(v, dv)
    beta = padded(beta[..., None], 1)
    zeros = jnp.zeros((b, h, n * c, 1), dtype)
    g = zeros if g is None else padded(g, 1)
    r = zeros if r is None else padded(r, 1)
    # A log-decay under reset_below is a reset (chunking.decays): never a huge cumulative sum.
    reset = g < chunking.reset_below(dtype)
    g = jnp.where(reset, 0.0, g)
    r = jnp.maximum(r, reset.astype(dtype))
    per_chunk = lambda x: jnp.cumsum(x.reshape(b, h, n, c, 1), axis=3).reshape(b, h, n * c, 1)
    g_cum, runs = per_chunk(g), per_chunk(r)
    flat = lambda x: x.reshape((b * h,) + x.shape[2:])
    ins = [flat(x) for x in (q, k, v, beta, g_cum, runs)] + [flat(state)]
    out, final = jax.lax.platform_dependent(
        *ins,
        cpu=functools.partial(_call, c=c, backend="interpret"),
        cuda=functools.partial(_call, c=c, backend="triton"),
        rocm=functools.partial(_call, c=c, backend="triton"),
        tpu=functools.partial(_call, c=c, backend="tpu"),
    )
    out = out.reshape(b, h, n * c, dv)[:, :, :length]
    return out, final.reshape(b, h, dk, dv)


def _call(q, k, v, beta, g_cum, runs, state, *, c: int, backend: str):
    """``pallas_call`` over the ``[b * h]`` heads: ``(out [bh, n*c, dv], final [bh, dk, dv])``."""
    bh, tokens, dk = q.shape
    dv = v.shape[-1]
    spec = lambda *shape: pl.BlockSpec((None, *shape), lambda i: (i,) + (0,) * len(shape))
    options = {}
    if backend == "interpret":
        options["interpret"] = True
    elif backend == "triton":
        from jax.experimental.pallas import triton as pl_triton

        options["compiler_params"] = pl_triton.CompilerParams(num_warps=4, num_stages=1)
    kernel = functools.partial(_kernel, c=c, n=tokens // c)
    return pl.pallas_call(
        kernel,
        grid=(bh,),
        in_specs=[
            spec(tokens, dk),
            spec(tokens, dk),
            spec(tokens, dv),
            spec(tokens, 1),
            spec(tokens, 1),
            spec(tokens, 1),
            spec(dk, dv),
        ],
        out_specs=[spec(tokens, dv), spec(dk, dv)],
        out_shape=[
            jax.ShapeDtypeStruct((bh, tokens, dv), state.dtype),
            jax.ShapeDtypeStruct((bh, dk, dv), state.dtype),
        ],
        name="delta_rule_chunked_fwd",
        **options,
    )(q, k, v, beta, g_cum, runs, state)


def _dot(a, b, contract=(1, 0)):
    """``a @ b`` contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``, float32
    accumulation."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(a.dtype)


def _as_row(col: Array, eye: Array) -> Array:
    """A ``[c, 1]`` column as a ``[1, c]`` row (a masked reduction: no transpose of a
    vector, which not every Pallas backend lowers)."""
    return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def _kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, run_ref, s0_ref, o_ref, s_ref, *, c, n):
    dtype = s0_ref.dtype
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = rows == cols
    last = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1

    def chunk(i, s):
        at = pl.ds(pl.multiple_of(i * c, c), c)
        q, k, v = q_ref[at, :], k_ref[at, :], v_ref[at, :]
        beta, g, run = beta_ref[at, :], g_ref[at, :], run_ref[at, :]
        g_row, run_row, beta_row = (_as_row(x, eye) for x in (g, run, beta))
        g_last = jnp.sum(jnp.where(last, g, 0.0), axis=0, keepdims=True)  # [1, 1]
        run_last = jnp.sum(jnp.where(last, run, 0.0), axis=0, keepdims=True)
        same = run == run_row  # [c, c]: tokens i and j in one run between resets
        # D[i, j] = exp(G_i - G_j) for j <= i in one run, 0 elsewhere: masked before exp.
        below = (rows >= cols) & same
        decay = jnp.where(below, jnp.exp(jnp.where(below, g - g_row, 0.0)), 0.0)
        # The lower factor transposed, Lt[j, i] = L[i, j] = beta_i (k_i . k_j) D[i, j],
        # built directly (K K^T is symmetric), so that the substitution reads columns.
        above = (cols > rows) & same
        decay_t = jnp.where(above, jnp.exp(jnp.where(above, g_row - g, 0.0)), 0.0)
        lower_t = _dot(k, k, (1, 1)) * decay_t * beta_row

        # T = (I + L)^{-1} by forward substitution: T_i = e_i - sum_{j<i} L_ij T_j.
        def substitute(row, t):
            l_i = jnp.sum(jnp.where(cols == row, lower_t, 0.0), axis=1, keepdims=True)
            t_i = jnp.where(cols == row, 1.0, 0.0) - jnp.sum(l_i * t, axis=0, keepdims=True)
            return jnp.where(rows == row, t_i, t)

        inv = jax.lax.fori_loop(1, c, substitute, eye.astype(dtype))
        into = jnp.where(run == 0.0, jnp.exp(g), 0.0)  # [c, 1]: decay from the chunk's start
        out_of = jnp.where(run == run_last, jnp.exp(g_last - g), 0.0)  # to the chunk's end
        across = jnp.where(run_last == 0.0, jnp.exp(g_last), 0.0)  # [1, 1]
        u = _dot(inv, beta * v)
        w = _dot(inv, beta * into * k)
        u = u - _dot(w, s)  # each token's write, given the state entering the chunk
        scores = _dot(q, k, (1, 1)) * decay
        o_ref[at, :] = _dot(into * q, s) + _dot(scores, u)
        return across * s + _dot(out_of * k, u, (0, 0))

    s_ref[...] = jax.lax.fori_loop(0, n, chunk, s0_ref[...])
