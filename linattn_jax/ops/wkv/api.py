"""RWKV-4's WKV: the causal entry point.

For each batch row and channel (``[h, d]``: RWKV-4 has one head of all its channels), with
the log decay ``w = -exp(time_decay)`` and the bonus ``u = time_first`` of the current
token::

    wkv_t = (sum_{j<t} exp(k_j + (t-1-j) w) v_j + exp(u + k_t) v_t)
            / (sum_{j<t} exp(k_j + (t-1-j) w) + exp(u + k_t))

computed with the running maximum of the log weights (``WKVState``'s ``m``), as
``transformers``' ``rwkv_linear_attention_cpu`` does: every exponent is <= 0 and keys of
any size stay finite. ``causal`` runs one of the forms: ``"chunked"`` (``chunked.py``),
``"scan"`` (``recurrent.py``, the reference recurrence, the default: the fastest on CPU)
or ``"quadratic"`` (one chunk of the whole length); ``step`` (``step.py``) decodes one
token; ``sequence_parallel`` shards the length.

Padding: a token masked by ``key_mask`` neither writes nor decays the state and outputs
0, whatever its inputs hold (NaN and inf included). A non-finite key or value of a real
token spoils its channel's output from that token on, and that channel of the state.

References:
  Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era"
  (https://arxiv.org/abs/2305.13048).
"""

from __future__ import annotations

from linattn_jax.ops import checks
from linattn_jax.ops.wkv import inputs, recurrent
from linattn_jax.ops.wkv.chunked import run_chunks
from linattn_jax.ops.wkv.state import State, as_internal
from linattn_jax.typing import Array, Float

METHODS = ("scan", "chunked", "quadratic")


def causal(
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h d"],
    *,
    time_decay: Float[Array, "h d"],
    time_first: Float[Array, "h d"],
    method: str = "scan",
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    segment_ids: Array | None = None,
) -> Float[Array, "b t h d"] | tuple[Float[Array, "b t h d"], State]:
    """RWKV-4's WKV over a sequence, per channel (the module docstring's equation).

    Args:
      k: keys ``[b, t, h, d]`` (log weights: the weight of a key is ``exp(k)``).
      v: values ``[b, t, h, d]``.
      time_decay: ``[h, d]``, the log of minus the log decay: ``w = -exp(time_decay)``.
      time_first: ``[h, d]``, the bonus ``u`` of the current token's key.
      method: ``"scan"`` (default: one step per token), ``"chunked"`` or ``"quadratic"``
        (one chunk of the whole length, for short inputs). All give the same result.
      chunk_size: tokens per chunk (``"chunked"``) or per recomputed block of the
        backward pass (``"scan"``); any length works. None: 16 (``"chunked"``) or 64.
      initial_state: the state before token 0; ``init_state`` (empty) when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token neither
        writes nor decays the state and outputs 0, whatever its k and v hold.
      segment_ids: optional int ``[b, t]``; the state restarts from ``init_state``
        wherever the id changes (packed sequences). ``initial_state`` belongs to token
        0's segment.

    Returns:
      ``out [b, t, h, d]`` in v's dtype, or ``(out, state)`` when ``return_state``;
      ``state`` is a float32 ``WKVState``.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, an unknown
        method, ``chunk_size < 1``, a bad state, mask or segment ids.
    """
    b, t, h, d = inputs.check(k, v, time_decay, time_first, step=False)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    checks.check_chunk_size(chunk_size)
    checks.check_bool("return_state", return_state)
    key_mask = checks.token_mask("key_mask", key_mask, b, t)
    return _causal(
        k, v, time_decay, time_first, key_mask, segment_ids, initial_state, method=method,
        chunk_size=chunk_size, return_state=return_state,
    )  # fmt: skip


@checks.one_program()
def _causal(
    k, v, time_decay, time_first, key_mask, segment_ids, initial_state, *, method, chunk_size,
    return_state,
):  # fmt: skip
    b, t, h, d = k.shape
    k, v32, w, u, first = inputs.operands(k, v, time_decay, time_first, key_mask)
    dtype = k.dtype
    if method == "scan":
        size = checks.default_chunk_size(chunk_size)
    else:
        size = max(t, 1) if method == "quadratic" else checks.default_chunk_size(chunk_size, w)
    live = inputs.live(key_mask, b, t, size)
    resets = None
    if segment_ids is not None:
        resets = checks.segment_resets(segment_ids, b, t, dtype)[:, 0] > 0  # [b, t, 1]
    state = as_internal(initial_state, b, h, d, dtype)
    xs = (k, v32, w, u, live, resets)
    run = recurrent.run_scan if method == "scan" else run_chunks
    (num, den, _), state = run(xs, state, size)
    out = inputs.finish(num, den, dtype)
    out, state = inputs.spoil(out, state, first, key_mask)
    out = out.astype(v.dtype)
    return (out, State(*state)) if return_state else out
