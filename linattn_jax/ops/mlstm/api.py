"""The mLSTM (xLSTM's matrix memory): the causal entry point.

For each batch row and head, with input gate ``exp(i_t)`` and forget gate ``sigmoid(f_t)``
(or ``exp(f_t)``), in log space ``log f_t = log_sigmoid(f_t)`` (or ``f_t``)::

    C_t = f_t C_{t-1} + exp(i_t) v_t k_t^T          (d x v)
    n_t = f_t n_{t-1} + exp(i_t) k_t
    h_t = C_t^T q_t / (max(|n_t^T q_t|, exp(-m_t)) + eps),     q_t scaled by d^-1/2

computed with the stabiliser ``m_t = max(log f_t + m_{t-1}, i_t)`` (``m_0 = 0``): the
state is kept divided by ``exp(m_t)`` (``MLSTMState``), every exponent is <= 0 and gate
pre-activations of any size stay finite. The lower bound ``exp(-m_t)`` is the one of the
unstabilised form, ``max(|n_t^T q_t|, 1)``. ``causal`` runs one of the forms:
``"chunked"`` (``chunked.py``, the fast default), ``"scan"`` (``recurrent.py``, the
reference recurrence) or ``"quadratic"`` (one chunk of the whole length); ``step``
(``step.py``) decodes one token; ``sequence_parallel`` shards the length.

Padding: a token masked by ``key_mask`` leaves the state (``m`` included) untouched and
outputs 0, whatever its inputs hold (NaN and inf included). A non-finite key or gate of a
real token spoils its own and every later output; a non-finite value only its channel.

References:
  Beck et al. 2024, "xLSTM: Extended Long Short-Term Memory"
  (https://arxiv.org/abs/2405.04517).
  Beck et al. 2025, "xLSTM 7B: A Recurrent LLM for Fast and Efficient Inference"
  (https://arxiv.org/abs/2503.13427).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import checks, chunking
from linattn_jax.ops.mlstm import inputs, recurrent
from linattn_jax.ops.mlstm.chunked import run_chunks
from linattn_jax.ops.mlstm.state import State, as_internal
from linattn_jax.typing import Array, Float

METHODS = ("chunked", "scan", "quadratic")


def causal(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    i: Float[Array, "b t h"],
    f: Float[Array, "b t h"],
    *,
    forget_gate: str = "sigmoid",
    scale: float | None = None,
    eps: float = 1e-6,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    segment_ids: Array | None = None,
) -> Float[Array, "b t h v"] | tuple[Float[Array, "b t h v"], State]:
    """The mLSTM over a sequence: ``h_t = C_t^T q_t / (max(|n_t^T q_t|, exp(-m_t)) + eps)``.

    Args:
      q: queries ``[b, t, h, d]``.
      k: keys ``[b, t, h, d]``.
      v: values ``[b, t, h, v]``.
      i: input gate pre-activations ``[b, t, h]`` (the gate is ``exp(i)``).
      f: forget gate pre-activations ``[b, t, h]``.
      forget_gate: ``"sigmoid"`` (``sigmoid(f)``, xLSTM-7B's) or ``"exp"`` (``exp(f)``).
      scale: the queries' scale; None: ``d ** -0.5``.
      eps: added to the normaliser.
      method: ``"chunked"`` (default, fast), ``"scan"`` (one step per token) or
        ``"quadratic"`` (one chunk of the whole length, for short inputs). All give the
        same result.
      chunk_size: tokens per chunk (``"chunked"``) or per recomputed block of the
        backward pass (``"scan"``); any length works. None: for ``"chunked"`` 32 on CPU
        and 64 on GPU and TPU (``chunking.per_backend``), for ``"scan"`` 64.
      initial_state: the state before token 0; ``init_state`` (zeros, ``m = 0``) when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token leaves the
        state untouched and outputs 0, whatever its q, k, v, i and f hold.
      segment_ids: optional int ``[b, t]``; the state restarts from ``init_state``
        wherever the id changes (packed sequences). ``initial_state`` belongs to token
        0's segment.

    Returns:
      ``out [b, t, h, v]`` in v's dtype, or ``(out, state)`` when ``return_state``;
      ``state`` is a float32 ``MLSTMState``.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, an unknown
        method or forget gate, ``chunk_size < 1``, a bad scale, eps, state, mask or
        segment ids.
    """
    inputs.check(q, k, v, i, f, step=False, forget_gate=forget_gate, scale=scale, eps=eps)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    checks.check_chunk_size(chunk_size)
    checks.check_bool("return_state", return_state)
    key_mask = checks.token_mask("key_mask", key_mask, q.shape[0], q.shape[1])
    return _causal(
        q, k, v, i, f, key_mask, segment_ids, initial_state, scale, eps, forget_gate=forget_gate,
        method=method, chunk_size=chunk_size, return_state=return_state,
    )  # fmt: skip


@checks.one_program("forget_gate")
def _causal(
    q, k, v, i, f, key_mask, segment_ids, initial_state, scale, eps, *, forget_gate, method,
    chunk_size, return_state,
):  # fmt: skip
    b, t, h, d = q.shape
    q, k, v32, log_i, log_f, first, first_v = inputs.operands(
        q, k, v, i, f, key_mask, forget_gate=forget_gate, scale=scale
    )
    dtype = q.dtype
    live = jnp.ones((b, t, 1), bool) if key_mask is None else key_mask[:, :, None]
    resets = None
    if segment_ids is not None:
        resets = checks.segment_resets(segment_ids, b, t, dtype)[:, 0] > 0  # [b, t, 1]
    state = as_internal(initial_state, b, h, d, v.shape[-1], dtype)
    xs = (q, k, v32, log_i, log_f, live, resets)
    if method == "scan":
        (num, den, m), state = recurrent.run_scan(xs, state, checks.default_chunk_size(chunk_size))
    else:
        size = max(t, 1) if method == "quadratic" else chunk_size  # None: the backend's
        (num, den, m), state = _run_chunks(
            xs, state, chunk_size=size, dtype=chunking.operand_dtype(v.dtype)
        )
    out = inputs.finish(num, den, m, eps, dtype)
    out, state = inputs.spoil(out, state, first, first_v, key_mask)
    out = out.astype(v.dtype)
    return (out, State(*state)) if return_state else out


# The chunks as their own jitted function (inlined by XLA into the caller's program): traced
# and lowered once per shape and options, so an xLSTM model's identical layers share one
# trace (as ``ops.delta``'s chunked form does).
_run_chunks = jax.jit(run_chunks, static_argnames=("chunk_size", "dtype"))
