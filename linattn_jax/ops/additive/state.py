"""The additive family's recurrent state ``(S, Z)``: its type, constructor and checks."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from linattn_jax.ops import checks
from linattn_jax.typing import Array, Float


class LinearAttentionState(NamedTuple):
    """The recurrent state of causal linear attention, float32 (float64 for float64 inputs).

    Attributes:
      s: ``[b, h, f, v]``, the running sum of ``a * phi(k) v^T``.
      z: ``[b, h, f]``, the running sum of ``a * phi(k)`` (the denominator's).
    """

    s: Float[Array, "b h f v"]
    z: Float[Array, "b h f"]


State = LinearAttentionState  # the family interface's name


def init_state(batch: int, heads: int, feature_dim: int, value_dim: int) -> State:
    """The empty state: ``s`` zeros ``[batch, heads, feature_dim, value_dim]``, ``z`` zeros."""
    checks.check_sizes(batch=batch, heads=heads, feature_dim=feature_dim, value_dim=value_dim)
    return State(
        s=jnp.zeros((batch, heads, feature_dim, value_dim), jnp.float32),
        z=jnp.zeros((batch, heads, feature_dim), jnp.float32),
    )


def zeros(b: int, h: int, f: int, dv: int, dtype, *, with_z: bool = True):
    """The internal zero state ``(S [b, h, f, dv], Z [b, h, f] | None)`` in ``dtype``."""
    z = jnp.zeros((b, h, f), dtype) if with_z else None
    return jnp.zeros((b, h, f, dv), dtype), z


def as_internal(state: State | None, b, h, f, dv, dtype, *, with_z: bool = True):
    """A user's state as the internal pair ``(S, Z | None)`` in ``dtype`` (zeros if None).

    Raises:
      ValueError: ``state`` is not a ``State`` of shapes ``[b, h, f, dv]`` and ``[b, h, f]``.
    """
    if state is None:
        return zeros(b, h, f, dv, dtype, with_z=with_z)
    if not isinstance(state, State):
        raise ValueError(
            f"state must be a LinearAttentionState (linattn_jax.ops.additive.State), got "
            f"{type(state).__name__}"
        )
    checks.check_shape("state.s", state.s, (b, h, f, dv), "[batch, heads, feature_dim, value_dim]")
    checks.check_shape("state.z", state.z, (b, h, f), "[batch, heads, feature_dim]")
    return state.s.astype(dtype), state.z.astype(dtype) if with_z else None
