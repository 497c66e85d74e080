"""The delta rule's chunked form: the (gated) UT transform inside a chunk.

Inside a chunk of C tokens, with ``A = I + tril(diag(beta) (K K^T * D), -1)`` (D the decay
from key j to key i), ``[U | W] = A^{-1} diag(beta) [V | exp(G) * K]`` by a float32
triangular solve; then ``O = exp(G) * Q S + (Q K^T * D) (U - W S)`` and ``S_next =
exp(G_C) * S + (exp(G_C - G) * K)^T (U - W S)``. ``linattn_jax.ops.chunking`` scans the
chunks and differentiates them by ``jax.vjp`` of ``chunk_body``, from the state stored at
each chunk's start.

References:
  Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
  Length" (https://arxiv.org/abs/2406.06484).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking
from linattn_jax.typing import Array


def chunk_body(s: Array, x, *, dtype=None) -> tuple[Array, Array]:
    """One chunk of c tokens through the (gated) UT transform.

    Args:
      s: ``[b, h, dk, dv]`` before the chunk.
      x: ``(q [b,h,c,dk], k [b,h,c,dk], v [b,h,c,dv], beta [b,h,c],
        log-decay [b,h,c,1|dk] | None, segment resets | None)``.
      dtype: the operand dtype of the products that make the output only
        (``chunking.operand_dtype``; None: no cast).

    Returns:
      ``(state after the chunk, out [b, h, c, dv])``.
    """
    q, k, v, beta, g, r = x
    # Non-finite keys, values, betas or gates would reach earlier tokens as 0 * NaN in
    # the masked products and the solve: zeros here, NaN outputs from their token on.
    ok = chunking.finite_tokens(k, beta, log_decays=g)
    k, beta, g = (chunking.where_finite(ok, y) for y in (k, beta, g))
    v, bad, spoilt = chunking.finite_values(ok, v)
    dv = v.shape[-1]
    dec = chunking.decays(g, r, q.shape[:3], q.dtype)
    qk = chunking.decayed_scores(q, k, dec, diagonal=True, dtype=dtype)
    kk = chunking.decayed_scores(k, k, dec, diagonal=False)  # float32: it feeds the solve
    if dec is None:
        q_in, k_in, k_out, s_carried = q, k, k, s
    else:
        q_in, k_in, k_out = q * dec.into, k * dec.into, k * dec.out_of
        s_carried = dec.across[..., None] * s
    # (I + diag(beta) KK) [U | W] = diag(beta) [V | K_in], in float32 (the inputs are
    # float32 here whatever the caller's dtype).
    rhs = beta[..., None] * jnp.concatenate([v, k_in], axis=-1)
    uw = unit_lower_solve(beta[..., None] * kk, rhs)
    u, w = uw[..., :dv], uw[..., dv:]
    # Each token's write, given the state: float32 operands (it reaches the next state).
    u = u - jnp.einsum("bhck,bhkv->bhcv", w, s)
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    out = mixed("bhck,bhkv->bhcv", q_in, s) + mixed("bhij,bhjv->bhiv", qk, u)
    s = s_carried + jnp.einsum("bhck,bhcv->bhkv", k_out, u)
    return chunking.nan_where(spoilt, s), chunking.nan_where(bad, out)


def unit_lower_solve(lower: Array, rhs: Array, block: int = 16) -> Array:
    """``(I + lower)^{-1} rhs`` for strictly lower-triangular ``lower [..., c, c]``.

    Forward substitution: over blocks of ``block`` rows by matmuls with the rows solved
    before, and row by row inside a block. Substitution is backward stable whatever the
    system's conditioning; the nilpotent product series ``(I + N)(I + N^2)...`` cancels
    catastrophically when beta nears 2 with repeated keys (the system's entries are then
    +-2 all the way down). Elementwise products and small matmuls only: XLA's CPU
    triangular solve (a LAPACK call) hung inside the chunk scan's gradient.
    """
    c = lower.shape[-1]
    solved = []  # blocks of solved rows, [..., rows, n]
    for start in range(0, c, block):
        stop = min(start + block, c)
        r = rhs[..., start:stop, :]
        if start:
            r = r - lower[..., start:stop, :start] @ jnp.concatenate(solved, axis=-2)
        solved.append(_substitute(lower[..., start:stop, start:stop], r))
    return jnp.concatenate(solved, axis=-2)


def _substitute(lower: Array, rhs: Array) -> Array:
    """``(I + lower)^{-1} rhs`` row by row (a loop of ``lower.shape[-1]`` steps)."""

    def row(i, x):  # x holds the rows solved so far, zeros after them
        lower_i = jax.lax.dynamic_index_in_dim(lower, i, axis=-2, keepdims=False)
        rhs_i = jax.lax.dynamic_index_in_dim(rhs, i, axis=-2, keepdims=False)
        x_i = rhs_i - jnp.einsum("...j,...jn->...n", lower_i, x)
        return jax.lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

    return jax.lax.fori_loop(0, lower.shape[-1], row, jnp.zeros_like(rhs))
