"""The RG-LRU's chunked form: an associative scan inside each chunk, the state carried
from chunk to chunk by ``linattn_jax.ops.chunking.scan``.

The recurrence ``h_t = a_t h_{t-1} + u_t`` is diagonal, so a chunk's tokens compose
exactly with the associative operator on ``(a, u, started)``::

    (a_1, u_1, s_1) then (a_2, u_2, s_2) = (a_1 a_2, a_2 u_1 + u_2, s_1 or s_2)

where a token that starts a sequence (``s = True``) drops what came before it (``where``,
not a product: a NaN before a reset stays out of it). Token i of the chunk is then
``h_i = A_i h_0 + U_i`` (or ``U_i`` once a reset was seen): products and sums of the gates,
no division and no exponent of a difference, so nothing overflows whatever the gates.

Memory: ``chunking.scan`` keeps only the state entering each chunk; the backward pass
recomputes one chunk at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking


def combine(first, second):
    """The associative operator on ``(a, u, started)`` (above)."""
    a_1, u_1, s_1 = first
    a_2, u_2, s_2 = second
    a = jnp.where(s_2, a_2, a_1 * a_2)
    u = jnp.where(s_2, u_2, a_2 * u_1 + u_2)
    return a, u, s_1 | s_2


def chunk_body(state, x):
    """One chunk (``chunking.scan``'s body).

    Args:
      state: ``h [b, h, d]`` entering the chunk.
      x: ``(u [b,h,c,d], log_a [b,h,c,d], resets [b,1,c] bool)``, ``log_a = 0`` and ``u =
        0`` at padding (the state passes through).

    Returns:
      ``(h after the chunk, h at each token [b, h, c, d])``.
    """
    u, log_a, reset = x
    started = jnp.broadcast_to(reset[..., None], u.shape)
    a, u, started = jax.lax.associative_scan(combine, (jnp.exp(log_a), u, started), axis=2)
    h = jnp.where(started, u, a * state[:, :, None] + u)
    return h[:, :, -1], h


def run_chunks(xs, state, chunk_size: int):
    """``chunk_body`` over the chunks of the time-major ``xs`` (``api``'s operands):
    ``(h [b, t, h, d], final state)``."""
    return chunking.scan(chunk_body, state, xs, chunk_size, xs[0].shape[1], time_axis=1)
