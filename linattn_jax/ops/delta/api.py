"""The delta rule, plain and gated, in every form: arrays in, arrays out.

For each token t, with state S ``[dk, dv]`` per batch and head and ``o_t = S_t^T q_t``::

    DeltaNet          S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    Gated DeltaNet    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    KDA               S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T

with ``alpha_t = exp(gate_t)``: one gate per head (Gated DeltaNet; Yang, Kautz and
Hatamizadeh, ICLR 2025) or one per key channel (Kimi Delta Attention, Kimi
Linear 2025); no gate is DeltaNet (Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length"). Each token writes
``beta_t (v_t - S^T k_t)``, the error of the state's prediction for its key.
``beta`` in [0, 1] is the usual range; up to 2 gives the transition negative
eigenvalues (Grazzi et al. 2025). With ``||k_t|| <= 1`` and ``0 <= beta_t <= 1``
every ``I - beta_t k_t k_t^T`` is a contraction, so the state stays bounded
(models L2-normalise k); there is no denominator: models normalise q, k and
the output instead. q is used as given, times ``scale`` (default 1).

Forms, all with the same inputs and state:

* ``"scan"`` (``recurrent.py``): one ``lax.scan`` step per token (the reference
  recurrence);
* ``"chunked"`` (default, ``chunked.py``): inside a chunk of C tokens the UT transform, with
  ``A = I + tril(diag(beta) (K K^T * D), -1)`` (D the decay from key j to key i),
  ``[U | W] = A^{-1} diag(beta) [V | exp(G) * K]`` by a float32 triangular solve,
  then ``O = exp(G) * Q S + (Q K^T * D) (U - W S)`` and
  ``S_next = exp(G_C) * S + (exp(G_C - G) * K)^T (U - W S)``; all of it but the state
  runs for every chunk at once, and a ``lax.scan`` carries only S across chunks;
* ``step``: one token, O(1) in t, for decoding.

Decays inside a chunk are differences of cumulative log-gates, masked before
``exp`` (``linattn_jax.ops.chunking``), so gates of -30 per token and ``-inf`` (a full
reset) stay finite. Gradients store only the state at chunk boundaries.

Mixed precision: for bfloat16 (or float16) inputs the chunked form's products that
only read (``Q K^T``, ``Q S`` and ``(Q K^T * D) (U - W S)``, and their transposes in
the gradient) take operands in that dtype with float32 accumulation; everything that
reaches the state stays float32: ``K K^T``, the triangular solve, ``W S`` and the
update ``K^T (U - W S)``, so the state is the scan and step forms' to float32 accuracy.
float32 and float64 inputs run every product in their own dtype, as before.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from linattn_jax.ops import checks, chunking, feature_maps
from linattn_jax.ops.delta import chunked, pallas, recurrent
from linattn_jax.ops.delta.state import (
    State,
    as_internal,
    check_beta,
    check_options,
    check_qkv,
    repeat_heads,
)
from linattn_jax.typing import Array, Float

METHODS = ("chunked", "scan")
# Opt-in kernels (``pallas.py``), outside METHODS as in ``ops.additive``: the XLA forms stay
# the default, and code that loops over METHODS runs no interpreted kernel on CPU.
KERNEL_METHODS = ("pallas",)


def causal(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t hv v"],
    beta: Float[Array, "b t hv"],
    *,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    segment_ids: Array | None = None,
    decay: Any = None,
    gate: Array | None = None,
    scale: float = 1.0,
) -> Float[Array, "b t h v"] | tuple[Float[Array, "b t h v"], State]:
    """The causal delta rule (DeltaNet; Gated DeltaNet or KDA with a ``gate``).

    Args:
      q: queries ``[b, t, h, dk]``.
      k: keys ``[b, t, h, dk]`` (L2-normalised in the usual recipe).
      v: values ``[b, t, hv, dv]``; ``hv`` is ``h`` or a multiple of it (grouped value
        heads: value head ``j`` reads the q and k of head ``j // (hv // h)``, as Qwen3-Next's
        32 value heads over 16 key heads; q and k are repeated one block of tokens at a
        time, never over the whole sequence).
      beta: writing strengths ``[b, t, hv]``, in [0, 2] (usually [0, 1]).
      method: ``"chunked"`` (default, fast), ``"scan"`` (one step per token) or
        ``"pallas"`` (opt-in: the chunked form as one Pallas kernel per batch and head,
        Triton on GPU, Mosaic on TPU, interpreted on CPU; no gate or a gate per head,
        power-of-two head widths >= 16, ``chunk_size`` in ``pallas.CHUNK_SIZES`` (None:
        64); forward and backward kernels; ``linattn_jax.ops.delta.pallas``).
      chunk_size: tokens per chunk (``"chunked"``) or per recomputed block of the
        backward pass (``"scan"``); any length works. None: 16 with a per-channel gate
        (whose ``[c, c, f]`` relative decays grow with the chunk); else for ``"chunked"``
        32 on CPU and 64 on GPU and TPU, for ``"scan"`` 64 (``checks.default_chunk_size``).
      initial_state: the state before token 0; zeros when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token leaves
        the state untouched (beta 0, no decay) and its own output is 0, whatever
        its q, k, v, beta and gate hold.
      segment_ids: optional int ``[b, t]``; the state resets wherever the id changes.
      decay: optional fixed decay ``gamma`` in (0, 1], a scalar or one per head ``[hv]``,
        multiplying the state before each token's update (combines with ``gate``).
      gate: optional log-decays, values <= 0: ``[b, t, hv]`` (one per head, Gated
        DeltaNet) or ``[b, t, hv, dk]`` (one per key channel, KDA). ``-inf`` zeroes
        the state (a full reset).
      scale: multiplies q (the layers pass their recipe's scale).

    Returns:
      ``out [b, t, hv, dv]`` in the dtype of ``v``, or ``(out, state)`` when
      ``return_state``; ``state`` is a float32 ``State`` (``DeltaRuleState``). For bfloat16
      ``q`` the chunked form's output products read bfloat16 operands with float32
      accumulation (float16 ``q``: float32 operands, ``chunking.operand_dtype``).

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, an unknown
        method, ``chunk_size < 1``, a bad beta (shape, or values outside [0, 2] when
        concrete), decay, gate, mask, segment ids or state.
    """
    (b, t, h, dk), hv = check_qkv(q, k, v)
    check_options(q, k, decay=decay, scale=scale, return_state=return_state)
    if method not in METHODS + KERNEL_METHODS:
        raise ValueError(f"method must be one of {METHODS} or 'pallas', got {method!r}")
    checks.check_chunk_size(chunk_size)
    key_mask = checks.token_mask("key_mask", key_mask, b, t)
    check_beta(beta, (b, t, hv), "[batch, length, heads]", key_mask)
    dtype, out_dtype = feature_maps.accumulation_dtype(q.dtype), v.dtype
    operands = chunking.operand_dtype(q.dtype)
    g = checks.log_decay(decay, gate, b, t, hv, dtype, channels=dk, key_mask=key_mask)
    if method == "pallas":
        chunk_size = pallas.check_supported(
            chunk_size=chunk_size,
            gate_channels=1 if g is None else g.shape[-1],
            dtype=q.dtype,
            dk=dk,
            dv=v.shape[-1],
        )
    resets = None if segment_ids is None else checks.segment_resets(segment_ids, b, t, dtype)
    q, k, v, beta = (checks.where_token(key_mask, x) for x in (q, k, v, beta))
    q, k, v, beta = (x.astype(dtype) for x in (q * scale, k, v, beta))
    state = as_internal(initial_state, b, hv, dk, v.shape[-1], dtype)
    if method == "chunked":
        # Time-major throughout: chunking.scan moves each chunk heads first, so no
        # whole-sequence transposes of q, k, v, beta and the output (nor of their
        # cotangents). The log-decays and resets are small ([b, t, h, 1|dk]).
        g, resets = (None if x is None else jnp.swapaxes(x, 1, 2) for x in (g, resets))
        xs = (q, k, v, beta, g, resets)
        out, state = _causal_chunks(
            xs, state, chunk_size=chunk_size, length=t, groups=hv // h, dtype=operands, time_axis=1
        )
    else:  # heads first: the kernels read each head's sequence whole
        heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
        xs = tuple(heads_first(x) for x in (q, k, v, beta)) + (g, resets)
        if method == "pallas":
            out, state = pallas.causal_chunks(xs, state, chunk_size, t, groups=hv // h)
        else:
            chunk_size = checks.default_chunk_size(chunk_size, g)
            out, state = _scan(xs, state, chunk_size=chunk_size, length=t, groups=hv // h)
        out = jnp.swapaxes(out, 1, 2)
    out = out.astype(out_dtype)
    return (out, State(state)) if return_state else out


# The chunked form as its own jitted function (inlined by XLA into the caller's program): it
# is traced and lowered once per shape and options, so a model's identical layers share one
# trace instead of tracing the chunk body again in each (the 8-layer Qwen3.5-shaped model's
# trace + lower 0.70 -> 0.31 s; docs/benchmarks.md).
_causal_chunks = jax.jit(
    chunked.causal_chunks,
    static_argnames=("chunk_size", "length", "groups", "dtype", "group_tokens", "time_axis"),
)


@functools.partial(jax.jit, static_argnames=("chunk_size", "length", "groups"))
def _scan(xs, state, *, chunk_size: int, length: int, groups: int):
    """The reference recurrence over blocks of ``chunk_size`` tokens (heads first), jitted as
    the chunked form is: an eager call compiles its loops once per shape, not at every call
    (the loop body is a fresh closure each time: 0.4 s a call)."""
    body = recurrent.scan_body
    if groups > 1:
        body = functools.partial(_grouped, body, groups)
    return chunking.scan(body, state, xs, chunk_size, length)


def _grouped(body, groups: int, s: Array, x) -> tuple[Array, Array]:
    """``body`` on a chunk whose q and k (heads first) serve ``groups`` value heads each:
    they are repeated here, one chunk at a time (their gradient sums over the group)."""
    q, k, *rest = x
    return body(s, (repeat_heads(q, groups, 1), repeat_heads(k, groups, 1), *rest))
