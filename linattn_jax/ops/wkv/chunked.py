"""The WKV's chunked form: each chunk's outputs and its write to the state from masked
``[c, c]`` weights per channel, the stabiliser carried exactly from chunk to chunk.

Inside a chunk of c tokens, with the stabilised state ``(num, den, m_0)`` entering it, the
log weight of key j at the output of token i (j < i, same segment), of token i's own key
(with the bonus u) and of the entering state are::

    L_ij = k_j + A_ij,        A_ij = sum_{j < l < i} w_l
    L_ii = u_i + k_i
    L_i0 = m_0 + A_i0,        A_i0 = sum_{l < i} w_l

and the output is ``sum_j exp(L_ij - p_i) v_j / sum_j exp(L_ij - p_i)`` with ``p_i`` the
largest of them: every weight is ``<= 1``, no key of any size overflows. The state after
the chunk is the row ``i = c`` without the bonus term; its ``m`` is exactly the per-token
recurrence's ``m' = max(m + w, k)`` unrolled. ``A`` is a cumulative sum per column (each
entry sums only its own decays), so a long chunk adds no rounding of a whole-chunk sum.

A segment reset at token s puts the empty state before s: the outputs of its run see
neither the entering state nor the keys before s; a run without keys keeps the empty
state's ``m`` (``EMPTY``).

Memory: ``linattn_jax.ops.chunking.scan`` keeps only the state entering each chunk; the
backward pass recomputes one chunk at a time (``jax.vjp`` of ``chunk_body``). A chunk holds
``[c + 1, c]`` weights per channel.
"""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax.ops import chunking
from linattn_jax.ops.wkv import inputs


def chunk_body(state, x):
    """One chunk (``chunking.scan``'s body).

    Args:
      state: ``(num, den, m)`` entering the chunk, each ``[b, h, d]``.
      x: ``(k, v, w, u [b,h,c,d], live [b,1,c] bool | None, resets [b,1,c] bool | None)``;
        ``live`` None: every token is real.

    Returns:
      ``(state after the chunk, (numerator, denominator, stabiliser) each [b,h,c,d])``,
      the numerator and denominator stabilised by each token's own stabiliser.
    """
    num_in, den_in, m_in = state
    k, v, w, u, live, reset = x
    c = k.shape[2]
    rows = jnp.arange(c + 1).reshape(1, 1, c + 1, 1, 1)  # row c: the state after the chunk
    cols = jnp.arange(c).reshape(1, 1, 1, c, 1)
    neg = jnp.full((), -jnp.inf, k.dtype)
    # w_before[r] = w[r - 1]; A[i, j] = sum_{j + 1 < r <= i} w_before[r], down each column.
    w_before = jnp.pad(w, ((0, 0), (0, 0), (1, 0), (0, 0)))  # [b, h, c + 1, d]
    pair = jnp.cumsum(jnp.where(rows > cols + 1, w_before[:, :, :, None], 0.0), axis=2)
    log_0 = jnp.cumsum(w_before, axis=2) + m_in[:, :, None]  # [b, h, c + 1, d]
    keys = cols < rows
    if live is not None:
        keys = keys & live[:, :, None, :, None]
    if reset is not None:
        run = jnp.cumsum(reset.astype(jnp.int32), axis=-1)
        run = jnp.concatenate([run, run[..., -1:]], axis=-1)  # row c is in the last run
        keys = keys & (run[..., :, None] == run[..., None, :c])[..., None]
        log_0 = jnp.where((run == 0)[..., None], log_0, neg)
    log_w = jnp.where(keys, pair + k[:, :, None], neg)  # [b, h, c + 1, c, d]
    bonus = u + k  # [b, h, c, d]
    m = inputs.floor(jnp.maximum(log_0, jnp.max(log_w, axis=3)))  # [b, h, c + 1, d]
    p = jnp.maximum(m[:, :, :c], bonus)
    weights = jnp.exp(log_w[:, :, :c] - p[:, :, :, None])
    w_0, w_bonus = jnp.exp(log_0[:, :, :c] - p), jnp.exp(bonus - p)
    num = w_0 * num_in[:, :, None] + jnp.sum(weights * v[:, :, None], axis=3) + w_bonus * v
    den = w_0 * den_in[:, :, None] + jnp.sum(weights, axis=3) + w_bonus
    # The state after the chunk: row c, against its own stabiliser.
    m_out = m[:, :, c]
    last = jnp.exp(log_w[:, :, c] - m_out[:, :, None])  # [b, h, c, d]
    carry = jnp.exp(log_0[:, :, c] - m_out)
    num_out = carry * num_in + jnp.sum(last * v, axis=2)
    den_out = carry * den_in + jnp.sum(last, axis=2)
    return (num_out, den_out, m_out), (num, den, p)


def run_chunks(xs, state, chunk_size: int):
    """``chunk_body`` over the chunks of the time-major ``xs`` (``api``'s operands):
    ``((numerator, denominator, stabiliser) [b,t,h,d], final state)``."""
    t = xs[0].shape[1]
    return chunking.scan(chunk_body, state, xs, chunk_size, t, time_axis=1)
