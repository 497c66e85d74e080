"""The WKV one token at a time: the reference recurrence (the ``"scan"`` form) and the
token update that ``step`` shares, in the order of ``transformers``'
``rwkv_linear_attention_cpu``.

For one token with key ``k``, value ``v``, log decay ``w = -exp(time_decay)`` and bonus
``u``, from the stabilised state ``(num, den, m)``::

    p = max(m, u + k)                                     (the output's stabiliser)
    out = (exp(m - p) num + exp(u + k - p) v, exp(m - p) den + exp(u + k - p), p)
    m' = max(m + w, k)
    num' = exp(m + w - m') num + exp(k - m') v
    den' = exp(m + w - m') den + exp(k - m')

Every exponent is <= 0, whatever the keys. The blocks of tokens run under
``linattn_jax.ops.chunking.scan``, so the gradient recomputes one block at a time and
stores only the states between blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking
from linattn_jax.ops.wkv.state import EMPTY


def token_step(state, k, v, w, u):
    """One live token of every (b, h, d): ``(the new state, (numerator, denominator,
    stabiliser))``, all ``[b, h, d]``."""
    num, den, m = state
    p = jnp.maximum(m, u + k)
    e_state, e_token = jnp.exp(m - p), jnp.exp(u + k - p)
    out = (e_state * num + e_token * v, e_state * den + e_token, p)
    m_new = jnp.maximum(m + w, k)
    e_state, e_token = jnp.exp(m + w - m_new), jnp.exp(k - m_new)
    return (e_state * num + e_token * v, e_state * den + e_token, m_new), out


def scan_body(state, x):
    """One block of tokens run one at a time (``chunking.scan``'s body).

    Args:
      state: ``(num, den, m)`` before the block, each ``[b, h, d]``.
      x: ``(k, v, w, u [b,h,c,d], live [b,1,c] bool | None, resets [b,1,c] bool | None)``.
        A dead token leaves the state as it is (``live`` None: every token is real); a
        reset puts the empty state (``EMPTY``) before its token.

    Returns:
      ``(state after the block, (numerator, denominator, stabiliser), each [b,h,c,d])``.
    """
    seq = lambda y: None if y is None else jnp.moveaxis(y, 2, 0)

    def token(s, xt):
        k, v, w, u, live, reset = xt
        if reset is not None:
            num, den, m = (jnp.where(reset[..., None], jnp.zeros((), y.dtype), y) for y in s)
            s = (num, den, jnp.where(reset[..., None], jnp.asarray(EMPTY, m.dtype), m))
        s_new, out = token_step(s, k, v, w, u)
        if live is not None:
            s_new = tuple(jnp.where(live[..., None], y, y0) for y, y0 in zip(s_new, s, strict=True))
        return s_new, out

    final, out = jax.lax.scan(token, state, tuple(seq(y) for y in x))
    return final, tuple(jnp.moveaxis(y, 0, 2) for y in out)


def run_scan(xs, state, block_size: int):
    """``scan_body`` over blocks of ``block_size`` tokens of the time-major ``xs``
    (``api``'s operands): ``((numerator, denominator, stabiliser) [b,t,h,d], final
    state)``."""
    t = xs[0].shape[1]
    return chunking.scan(scan_body, state, xs, block_size, t, time_axis=1)
