"""One decoding step of causal linear attention: O(1) in the sequence length."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from linattn_jax.ops import checks, feature_maps
from linattn_jax.ops.additive import recurrent
from linattn_jax.ops.additive.inputs import check_normalize, check_options, features, finish
from linattn_jax.ops.additive.state import State, as_internal
from linattn_jax.typing import Array, FeatureMap, Float


def step(
    q: Float[Array, "b h d"],
    k: Float[Array, "b h d"],
    v: Float[Array, "b h v"],
    state: State,
    *,
    decay: Any = None,
    gate: Array | None = None,
    feature_map: str | FeatureMap = "elu",
    position: Array | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[Float[Array, "b h v"], State]:
    """One decoding step of causal linear attention: O(1) in the sequence length.

    ``causal_linear_attention`` over a sequence equals these steps run token by
    token from ``init_state`` (or the same ``initial_state``), outputs and state.

    Args:
      q: this token's query ``[b, h, d]``.
      k: this token's key ``[b, h, d]``.
      v: this token's value ``[b, h, v]``.
      state: the state after the previous token (``init_state`` before the first).
      feature_map: as in ``causal_linear_attention``.
      decay: as in ``causal_linear_attention`` (scalar or ``[h]``).
      gate: this token's log-decay, ``[b, h]`` or per channel ``[b, h, f]``.
      position: this token's int position ``[b]``; needed by position-aware feature
        maps (cosFormer), ignored by the others.
      normalize: as in ``causal_linear_attention``.
      eps: as in ``causal_linear_attention``.

    Returns:
      ``(out [b, h, v] in the dtype of v, new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, a bad state, decay or gate.
    """
    b, h, _ = checks.check_step_qkv(q, k, v)
    check_options(q, k, normalize=normalize, eps=eps, decay=decay)
    positions = None
    if position is not None:
        checks.check_shape("position", position, (b,), "[batch]")
        positions = (position[:, None], position[:, None])
    elif getattr(feature_maps.get(feature_map), "needs_positions", False):
        raise ValueError("this feature_map needs positions: pass position=[batch] int")
    check_normalize(feature_map, normalize)
    phi_q, phi_k, v32 = features(
        q[:, None], k[:, None], v[:, None], feature_map, positions=positions
    )
    f, dtype = phi_q.shape[-1], phi_q.dtype
    g = checks.step_log_decay(decay, gate, b, h, dtype, channels=f, channel_name="features")
    if state is None:
        raise ValueError(
            "state must be the State after the previous token (init_state(...) before the "
            "first), got None"
        )
    s, z = as_internal(state, b, h, f, v.shape[-1], dtype, with_z=True)
    phi_q, phi_k, v32 = phi_q[:, :, 0], phi_k[:, :, 0], v32[:, :, 0]
    a = None if g is None else jnp.exp(g[:, :, 0])  # [b, h, 1|f]; exp(-inf) = 0: a reset
    s, num = recurrent.token_step(s, (phi_q, phi_k, v32, a))
    z = (z if a is None else a * z) + phi_k
    den = jnp.einsum("bhf,bhf->bh", phi_q, z)[:, :, None]
    out = finish(num[:, :, None], den, normalize, eps, v.dtype)[:, 0]
    return out, State(s=s, z=z)
