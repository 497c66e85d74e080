"""One decoding step of the delta rule: O(1) in the sequence length."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from linattn_jax.ops import checks, feature_maps
from linattn_jax.ops.delta import recurrent
from linattn_jax.ops.delta.state import State, as_internal, check_beta, check_options, check_qkv
from linattn_jax.typing import Array, Float


def step(
    q: Float[Array, "b h d"],
    k: Float[Array, "b h d"],
    v: Float[Array, "b hv v"],
    beta: Float[Array, "b hv"],
    state: State,
    *,
    decay: Any = None,
    gate: Array | None = None,
    scale: float = 1.0,
) -> tuple[Float[Array, "b hv v"], State]:
    """One decoding step of the delta rule: O(1) in the sequence length.

    ``delta_rule`` over a sequence equals these steps run token by token from the
    same initial state, outputs and state.

    Args:
      q: this token's query ``[b, h, dk]``.
      k: this token's key ``[b, h, dk]``.
      v: this token's value ``[b, hv, dv]`` (``hv`` a multiple of ``h``: grouped value
        heads, as in ``causal``; q and k are read per group, not repeated).
      beta: this token's writing strength ``[b, hv]``.
      state: the state after the previous token (``init_state`` before the first).
      decay: as in ``causal`` (scalar or ``[h]``).
      gate: this token's log-decay, ``[b, hv]`` or per key channel ``[b, hv, dk]``.
      scale: multiplies q.

    Returns:
      ``(out [b, hv, dv] in the dtype of v, new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, a bad beta, decay, gate or state.
    """
    (b, h, dk), hv = check_qkv(q, k, v, step=True)
    check_options(q, k, decay=decay, scale=scale)
    check_beta(beta, (b, hv), "[batch, heads]")
    dtype = feature_maps.accumulation_dtype(q.dtype)
    g = checks.step_log_decay(decay, gate, b, hv, dtype, channels=dk, channel_name="key_dim")
    a = None if g is None else jnp.exp(g[:, :, 0])  # exp(-inf) = 0 is a full reset
    if state is None:
        raise ValueError(
            "state must be the State after the previous token (init_state(...) before the "
            "first), got None"
        )
    s = as_internal(state, b, hv, dk, v.shape[-1], dtype)
    x = tuple(None if y is None else y.astype(dtype) for y in (q * scale, k, v, beta, a))
    s, out = recurrent.token_step(s, x) if hv == h else _grouped_step(s, x, hv // h)
    return out.astype(v.dtype), State(s)


def _grouped_step(s: Array, x, groups: int) -> tuple[Array, Array]:
    """``recurrent.token_step`` with each q and k read by ``groups`` value heads: the value
    heads as ``[b, h, groups, ...]`` (a reshape, q and k are not repeated)."""
    q, k, v, beta, a = x
    b, h, dk = q.shape
    split = lambda y: None if y is None else y.reshape(b, h, groups, *y.shape[2:])
    s, v, beta, a = split(s), split(v), split(beta), split(a)
    if a is not None:
        s = a[..., None] * s
    u = beta[..., None] * (v - jnp.einsum("bhgkv,bhk->bhgv", s, k))
    s = s + k[:, :, None, :, None] * u[..., None, :]
    out = jnp.einsum("bhgkv,bhk->bhgv", s, q)
    return s.reshape(b, h * groups, dk, -1), out.reshape(b, h * groups, -1)
