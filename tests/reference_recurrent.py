"""Independent per-token references for the gated recurrences, written for clarity.

Plain Python loops over tokens, one line per equation of the papers, with the
transition matrices built explicitly (``I - beta k k^T``, ``Diag(alpha)``). They
share no code with ``linattn_jax``. Run them in float64 (``jax.enable_x64``) for
the truth; they are differentiable, so gradients are checked against them too.
Small shapes only: the loop is unrolled.
"""

from __future__ import annotations

import jax.numpy as jnp


def _alpha(gate, i, shape):
    """``alpha_t = exp(gate_t)`` as ``[b, h, dk]`` (1 without a gate)."""
    if gate is None:
        return jnp.ones(shape)
    a = jnp.exp(gate[:, i])
    return a[..., None] * jnp.ones(shape) if a.ndim == 2 else a


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
    outs = []
    for i in range(t):
        qi, ki, vi, bi = q[:, i] * scale, k[:, i], v[:, i], beta[:, i]
        alpha = _alpha(gate, i, (b, h, dk))
        if segment_ids is not None and i > 0:
            new = (segment_ids[:, i] != segment_ids[:, i - 1])[:, None, None, None]
            s = jnp.where(new, 0.0, s)
        erase = eye - bi[..., None, None] * ki[..., :, None] * ki[..., None, :]
        write = bi[..., None, None] * ki[..., :, None] * vi[..., None, :]
        if gate is not None and gate.ndim == 4:  # KDA: S = (I - b k k^T) Diag(alpha) S + b k v^T
            s_new = erase @ (alpha[..., :, None] * s) + write
        else:  # S = alpha (I - b k k^T) S + b k v^T
            s_new = alpha[..., :1, None] * (erase @ s) + write
        o = jnp.einsum("bhkv,bhk->bhv", s_new, qi)
        if key_mask is not None:
            real = key_mask[:, i][:, None, None, None]
            s_new = jnp.where(real, s_new, s)
            o = jnp.where(real[..., 0], o, 0.0)
        s = s_new
        outs.append(o)
    return jnp.stack(outs, axis=1), s


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
        s, z = jnp.zeros((b, h, f, dv), v.dtype), jnp.zeros((b, h, f), v.dtype)
    else:
        s, z = initial_state
    outs = []
    for i in range(t):
        alpha = jnp.exp(gate[:, i])  # [b, h, f]
        s_new = alpha[..., None] * s + phi_k[:, i, :, :, None] * v[:, i, :, None, :]
        z_new = alpha * z + phi_k[:, i]
        num = jnp.einsum("bhf,bhfv->bhv", phi_q[:, i], s_new)
        den = jnp.einsum("bhf,bhf->bh", phi_q[:, i], z_new)
        o = num / (den[..., None] + eps) if normalize else num
        if key_mask is not None:
            real = key_mask[:, i][:, None, None, None]
            s_new, z_new = jnp.where(real, s_new, s), jnp.where(real[..., 0], z_new, z)
            o = jnp.where(real[..., 0], o, 0.0)
        s, z = s_new, z_new
        outs.append(o)
    return jnp.stack(outs, axis=1), (s, z)
