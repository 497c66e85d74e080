"""The selective scan's chunked form: inside each chunk a parallel (associative) scan of the
linear recurrence, the chunks run by the shared chunk engine.

The recurrence ``h_i = a_i h_{i-1} + w_i`` (``a_i = exp(dt_i A)`` ``[d, n]``, ``w_i = dt_i
x_i B_i``) composes as pairs: ``(a, w)`` then ``(a', w')`` is ``(a' a, a' w + w')``, an
associative operation, so ``jax.lax.associative_scan`` gives every state of a chunk of c
tokens in O(log c) steps, the state entering the chunk folded into its first ``w``. Every
factor is a decay in ``[0, 1]`` (a reset or ``exp(-inf)`` is 0): no exponent is ever
positive, no difference of cumulative sums is formed, so the result is the per-token
recurrence's whatever ``dt`` and ``A`` (exact to float32 rounding, not a factorisation).

Why not the per-channel additive (GLA) chunk form with value width one: it forms a
``[c, c, n]`` relative decay per channel, ``c`` times the recurrence's own work, with no
matmul to amortise it (one value channel); on CPU it ran 14x slower than the token scan at
2k tokens, where this form runs 2.5x faster (docs/guide/mamba.md).

The backward pass (``chunk_body_bwd``, hand-written) is the same kind of scan in reverse:
``g_i = C_i dy_i + a_{i+1} g_{i+1}`` from the state's cotangent, the chunk's states
recomputed by one forward scan. ``A`` travels in the engine's state, unchanged, so its
gradient sums over the chunks without a ``[t, d, n]`` copy; ``dt A`` is formed one chunk
at a time.

Memory: ``linattn_jax.ops.chunking.scan`` keeps only the state entering each chunk; a chunk's
``[b, d, c, n]`` states live only while it runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking
from linattn_jax.ops.selective.inputs import log_decay


def _combine(left, right):
    """Two spans of the recurrence, ``(decay, write)`` each, as one (left first)."""
    return left[0] * right[0], right[0] * left[1] + right[1]


def _decays_and_writes(h, A, u, dt, B, reset):
    """``(a [b, d, c, n], w [b, d, c, n])`` of a chunk: each token's decay (0 at a reset)
    and write ``u B``, the entering state ``h`` folded into the first write."""
    dt_tokens = jnp.swapaxes(dt, 1, 2)  # [b, c, d]
    a = jnp.swapaxes(jnp.exp(log_decay(dt_tokens, A)), 1, 2)  # [b, d, c, n], in [0, 1]
    if reset is not None:
        a = jnp.where(reset[..., None] > 0, jnp.zeros((), a.dtype), a)
    w = u[..., None] * B
    return a, w.at[:, :, 0].add(a[:, :, 0] * h)


def chunk_body(state, x):
    """One chunk (``chunking.scan``'s body).

    Args:
      state: ``(h [b, d, n], A [d, n])`` entering the chunk.
      x: ``(u [b, d, c], dt [b, d, c], B [b, 1, c, n], C [b, 1, c, n], resets [b, 1, c]
        float | None)``.

    Returns:
      ``((h after the chunk, A), y [b, d, c])``.
    """
    h, A = state
    u, dt, B, C, reset = x
    a, w = _decays_and_writes(h, A, u, dt, B.astype(h.dtype), reset)
    _, hs = jax.lax.associative_scan(_combine, (a, w), axis=2)
    y = jnp.einsum("bdcn,bcn->bdc", hs, C[:, 0].astype(h.dtype))
    return (hs[:, :, -1], A), y


def chunk_body_bwd(d_state, residuals):
    """The transpose of ``chunk_body`` (``chunking.scan``'s ``body_bwd``).

    Args:
      d_state: the cotangents ``(d h [b, d, n], d A [d, n])`` of the state after the chunk.
      residuals: ``(state entering the chunk, the chunk, y, d y [b, d, c])``.

    Returns:
      ``(the cotangents of the state entering the chunk, of the chunk's inputs)``.
    """
    d_h, d_A = d_state
    (h, A), (u, dt, B, C, reset), _, d_y = residuals
    B32, C32 = B[:, 0].astype(h.dtype), C[:, 0].astype(h.dtype)  # [b, c, n]
    a, w = _decays_and_writes(h, A, u, dt, B32[:, None], reset)
    _, hs = jax.lax.associative_scan(_combine, (a, w), axis=2)
    # g_i = dL/dh_i = C_i dy_i + a_{i+1} g_{i+1}, from the state's cotangent after the chunk.
    v = (d_y[..., None] * C32[:, None]).at[:, :, -1].add(d_h)
    a_next = jnp.concatenate([a[:, :, 1:], jnp.ones_like(a[:, :, :1])], axis=2)
    _, g = jax.lax.associative_scan(_combine, (a_next, v), axis=2, reverse=True)
    h_before = jnp.concatenate([h[:, :, None], hs[:, :, :-1]], axis=2)
    d_log_a = g * h_before * a  # through a = exp(dt A); 0 at a reset (a = 0)
    A_finite = jnp.where(jnp.isneginf(A), 0.0, A)  # log_decay's gradient there is 0
    d_dt = jnp.einsum("bdcn,dn->bdc", d_log_a, A_finite)
    d_A = d_A + jnp.where(jnp.isneginf(A), 0.0, jnp.einsum("bdcn,bdc->dn", d_log_a, dt))
    d_u = jnp.einsum("bdcn,bcn->bdc", g, B32)
    d_B = jnp.einsum("bdcn,bdc->bcn", g, u)[:, None].astype(B.dtype)
    d_C = jnp.einsum("bdcn,bdc->bcn", hs, d_y)[:, None].astype(C.dtype)
    d_reset = None if reset is None else jnp.zeros_like(reset)
    return (a[:, :, 0] * g[:, :, 0], d_A), (d_u, d_dt, d_B, d_C, d_reset)


def run_chunks(xs, state, chunk_size: int):
    """``chunk_body`` over the chunks of the time-major ``xs`` (``(u [b,t,d], dt [b,t,d],
    B [b,t,1,n], C [b,t,1,n], resets [b,t,1] | None)``) from ``state = (h, A)``:
    ``(y [b, t, d], (final h, A))``."""
    t = xs[0].shape[1]
    return chunking.scan(chunk_body, state, xs, chunk_size, t, chunk_body_bwd, time_axis=1)
