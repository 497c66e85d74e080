"""The mLSTM's chunked form: each chunk's outputs and its write to the state from masked
``[c, c]`` matmuls, the stabiliser carried exactly from chunk to chunk.

Inside a chunk of c tokens, with the stabilised state ``(C, n, m_0)`` entering it, the
log-weight of key j at query i (j <= i, same segment) and that of the entering state are::

    L_ij = A_ij + i_j,        A_ij = sum_{j < l <= i} f_l
    L_i0 = A_i0 + m_0,        A_i0 = sum_{l <= i} f_l

and ``m_i = max(L_i0, max_j L_ij)`` is exactly the per-token recurrence's
``m_i = max(f_i + m_{i-1}, i_i)`` unrolled. Every weight is then ``exp(L - m_i) <= 1``:
no gate of any size overflows. ``A`` is a cumulative sum per column (each entry sums only
its own forget gates), not a difference of whole-chunk cumulative sums: with gates of
-50 the chunk's sum reaches -3200, whose float32 rounding (2e-4) would be a relative
error in every weight. The state after the chunk is the last row's weights applied to
the keys; ``m`` after it is ``m_{c-1}``.

A segment reset at token s puts the zero state (``m = 0``) before s: the queries of its
run see neither the entering state nor the keys before s, and their maximum also holds
``A_is + f_s`` (the fresh ``m = 0`` decayed to i), as the recurrence's would.

Memory: ``linattn_jax.ops.chunking.scan`` keeps only the state entering each chunk; the
backward pass recomputes one chunk at a time (``jax.vjp`` of ``chunk_body``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from linattn_jax.ops import chunking


def chunk_body(state, x, *, dtype=None):
    """One chunk (``chunking.scan``'s body).

    Args:
      state: ``(C [b,h,d,v], n [b,h,d], m [b,h])`` entering the chunk (``m = -inf``: no
        state, as the sequence-parallel shards start).
      x: ``(q [b,h,c,d] scaled, k [b,h,c,d], v [b,h,c,v], log_i [b,h,c], log_f [b,h,c],
        live [b,1,c] bool, resets [b,1,c] bool | None)``.
      dtype: the operand dtype of the matmuls (``chunking.operand_dtype``; None: no cast).

    Returns:
      ``(state after the chunk, (numerator [b,h,c,v], denominator [b,h,c], m [b,h,c]))``,
      the numerator and denominator stabilised by each token's ``m``.
    """
    c_in, n_in, m_in = state
    q, k, v, log_i, log_f, live, reset = x
    c = q.shape[2]
    rows = jnp.arange(c).reshape(1, 1, c, 1)
    cols = jnp.arange(c).reshape(1, 1, 1, c)
    causal = rows >= cols
    neg = jnp.full((), -jnp.inf, log_f.dtype)
    # A[i, j] = sum_{j < l <= i} f_l: a cumulative sum down each column.
    pair = jnp.cumsum(jnp.where(rows > cols, log_f[..., :, None], 0.0), axis=-2)
    keys = causal & live[..., None, :]
    log_0 = jnp.cumsum(log_f, axis=-1) + m_in[..., None]
    if reset is not None:
        run = jnp.cumsum(reset.astype(jnp.int32), axis=-1)
        same = run[..., :, None] == run[..., None, :]
        keys = keys & same
        fresh = jnp.where(causal & same & reset[..., None, :], pair + log_f[..., None, :], neg)
        log_0 = jnp.where(run == 0, log_0, neg)
    log_w = jnp.where(keys, pair + log_i[..., None, :], neg)
    m = jnp.maximum(log_0, jnp.max(log_w, axis=-1))
    if reset is not None:
        m = jnp.maximum(m, jnp.max(fresh, axis=-1))
    w = jnp.exp(log_w - m[..., None])  # [b, h, c, c], <= 1
    w_0 = jnp.exp(log_0 - m)  # [b, h, c], <= 1
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    scores = mixed("bhid,bhjd->bhij", q, k) * w
    num = mixed("bhij,bhjv->bhiv", scores, v) + w_0[..., None] * mixed("bhid,bhdv->bhiv", q, c_in)
    den = jnp.sum(scores, axis=-1) + w_0 * jnp.einsum("bhid,bhd->bhi", q, n_in)
    # The state after the chunk: the last row's weights (float32 operands, as the scan).
    k_out = k * w[:, :, -1, :, None]
    c_out = w_0[:, :, -1, None, None] * c_in + jnp.einsum("bhjd,bhjv->bhdv", k_out, v)
    n_out = w_0[:, :, -1, None] * n_in + jnp.sum(k_out, axis=2)
    return (c_out, n_out, m[:, :, -1]), (num, den, m)


def run_chunks(xs, state, chunk_size: int, *, dtype=None):
    """``chunk_body`` over the chunks of the time-major ``xs`` (``api``'s operands):
    ``((numerator [b,t,h,v], denominator [b,t,h], m [b,t,h]), final state)``."""
    t = xs[0].shape[1]
    body = functools.partial(chunk_body, dtype=dtype)
    return chunking.scan(body, state, xs, chunk_size, t, time_axis=1)
