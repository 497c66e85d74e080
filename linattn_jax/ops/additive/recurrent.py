"""The additive rule one token at a time: the reference recurrence (the ``"scan"`` form).

``S_i = a_i S_{i-1} + phi(k_i) v_i^T``, ``out_i = phi(q_i)^T S_i`` for every (b, h), one
``lax.scan`` step per token, in blocks of tokens that ``linattn_jax.ops.chunking`` scans
(so the gradient recomputes one block at a time and stores only the states between
blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking
from linattn_jax.typing import Array


def run_scan(phi_q, phi_k, v, g, resets, state, block_size: int, *, time_axis: int = 2):
    """``scan_body`` over blocks of ``block_size`` tokens (``run_chunks``' layout and returns:
    ``((numerator, denominator | None), final (S, Z | None))``, no normalisation)."""
    t = phi_q.shape[time_axis]
    xs = (phi_q, phi_k, v, g, resets)
    return chunking.scan(scan_body, state, xs, block_size, t, time_axis=time_axis)


def scan_body(state, x):
    """One block of c tokens run one token at a time (the reference recurrence).

    Z rides along as one extra value column here (the scan is not the hot path,
    and its hand-written backward then serves both).
    """
    q, k, v, g, r = x
    s, z = state
    if z is not None:
        s = jnp.concatenate([s, z[..., None]], axis=-1)
        v = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)
    a = chunking.token_decays(g, r, q.shape[:3], q.dtype)
    seq = functools.partial(jnp.moveaxis, source=2, destination=0)
    s, out = _token_scan(s, seq(q), seq(k), seq(v), None if a is None else seq(a))
    out = jnp.moveaxis(out, 0, 2)
    if z is None:
        return (s, None), (out, None)
    return (s[..., :-1], s[..., -1]), (out[..., :-1], out[..., -1])


def token_step(state: Array, x: tuple[Array, Array, Array, Array | None]):
    """``S = a S + phi(k) v^T; out = phi(q)^T S`` for one token of every (b, h)."""
    q, k, v, a = x  # [b,h,f], [b,h,f], [b,h,v], [b,h,1|f] | None
    if a is not None:
        state = a[..., None] * state
    state = state + k[..., :, None] * v[..., None, :]
    return state, jnp.einsum("bhf,bhfv->bhv", q, state)


@jax.custom_vjp
def _token_scan(state, q, k, v, a):
    """``lax.scan(token_step)`` over a block of tokens, ``[c, b, h, .]`` inputs.

    Its gradient is a hand-written reverse scan over the block's states (stored
    while the block is recomputed): autodiff of the scan is many times slower.
    """
    return jax.lax.scan(token_step, state, (q, k, v, a))


def _token_scan_fwd(state, q, k, v, a):
    def step(s, x):
        s_next, out = token_step(s, x)
        return s_next, (out, s_next)

    final, (out, after) = jax.lax.scan(step, state, (q, k, v, a))
    return (final, out), (state, after, q, k, v, a)


def _token_scan_bwd(residuals, cotangents):
    state, after, q, k, v, a = residuals
    d_final, d_out = cotangents
    # The state before token i, needed only for the decay's gradient.
    before = None if a is None else jnp.concatenate([state[None], after[:-1]], axis=0)

    def step(d_s, x):
        # d_s: the cotangent of S_i from later tokens; S_i = a_i S_{i-1} + k_i v_i^T.
        s_i, s_prev, qi, ki, vi, ai, d_oi = x
        d_s = d_s + qi[..., :, None] * d_oi[..., None, :]
        d_q = jnp.einsum("bhfv,bhv->bhf", s_i, d_oi)
        d_k = jnp.einsum("bhfv,bhv->bhf", d_s, vi)
        d_v = jnp.einsum("bhfv,bhf->bhv", d_s, ki)
        if ai is None:
            return d_s, (d_q, d_k, d_v, None)
        d_a = jnp.sum(d_s * s_prev, axis=-1)  # [b, h, f]
        if ai.shape[-1] == 1:
            d_a = jnp.sum(d_a, axis=-1, keepdims=True)
        return ai[..., None] * d_s, (d_q, d_k, d_v, d_a)

    d_state, d_xs = jax.lax.scan(step, d_final, (after, before, q, k, v, a, d_out), reverse=True)
    return (d_state, *d_xs)


_token_scan.defvjp(_token_scan_fwd, _token_scan_bwd)
