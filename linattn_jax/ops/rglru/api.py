"""The RG-LRU (Griffin's Real-Gated Linear Recurrent Unit): the causal entry point.

For each batch row, head and channel, with recurrence gate ``r_t`` and input gate ``i_t``
(pre-activations), ``a_param`` the learnt ``-Λ`` (so ``a = sigmoid(Λ)^(c r)``) and ``c = 8``::

    log a_t = -c * sigmoid(r_t) * softplus(a_param)
    h_t     = a_t h_{t-1} + sqrt(1 - a_t^2) * (sigmoid(i_t) * x_t)

At a sequence start (Griffin's ``position == 0``) the state is dropped and the input is
not normalised: ``h_t = sigmoid(i_t) * x_t``. The sequence starts are the first real token
of a row given no state, the first real token of each new segment (``segment_ids``), and
any token ``reset`` marks. ``sqrt`` has Griffin's bounded derivative (at most 1000), and
``1 - a^2`` is computed as ``-expm1(2 log a)``. The output is ``h_t`` itself.

``causal`` runs one of the forms: ``"chunked"`` (``chunked.py``: an associative scan in
each chunk, the fast default) or ``"scan"`` (``recurrent.py``, the reference
recurrence); ``step`` (``step.py``) decodes one token; ``sequence_parallel`` shards the
length.

Padding: a token masked by ``key_mask`` leaves the state untouched and outputs 0, whatever
its inputs hold (NaN and inf included). A non-finite input of a real token spoils its own
channel from that token on (until a sequence start drops it).

References:
  De et al. 2024, "Griffin: Mixing Gated Linear Recurrences with Local Attention for
  Efficient Language Models" (https://arxiv.org/abs/2402.19427).
"""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax.ops import checks, feature_maps
from linattn_jax.ops.rglru import inputs, recurrent
from linattn_jax.ops.rglru.chunked import run_chunks
from linattn_jax.ops.rglru.state import State, as_internal
from linattn_jax.typing import Array, Float

METHODS = ("chunked", "scan")


def causal(
    x: Float[Array, "b t h d"],
    i: Float[Array, "b t h d"],
    r: Float[Array, "b t h d"],
    *,
    a_param: Float[Array, "h d"],
    c: float = 8.0,
    reset: Array | None = None,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    segment_ids: Array | None = None,
) -> Float[Array, "b t h d"] | tuple[Float[Array, "b t h d"], State]:
    """The RG-LRU over a sequence: ``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) sigmoid(i_t) x_t``.

    Args:
      x: inputs ``[b, t, h, d]``.
      i: input gate pre-activations ``[b, t, h, d]``.
      r: recurrence gate pre-activations ``[b, t, h, d]``.
      a_param: ``[h, d]``, the recurrence's parameter: ``a = sigmoid(-a_param) ** (c r)``.
      c: the gate's exponent scale (Griffin's 8).
      reset: optional bool ``[b, t]``, True at extra sequence starts (Griffin's
        ``position == 0``); a masked token's is ignored.
      method: ``"chunked"`` (default, fast) or ``"scan"`` (one step per token); both give
        the same result.
      chunk_size: tokens per chunk (or per recomputed block of ``"scan"``'s backward
        pass); any length works. None: 64.
      initial_state: the state before token 0, continued (no sequence start at token 0).
        None: none, the first real token of each row starts a sequence.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token leaves the
        state untouched and outputs 0, whatever its inputs hold.
      segment_ids: optional int ``[b, t]``; the first real token after a change of id starts
        a sequence (packed sequences). ``initial_state`` belongs to token 0's segment.

    Returns:
      ``out [b, t, h, d]`` in x's dtype, or ``(out, state)`` when ``return_state``;
      ``state`` is a float32 ``RGLRUState``.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, an unknown
        method, ``chunk_size < 1``, a bad ``c``, state, mask, reset or segment ids.
    """
    b, t, h, d = inputs.check(x, i, r, a_param, c, reset, step=False)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    checks.check_chunk_size(chunk_size)
    checks.check_bool("return_state", return_state)
    key_mask = checks.token_mask("key_mask", key_mask, b, t)
    if segment_ids is not None:
        checks.check_segment_ids(segment_ids, b, t)
    return _causal(
        x, i, r, a_param, c, reset, key_mask, segment_ids, initial_state, method=method,
        chunk_size=chunk_size, return_state=return_state,
    )  # fmt: skip


@checks.one_program()
def _causal(
    x, i, r, a_param, c, reset, key_mask, segment_ids, initial_state, *, method, chunk_size,
    return_state,
):  # fmt: skip
    b, t, h, d = x.shape
    runs = None if segment_ids is None else checks.segment_runs(segment_ids)
    dtype = feature_maps.accumulation_dtype(jnp.result_type(x, i, r))
    state = as_internal(initial_state, b, h, d, dtype)
    x32, i32, r32 = (checks.where_token(key_mask, y).astype(dtype) for y in (x, i, r))
    live = jnp.ones((b, t), bool) if key_mask is None else key_mask
    starts = inputs.sequence_resets(live, runs, reset, initial_state is None)
    c = jnp.asarray(c, dtype)
    u, log_a = inputs.gated(x32, i32, r32, a_param.astype(dtype), c, starts)
    u, log_a = (checks.where_token(key_mask, y) for y in (u, log_a))
    xs = (u, log_a, starts[:, :, None])
    run = recurrent.run_scan if method == "scan" else run_chunks
    out, state = run(xs, state, checks.default_chunk_size(chunk_size))
    out = checks.where_token(key_mask, out).astype(x.dtype)
    return (out, State(state)) if return_state else out
