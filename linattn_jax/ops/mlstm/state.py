"""The mLSTM family's recurrent state ``(C, n, m)``: its type, constructor and checks."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from linattn_jax.ops import checks
from linattn_jax.typing import Array, Float


class MLSTMState(NamedTuple):
    """The mLSTM's state, stabilised by ``m``; float32 (float64 for float64 inputs).

    The memory it stands for is ``exp(m) C`` and ``exp(m) n``: ``C`` and ``n`` are kept
    divided by the running maximum ``exp(m)`` of the gates, so they never overflow.

    Attributes:
      c: ``[b, h, d, v]``, the matrix memory ``sum_j w_j k_j v_j^T`` divided by ``exp(m)``.
      n: ``[b, h, d]``, the normaliser ``sum_j w_j k_j`` divided by ``exp(m)``.
      m: ``[b, h]``, the stabiliser: the log of the largest gate weight so far (0 before
        the first token, as in xLSTM).
    """

    c: Float[Array, "b h d v"]
    n: Float[Array, "b h d"]
    m: Float[Array, "b h"]


State = MLSTMState  # the family interface's name


def init_state(batch: int, heads: int, key_dim: int, value_dim: int) -> State:
    """The empty state: ``c``, ``n`` and ``m`` zeros, float32."""
    checks.check_sizes(batch=batch, heads=heads, key_dim=key_dim, value_dim=value_dim)
    return State(
        c=jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32),
        n=jnp.zeros((batch, heads, key_dim), jnp.float32),
        m=jnp.zeros((batch, heads), jnp.float32),
    )


def as_internal(state: State | None, b: int, h: int, d: int, dv: int, dtype):
    """A user's state as the internal triple ``(C, n, m)`` in ``dtype`` (zeros when None).

    Raises:
      ValueError: ``state`` is not an ``MLSTMState`` of shapes ``[b, h, d, dv]``,
        ``[b, h, d]`` and ``[b, h]``.
    """
    if state is None:
        return (
            jnp.zeros((b, h, d, dv), dtype),
            jnp.zeros((b, h, d), dtype),
            jnp.zeros((b, h), dtype),
        )
    if not isinstance(state, State):
        raise ValueError(
            f"state must be an MLSTMState (linattn_jax.ops.mlstm.State), got {type(state).__name__}"
        )
    checks.check_shape("state.c", state.c, (b, h, d, dv), "[batch, heads, key_dim, value_dim]")
    checks.check_shape("state.n", state.n, (b, h, d), "[batch, heads, key_dim]")
    checks.check_shape("state.m", state.m, (b, h), "[batch, heads]")
    return tuple(x.astype(dtype) for x in state)
