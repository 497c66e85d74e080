"""The selective scan's recurrent state: its type, constructor and checks."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from linattn_jax.ops import checks
from linattn_jax.typing import Array, Float


class SelectiveState(NamedTuple):
    """The selective scan's state, float32 (float64 for float64 inputs).

    Attributes:
      h: ``[b, d, n]``: per channel, the running ``sum_j exp(A sum_l dt_l) (dt_j x_j) B_j``
        (``transformers``' ``ssm_states``, same layout).
    """

    h: Float[Array, "b d n"]


State = SelectiveState  # the family interface's name


def init_state(batch: int, channels: int, state_dim: int) -> State:
    """The empty state: zeros ``[batch, channels, state_dim]`` float32."""
    checks.check_sizes(batch=batch, channels=channels, state_dim=state_dim)
    return State(h=jnp.zeros((batch, channels, state_dim), jnp.float32))


def as_internal(state: State | None, b: int, d: int, n: int, dtype) -> Array:
    """A user's state as ``h [b, d, n]`` in ``dtype`` (zeros when None).

    Raises:
      ValueError: ``state`` is not a ``SelectiveState`` of shape ``[b, d, n]``.
    """
    if state is None:
        return jnp.zeros((b, d, n), dtype)
    if not isinstance(state, State):
        raise ValueError(
            "state must be a SelectiveState (linattn_jax.ops.selective.State), "
            f"got {type(state).__name__}"
        )
    checks.check_shape("state.h", state.h, (b, d, n), "[batch, channels, state_dim]")
    return state.h.astype(dtype)
