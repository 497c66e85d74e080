"""The mLSTM one token at a time: the reference recurrence (the ``"scan"`` form) and the
token update that ``step`` shares.

For one token with query ``q`` (already scaled), key ``k``, value ``v``, log input gate
``i`` and log forget gate ``f``, from the stabilised state ``(C, n, m)``::

    m' = max(f + m, i)
    C' = exp(f + m - m') C + exp(i - m') k v^T
    n' = exp(f + m - m') n + exp(i - m') k
    out = (q^T C', q^T n', m')                  (numerator, denominator, stabiliser)

Both exponents are <= 0, whatever the gates. The blocks of tokens run under
``linattn_jax.ops.chunking.scan``, so the gradient recomputes one block at a time and
stores only the states between blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking


def token_step(state, q, k, v, log_i, log_f):
    """One live token of every (b, h): ``(the new state, (numerator [b,h,v], denominator
    [b,h], m [b,h]))``; ``q, k [b,h,d]``, ``v [b,h,v]``, gates ``[b,h]``."""
    c, n, m = state
    m_new = jnp.maximum(log_f + m, log_i)
    forget = jnp.exp(log_f + m - m_new)
    write = jnp.exp(log_i - m_new)[..., None] * k
    c = forget[..., None, None] * c + write[..., :, None] * v[..., None, :]
    n = forget[..., None] * n + write
    num = jnp.einsum("bhd,bhdv->bhv", q, c)
    den = jnp.einsum("bhd,bhd->bh", q, n)
    return (c, n, m_new), (num, den, m_new)


def scan_body(state, x):
    """One block of tokens run one at a time (``chunking.scan``'s body).

    Args:
      state: ``(C [b,h,d,v], n [b,h,d], m [b,h])`` before the block.
      x: ``(q [b,h,c,d], k [b,h,c,d], v [b,h,c,v], log_i [b,h,c], log_f [b,h,c], live
        [b,1,c] bool, resets [b,1,c] bool | None)``. A reset puts the zero state (``m =
        0``) before its token; a dead token leaves the state as it is.

    Returns:
      ``(state after the block, (numerator [b,h,c,v], denominator [b,h,c], m [b,h,c]))``.
    """
    seq = lambda y: None if y is None else jnp.moveaxis(y, 2, 0)

    def token(s, xt):
        q, k, v, log_i, log_f, live, reset = xt
        if reset is not None:
            s = tuple(jnp.where(_expand(reset, y), jnp.zeros((), y.dtype), y) for y in s)
        s_new, out = token_step(s, q, k, v, log_i, log_f)
        s_new = tuple(jnp.where(_expand(live, y), y, y0) for y, y0 in zip(s_new, s, strict=True))
        return s_new, out

    final, out = jax.lax.scan(token, state, tuple(seq(y) for y in x))
    return final, tuple(jnp.moveaxis(y, 0, 2) for y in out)


def _expand(mask, y):
    """``mask [b, 1]`` broadcast against ``y [b, h, ...]``."""
    return mask.reshape(mask.shape + (1,) * (y.ndim - mask.ndim))


def run_scan(xs, state, block_size: int):
    """``scan_body`` over blocks of ``block_size`` tokens of the time-major ``xs``
    (``api``'s operands): ``((numerator [b,t,h,v], denominator [b,t,h], m [b,t,h]),
    final state)``."""
    t = xs[0].shape[1]
    return chunking.scan(scan_body, state, xs, block_size, t, time_axis=1)
