"""Independent per-token references for the gated recurrences, written for clarity.

One ``lax.scan`` step per token, one line per equation of the papers, with the
transition matrices built explicitly (``I - beta k k^T``, ``Diag(alpha)``). They
share no code with ``linattn_jax``. Run them in float64 (``jax.enable_x64``) for
the truth; they are differentiable, so gradients are checked against them too.
(A Python loop over the tokens, as they were, unrolls into a program tens of times
larger: jitted with its gradient at 40 tokens it compiled in 5 s, the scan in 0.2.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _over_tokens(step, state, *xs):
    """``lax.scan`` of ``step(state, x_t) -> (state, out_t)`` over the tokens of the
    ``[b, t, ...]`` arrays ``xs`` (None stays None): ``(outs [b, t, ...], final state)``."""
    time_major = tuple(None if x is None else jnp.moveaxis(jnp.asarray(x), 1, 0) for x in xs)
    state, outs = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(outs, 0, 1), state


def delta_rule_reference(
    q, k, v, beta, *, gate=None, initial_state=None, key_mask=None, segment_ids=None, scale=1.0
):
    """DeltaNet / Gated DeltaNet ([b,t,h] gate) / KDA ([b,t,h,dk] gate), token by token.

    Returns ``(out [b, t, h, dv], final state [b, h, dk, dv])``.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    eye = jnp.eye(dk, dtype=q.dtype)[None, None]
    s = jnp.zeros((b, h, dk, dv), q.dtype) if initial_state is None else initial_state
    new = None  # True where a token starts a new segment (never token 0)
    if segment_ids is not None:
        ids = jnp.asarray(segment_ids)
        new = jnp.concatenate([jnp.zeros((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)

    def step(s, x):
        qi, ki, vi, bi, gi, new_i, real_i = x
        qi = qi * scale
        if gi is None:  # alpha_t = exp(gate_t) as [b, h, dk] (1 without a gate)
            alpha = jnp.ones((b, h, dk))
        else:
            alpha = jnp.exp(gi)[..., None] * jnp.ones((b, h, dk)) if gi.ndim == 2 else jnp.exp(gi)
        if new_i is not None:
            s = jnp.where(new_i[:, None, None, None], 0.0, s)
        erase = eye - bi[..., None, None] * ki[..., :, None] * ki[..., None, :]
        write = bi[..., None, None] * ki[..., :, None] * vi[..., None, :]
        if gi is not None and gi.ndim == 3:  # KDA: S = (I - b k k^T) Diag(alpha) S + b k v^T
            s_new = erase @ (alpha[..., :, None] * s) + write
        else:  # S = alpha (I - b k k^T) S + b k v^T
            s_new = alpha[..., :1, None] * (erase @ s) + write
        o = jnp.einsum("bhkv,bhk->bhv", s_new, qi)
        if real_i is not None:
            real = real_i[:, None, None, None]
            s_new = jnp.where(real, s_new, s)
            o = jnp.where(real[..., 0], o, 0.0)
        return s_new, o

    return _over_tokens(step, s, q, k, v, beta, gate, new, key_mask)


def gla_reference(
    phi_q, phi_k, v, gate, *, initial_state=None, normalize=True, eps=1e-6, key_mask=None
):
    """GLA: ``S_t = Diag(alpha_t) S_{t-1} + phi(k_t) v_t^T`` (Z likewise), token by token.

    ``phi_q``, ``phi_k`` are the features ``[b, t, h, f]``; ``gate`` ``[b, t, h, f]``.
    Returns ``(out [b, t, h, dv], (S [b, h, f, dv], Z [b, h, f]))``.
    """
    b, t, h, f = phi_q.shape
    dv = v.shape[-1]
    if initial_state is None:
        state = jnp.zeros((b, h, f, dv), v.dtype), jnp.zeros((b, h, f), v.dtype)
    else:
        state = tuple(initial_state)

    def step(state, x):
        s, z = state
        qi, ki, vi, gi, real_i = x
        alpha = jnp.exp(gi)  # [b, h, f]
        s_new = alpha[..., None] * s + ki[..., :, None] * vi[..., None, :]
        z_new = alpha * z + ki
        num = jnp.einsum("bhf,bhfv->bhv", qi, s_new)
        den = jnp.einsum("bhf,bhf->bh", qi, z_new)
        o = num / (den[..., None] + eps) if normalize else num
        if real_i is not None:
            real = real_i[:, None, None, None]
            s_new, z_new = jnp.where(real, s_new, s), jnp.where(real[..., 0], z_new, z)
            o = jnp.where(real[..., 0], o, 0.0)
        return (s_new, z_new), o

    return _over_tokens(step, state, phi_q, phi_k, v, gate, key_mask)
