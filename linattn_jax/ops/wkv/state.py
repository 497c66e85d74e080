"""The WKV family's recurrent state ``(num, den, m)``: its type, constructor and checks."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from linattn_jax.ops import checks
from linattn_jax.typing import Array, Float

# The stabiliser before the first key, as transformers' RWKV starts it: far below any log
# weight, yet finite, so that ``m - m`` is never ``inf - inf``.
EMPTY = -1e38


class WKVState(NamedTuple):
    """RWKV-4's WKV state per channel, stabilised by ``m``; float32 (float64 for float64
    inputs). The layout of ``transformers``' ``rwkv_linear_attention_cpu`` state.

    The sums it stands for are ``exp(m) num`` and ``exp(m) den``: both are kept divided by
    ``exp(m)``, the largest weight so far, so that keys of any size never overflow.

    Attributes:
      num: ``[b, h, d]``, ``sum_j exp(k_j + (t - 1 - j) w) v_j`` divided by ``exp(m)``.
      den: ``[b, h, d]``, ``sum_j exp(k_j + (t - 1 - j) w)`` divided by ``exp(m)``.
      m: ``[b, h, d]``, the log of the largest weight (``EMPTY``, -1e38, before any key).
    """

    num: Float[Array, "b h d"]
    den: Float[Array, "b h d"]
    m: Float[Array, "b h d"]


State = WKVState  # the family interface's name


def init_state(batch: int, heads: int, dim: int) -> State:
    """The empty state: ``num`` and ``den`` zeros, ``m`` at ``EMPTY``, float32."""
    checks.check_sizes(batch=batch, heads=heads, dim=dim)
    zeros = jnp.zeros((batch, heads, dim), jnp.float32)
    return State(num=zeros, den=zeros, m=jnp.full((batch, heads, dim), EMPTY, jnp.float32))


def as_internal(state: State | None, b: int, h: int, d: int, dtype):
    """A user's state as the internal triple ``(num, den, m)`` in ``dtype`` (empty when None).

    Raises:
      ValueError: ``state`` is not a ``WKVState`` whose three arrays are ``[b, h, d]``.
    """
    if state is None:
        zeros = jnp.zeros((b, h, d), dtype)
        return zeros, zeros, jnp.full((b, h, d), EMPTY, dtype)
    if not isinstance(state, State):
        raise ValueError(
            f"state must be a WKVState (linattn_jax.ops.wkv.State), got {type(state).__name__}"
        )
    for name, x in zip(State._fields, state, strict=True):
        checks.check_shape(f"state.{name}", x, (b, h, d), "[batch, heads, dim]")
    return tuple(x.astype(dtype) for x in state)
