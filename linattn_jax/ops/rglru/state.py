"""The RG-LRU family's recurrent state ``h``: its type, constructor and checks."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from linattn_jax.ops import checks
from linattn_jax.typing import Array, Float


class RGLRUState(NamedTuple):
    """The RG-LRU's state; float32 (float64 for float64 inputs).

    Attributes:
      h: ``[b, h, d]``, the hidden state after the last token (one value per channel).
    """

    h: Float[Array, "b h d"]


State = RGLRUState  # the family interface's name


def init_state(batch: int, heads: int, width: int) -> State:
    """The zero state ``h [batch, heads, width]``, float32.

    Passed as ``initial_state``, it is a state to continue from: the first token is not a
    sequence start (give ``reset`` for that, or no state at all).
    """
    checks.check_sizes(batch=batch, heads=heads, width=width)
    return State(h=jnp.zeros((batch, heads, width), jnp.float32))


def as_internal(state: State | None, b: int, h: int, d: int, dtype):
    """A user's state as the array ``h [b, h, d]`` in ``dtype`` (zeros when None).

    Raises:
      ValueError: ``state`` is not an ``RGLRUState`` of shape ``[b, h, d]``.
    """
    if state is None:
        return jnp.zeros((b, h, d), dtype)
    if not isinstance(state, State):
        raise ValueError(
            f"state must be an RGLRUState (linattn_jax.ops.rglru.State), got {type(state).__name__}"
        )
    checks.check_shape("state.h", state.h, (b, h, d), "[batch, heads, width]")
    return state.h.astype(dtype)
