"""One decoding step of the mLSTM: O(1) in the sequence length."""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax.ops import feature_maps
from linattn_jax.ops.mlstm import inputs, recurrent
from linattn_jax.ops.mlstm.state import State, as_internal
from linattn_jax.typing import Array, Float


def step(
    q: Float[Array, "b h d"],
    k: Float[Array, "b h d"],
    v: Float[Array, "b h v"],
    i: Float[Array, "b h"],
    f: Float[Array, "b h"],
    state: State,
    *,
    forget_gate: str = "sigmoid",
    scale: float | None = None,
    eps: float = 1e-6,
) -> tuple[Float[Array, "b h v"], State]:
    """One token of the mLSTM.

    ``causal`` over a sequence equals these steps run token by token from ``init_state``
    (or the same ``initial_state``), outputs and state.

    Args:
      q: this token's query ``[b, h, d]``.
      k: its key ``[b, h, d]``.
      v: its value ``[b, h, v]``.
      i: its input gate pre-activation ``[b, h]``.
      f: its forget gate pre-activation ``[b, h]``.
      state: the state after the previous token (``init_state`` before the first).
      forget_gate: as in ``causal``.
      scale: as in ``causal``.
      eps: as in ``causal``.

    Returns:
      ``(out [b, h, v] in v's dtype, the new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, non-float inputs, a bad state, forget gate,
        scale or eps.
    """
    b, h, d = inputs.check(q, k, v, i, f, step=True, forget_gate=forget_gate, scale=scale, eps=eps)
    if state is None:
        raise ValueError(
            "state must be the MLSTMState after the previous token (init_state(...) before "
            "the first), got None"
        )
    dtype = feature_maps.accumulation_dtype(jnp.result_type(q, k, v))
    s = as_internal(state, b, h, d, v.shape[-1], dtype)
    q, k, v32, i, f = (x.astype(dtype) for x in (q, k, v, i, f))
    scale = d**-0.5 if scale is None else scale
    log_f = inputs.log_forget(f, forget_gate)
    s, (num, den, m) = recurrent.token_step(s, q * scale, k, v32, i, log_f)
    return inputs.finish(num, den, m, eps, v.dtype), State(*s)
