"""The selective scan's chunked form: each channel a head of the per-channel-gated additive
rule (GLA's) with keys ``B``, queries ``C``, value width one and log-decays ``dt A``, run on
the shared chunk engine.

Inside a chunk of c tokens, with ``G_i = sum_{l <= i} dt_l A`` (``[d, n]`` per token, the
cumulative log-decay from the chunk's start) and the state ``h`` entering it::

    y_i = sum_{j <= i} (sum_n C_in B_jn exp(G_in - G_jn)) u_j  +  sum_n C_in exp(G_in) h_n
    h'  = exp(G_last) h + sum_j exp(G_last - G_j) B_j u_j,          u = dt x

The ``[c, c, n]`` relative decays per channel are formed by ``chunking.decayed_scores``:
masked BEFORE ``exp`` and, between sub-chunks, factored through a token between them so
that both factors are <= 1 (never ``exp(G_i) exp(-G_j)``, which overflows for strong
decays). A log-decay under ``chunking.reset_below`` (``A = -inf``, a huge ``dt``) is a
reset, as a segment's start. ``A`` travels in the engine's state, unchanged, so its
gradient sums over the chunks without a ``[t, d, n]`` copy of it; ``dt A`` is formed one
chunk at a time.

Memory: ``linattn_jax.ops.chunking.scan`` keeps only the state entering each chunk; the
backward pass recomputes one chunk at a time (``jax.vjp`` of ``chunk_body``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from linattn_jax.ops import chunking
from linattn_jax.ops.selective.inputs import log_decay


def chunk_body(state, x, *, dtype=None):
    """One chunk (``chunking.scan``'s body).

    Args:
      state: ``(h [b, d, n], A [d, n])`` entering the chunk.
      x: ``(u [b, d, c], dt [b, d, c], B [b, 1, c, n], C [b, 1, c, n], resets [b, 1, c]
        float | None)``.
      dtype: the operand dtype of the matmuls (``chunking.operand_dtype``; None: no cast).

    Returns:
      ``((h after the chunk, A), y [b, d, c])``.
    """
    h, A = state
    u, dt, B, C, reset = x
    g = log_decay(jnp.swapaxes(dt, 1, 2), A)  # [b, c, d, n]
    g = jnp.swapaxes(g, 1, 2)  # [b, d, c, n]
    dec = chunking.decays(g, None if reset is None else reset[..., None], g.shape[:3], g.dtype)
    B, C = B.astype(g.dtype), C.astype(g.dtype)
    b_d, c_d = (jnp.broadcast_to(y, g.shape) for y in (B, C))
    scores = chunking.decayed_scores(c_d, b_d, dec, diagonal=True, dtype=dtype)  # [b, d, c, c]
    B, C = B[:, 0], C[:, 0]
    y = jnp.einsum("bdij,bdj->bdi", scores, u) + jnp.einsum("bin,bdin,bdn->bdi", C, dec.into, h)
    h = dec.across * h + jnp.einsum("bjn,bdjn,bdj->bdn", B, dec.out_of, u)
    return (h, A), y


def run_chunks(xs, state, chunk_size: int, *, dtype=None):
    """``chunk_body`` over the chunks of the time-major ``xs`` (``(u [b,t,d], dt [b,t,d],
    B [b,t,1,n], C [b,t,1,n], resets [b,t,1] | None)``) from ``state = (h, A)``:
    ``(y [b, t, d], (final h, A))``."""
    t = xs[0].shape[1]
    body = functools.partial(chunk_body, dtype=dtype)
    return chunking.scan(body, state, xs, chunk_size, t, time_axis=1)
