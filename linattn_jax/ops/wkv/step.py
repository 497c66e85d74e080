"""One decoding step of the WKV: O(1) in the sequence length."""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax.ops import feature_maps
from linattn_jax.ops.wkv import inputs, recurrent
from linattn_jax.ops.wkv.state import State, as_internal
from linattn_jax.typing import Array, Float


def step(
    k: Float[Array, "b h d"],
    v: Float[Array, "b h d"],
    state: State,
    *,
    time_decay: Float[Array, "h d"],
    time_first: Float[Array, "h d"],
) -> tuple[Float[Array, "b h d"], State]:
    """One token of the WKV.

    ``causal`` over a sequence equals these steps run token by token from ``init_state``
    (or the same ``initial_state``), outputs and state.

    Args:
      k: this token's key ``[b, h, d]``.
      v: its value ``[b, h, d]``.
      state: the state after the previous token (``init_state`` before the first).
      time_decay: as in ``causal``, ``[h, d]``.
      time_first: as in ``causal``, ``[h, d]``.

    Returns:
      ``(out [b, h, d] in v's dtype, the new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, non-float inputs or a bad state.
    """
    b, h, d = inputs.check(k, v, time_decay, time_first, step=True)
    if state is None:
        raise ValueError(
            "state must be the WKVState after the previous token (init_state(...) before "
            "the first), got None"
        )
    dtype = feature_maps.accumulation_dtype(jnp.result_type(k, v))
    s = as_internal(state, b, h, d, dtype)
    w = -jnp.exp(time_decay.astype(dtype))[None]
    u = time_first.astype(dtype)[None]
    s, (num, den, _) = recurrent.token_step(s, k.astype(dtype), v.astype(dtype), w, u)
    return inputs.finish(num, den, v.dtype), State(*s)
