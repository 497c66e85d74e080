"""One decoding step of the RG-LRU: O(1) in the sequence length."""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax.ops import feature_maps
from linattn_jax.ops.rglru import inputs, recurrent
from linattn_jax.ops.rglru.state import State, as_internal
from linattn_jax.typing import Array, Float


def step(
    x: Float[Array, "b h d"],
    i: Float[Array, "b h d"],
    r: Float[Array, "b h d"],
    state: State,
    *,
    a_param: Float[Array, "h d"],
    c: float = 8.0,
    reset: Array | None = None,
) -> tuple[Float[Array, "b h d"], State]:
    """One token of the RG-LRU.

    ``causal`` over a sequence equals these steps run token by token from the same
    ``initial_state`` (with ``reset`` where ``causal`` starts a sequence), outputs and
    state.

    Args:
      x: this token's input ``[b, h, d]``.
      i: its input gate pre-activation ``[b, h, d]``.
      r: its recurrence gate pre-activation ``[b, h, d]``.
      state: the state after the previous token.
      a_param: as in ``causal``.
      c: as in ``causal``.
      reset: optional bool ``[b]``, True where this token starts a sequence (the state is
        dropped, the input not normalised).

    Returns:
      ``(out [b, h, d] in x's dtype, the new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, non-float inputs, a bad state, ``c`` or reset.
    """
    b, h, d = inputs.check(x, i, r, a_param, c, reset, step=True)
    if state is None:
        raise ValueError("state must be the RGLRUState after the previous token, got None")
    dtype = feature_maps.accumulation_dtype(jnp.result_type(x, i, r))
    s = as_internal(state, b, h, d, dtype)
    u, log_a = inputs.gated(*(y.astype(dtype) for y in (x, i, r, a_param)), c, reset)
    s = recurrent.token_step(s, u, log_a, reset)
    return s.astype(x.dtype), State(s)
