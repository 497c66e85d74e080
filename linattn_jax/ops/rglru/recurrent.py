"""The RG-LRU one token at a time: the reference recurrence (the ``"scan"`` form).

For one token with normalised input ``u`` and log recurrence ``log a``, from ``h``::

    h' = a h + u            (h' = u at a sequence start: the state is dropped)

The blocks of tokens run under ``linattn_jax.ops.chunking.scan``, so the gradient
recomputes one block at a time and stores only the states between blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking


def token_step(h, u, log_a, reset):
    """One token of every (b, h, d): the new ``h``; ``reset [b]`` bool or None."""
    if reset is not None:
        h = jnp.where(reset[:, None, None], jnp.zeros((), h.dtype), h)
    return jnp.exp(log_a) * h + u


def scan_body(state, x):
    """One block of tokens run one at a time (``chunking.scan``'s body): ``x`` and the
    result as in ``chunked.chunk_body``."""

    def token(h, xt):
        u, log_a, reset = xt
        h = token_step(h, u, log_a, reset[:, 0])
        return h, h

    final, h = jax.lax.scan(token, state, tuple(jnp.moveaxis(y, 2, 0) for y in x))
    return final, jnp.moveaxis(h, 0, 2)


def run_scan(xs, state, block_size: int):
    """``scan_body`` over blocks of ``block_size`` tokens of the time-major ``xs``:
    ``(h [b, t, h, d], final state)``."""
    return chunking.scan(scan_body, state, xs, block_size, xs[0].shape[1], time_axis=1)
