"""The selective scan one token at a time: the reference recurrence (the ``"scan"`` form)
and the token update that ``step`` shares.

For one token with ``u = dt x`` ``[b, d]``, ``dt [b, d]``, ``B, C [b, n]`` from ``h [b, d, n]``::

    h' = exp(dt A) h + u B^T
    y  = h' C

The blocks of tokens run under ``linattn_jax.ops.chunking.scan``, so the gradient
recomputes one block at a time and stores only the states between blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking
from linattn_jax.ops.selective.inputs import log_decay


def token_step(h, A, u, dt, B, C):
    """One token of every (b, d): ``(h' [b, d, n], y [b, d])``."""
    h = jnp.exp(log_decay(dt, A)) * h + u[..., None] * B[:, None].astype(h.dtype)
    return h, jnp.einsum("bdn,bn->bd", h, C.astype(h.dtype))


def scan_body(state, x):
    """One block of tokens run one at a time (``chunking.scan``'s body).

    Args:
      state: ``(h [b, d, n], A [d, n])`` before the block.
      x: ``(u [b, d, c], dt [b, d, c], B [b, 1, c, n], C [b, 1, c, n], resets [b, 1, c]
        | None)``; a reset zeroes the state before its token.

    Returns:
      ``((h after the block, A), y [b, d, c])``.
    """
    h, A = state
    seq = lambda y: None if y is None else jnp.moveaxis(y, 2, 0)

    def token(h, xt):
        u, dt, B, C, reset = xt
        if reset is not None:
            h = jnp.where(reset[..., None] > 0, jnp.zeros((), h.dtype), h)
        return token_step(h, A, u, dt, B[:, 0], C[:, 0])

    h, y = jax.lax.scan(token, h, tuple(seq(y) for y in x))
    return (h, A), jnp.moveaxis(y, 0, 2)


def run_scan(xs, state, block_size: int):
    """``scan_body`` over blocks of ``block_size`` tokens of the time-major ``xs`` (as
    ``chunked.run_chunks``'s): ``(y [b, t, d], (final h, A))``."""
    t = xs[0].shape[1]
    return chunking.scan(scan_body, state, xs, block_size, t, time_axis=1)
