"""Mamba-1's selective scan: the causal entry point.

For each batch row and channel ``d`` (of ``d_inner``), with ``dt_t >= 0`` the channel's
step, ``A <= 0`` its ``n`` rates and ``B_t``, ``C_t`` the ``n``-wide input and output
projections shared by the channels::

    h_t = exp(dt_t A) * h_{t-1} + (dt_t x_t) B_t        (n per channel)
    y_t = h_t . C_t + D x_t

``causal`` runs one of the forms: ``"chunked"`` (``chunked.py``: a parallel scan inside
each chunk, on the chunk engine; the fast default), ``"scan"`` (``recurrent.py``, the
reference recurrence) or ``"quadratic"`` (one chunk of the whole length); ``step``
(``step.py``) decodes one token.

Padding: a token masked by ``key_mask`` leaves the state untouched and outputs 0, whatever
its inputs hold (NaN and inf included). A non-finite ``x`` or ``dt`` of a real token spoils
its channel's outputs from that token on (a non-finite ``B``: every channel's), as the
per-token recurrence would; a non-finite ``C`` only its own token's outputs.

References:
  Gu and Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces"
  (https://arxiv.org/abs/2312.00752).
"""

from __future__ import annotations

from linattn_jax.ops import checks
from linattn_jax.ops.selective import inputs, recurrent
from linattn_jax.ops.selective.chunked import run_chunks
from linattn_jax.ops.selective.state import State, as_internal
from linattn_jax.typing import Array, Float

METHODS = ("chunked", "scan", "quadratic")


def causal(
    x: Float[Array, "b t d"],
    dt: Float[Array, "b t d"],
    A: Float[Array, "d n"],
    B: Float[Array, "b t n"],
    C: Float[Array, "b t n"],
    *,
    D: Float[Array, " d"] | None = None,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    segment_ids: Array | None = None,
) -> Float[Array, "b t d"] | tuple[Float[Array, "b t d"], State]:
    """The selective scan over a sequence: ``y_t = h_t C_t + D x_t``.

    Args:
      x: inputs ``[b, t, d]`` (Mamba's ``d_inner`` channels).
      dt: steps ``[b, t, d]``, >= 0 (after the softplus).
      A: rates ``[d, n]``, <= 0 (Mamba: ``-exp(A_log)``); ``-inf``: the channel's state
        entry keeps only the current token.
      B: input projections ``[b, t, n]``.
      C: output projections ``[b, t, n]``.
      D: optional skip ``[d]``: ``y + D x``.
      method: ``"chunked"`` (default, fast), ``"scan"`` (one step per token) or
        ``"quadratic"`` (one chunk of the whole length, for short inputs). All give the
        same result.
      chunk_size: tokens per chunk (``"chunked"``) or per recomputed block of the
        backward pass (``"scan"``); any length works. None: 16 (per-channel decays:
        ``checks.default_chunk_size``).
      initial_state: the state before token 0; zeros when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token leaves the
        state untouched and outputs 0, whatever its inputs hold.
      segment_ids: optional int ``[b, t]``; the state restarts from zeros wherever the id
        changes (packed sequences). ``initial_state`` belongs to token 0's segment.

    Returns:
      ``y [b, t, d]`` in x's dtype, or ``(y, state)`` when ``return_state``; ``state`` is
      a float32 ``SelectiveState``.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, concrete
        ``A > 0`` or ``dt < 0`` (at real tokens), an unknown method, ``chunk_size < 1``,
        a bad state, mask or segment ids.
    """
    b, d, n = inputs.check(x, dt, A, B, C, D, step=False)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    checks.check_chunk_size(chunk_size)
    checks.check_bool("return_state", return_state)
    t = x.shape[1]
    key_mask = checks.token_mask("key_mask", key_mask, b, t)
    checks.check_steps("dt", dt, key_mask)
    return _causal(
        x, dt, A, B, C, D, key_mask, segment_ids, initial_state, method=method,
        chunk_size=chunk_size, return_state=return_state,
    )  # fmt: skip


@checks.one_program()
def _causal(
    x, dt, A, B, C, D, key_mask, segment_ids, initial_state, *, method, chunk_size, return_state
):
    b, t, d = x.shape
    n = A.shape[-1]
    u, dt32, A32, B, C, first = inputs.operands(x, dt, A, B, C, key_mask)
    dtype = u.dtype
    resets = None
    if segment_ids is not None:
        resets = checks.segment_resets(segment_ids, b, t, dtype)[:, 0]  # [b, t, 1]
    state = (as_internal(initial_state, b, d, n, dtype), A32)
    xs = (u, dt32, B[:, :, None], C[:, :, None], resets)
    # A's decays are per channel and state entry: the per-channel default (16).
    chunk_size = max(t, 1) if method == "quadratic" else checks.default_chunk_size(chunk_size, A)
    if method == "scan":
        y, (h, _) = recurrent.run_scan(xs, state, chunk_size)
    else:
        y, (h, _) = run_chunks(xs, state, chunk_size)
    y, h = inputs.finish(y, x, D, first, h, key_mask)
    y = y.astype(x.dtype)
    return (y, State(h)) if return_state else y
