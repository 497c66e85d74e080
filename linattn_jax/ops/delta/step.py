"""One decoding step of the delta rule: O(1) in the sequence length."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from linattn_jax.ops import checks, feature_maps
from linattn_jax.ops.delta import recurrent
from linattn_jax.ops.delta.state import State, as_internal, check_beta, check_options
from linattn_jax.typing import Array, Float


def step(
    q: Float[Array, "b h d"],
    k: Float[Array, "b h d"],
    v: Float[Array, "b h v"],
    beta: Float[Array, "b h"],
    state: State,
    *,
    decay: Any = None,
    gate: Array | None = None,
    scale: float = 1.0,
) -> tuple[Float[Array, "b h v"], State]:
    """One decoding step of the delta rule: O(1) in the sequence length.

    ``delta_rule`` over a sequence equals these steps run token by token from the
    same initial state, outputs and state.

    Args:
      q: this token's query ``[b, h, dk]``.
      k: this token's key ``[b, h, dk]``.
      v: this token's value ``[b, h, dv]``.
      beta: this token's writing strength ``[b, h]``.
      state: the state after the previous token (``init_state`` before the first).
      decay: as in ``causal`` (scalar or ``[h]``).
      gate: this token's log-decay, ``[b, h]`` or per key channel ``[b, h, dk]``.
      scale: multiplies q.

    Returns:
      ``(out [b, h, dv] in the dtype of v, new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, a bad beta, decay, gate or state.
    """
    b, h, dk = checks.check_step_qkv(q, k, v)
    check_options(q, k, decay=decay, scale=scale)
    check_beta(beta, (b, h), "[batch, heads]")
    dtype = feature_maps.accumulation_dtype(q.dtype)
    g = checks.step_log_decay(decay, gate, b, h, dtype, channels=dk, channel_name="key_dim")
    a = None if g is None else jnp.exp(g[:, :, 0])  # exp(-inf) = 0 is a full reset
    if state is None:
        raise ValueError(
            "state must be the State after the previous token (init_state(...) before the "
            "first), got None"
        )
    s = as_internal(state, b, h, dk, v.shape[-1], dtype)
    x = (q * scale, k, v, beta, a)
    s, out = recurrent.token_step(s, tuple(None if y is None else y.astype(dtype) for y in x))
    return out.astype(v.dtype), State(s)
