"""One decoding step of the selective scan: O(1) in the sequence length."""

from __future__ import annotations

from linattn_jax.ops import checks, feature_maps
from linattn_jax.ops.selective import inputs, recurrent
from linattn_jax.ops.selective.state import State, as_internal
from linattn_jax.typing import Array, Float


def step(
    x: Float[Array, "b d"],
    dt: Float[Array, "b d"],
    A: Float[Array, "d n"],
    B: Float[Array, "b n"],
    C: Float[Array, "b n"],
    state: State,
    *,
    D: Float[Array, " d"] | None = None,
) -> tuple[Float[Array, "b d"], State]:
    """One token of the selective scan.

    ``causal`` over a sequence equals these steps run token by token from ``init_state``
    (or the same ``initial_state``), outputs and state.

    Args:
      x: this token's inputs ``[b, d]``.
      dt: its steps ``[b, d]``, >= 0.
      A: rates ``[d, n]``, <= 0.
      B: its input projection ``[b, n]``.
      C: its output projection ``[b, n]``.
      state: the state after the previous token (``init_state`` before the first).
      D: optional skip ``[d]``: ``y + D x``.

    Returns:
      ``(y [b, d] in x's dtype, the new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, non-float inputs, concrete ``A > 0`` or ``dt < 0``,
        or a bad state.
    """
    b, d, n = inputs.check(x, dt, A, B, C, D, step=True)
    if state is None:
        raise ValueError(
            "state must be the SelectiveState after the previous token (init_state(...) "
            "before the first), got None"
        )
    checks.check_steps("dt", dt)
    dtype = feature_maps.accumulation_dtype(x.dtype)
    h = as_internal(state, b, d, n, dtype)
    x32, dt = x.astype(dtype), dt.astype(dtype)
    h, y = recurrent.token_step(h, A.astype(dtype), dt * x32, dt, B, C)
    if D is not None:
        y = y + D.astype(dtype)[None] * x32
    return y.astype(x.dtype), State(h)
