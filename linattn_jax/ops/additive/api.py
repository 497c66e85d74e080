"""Linear attention (the additive rule): the non-causal form and the causal entry point.

For each query i, with a feature map phi (``linattn_jax.ops.feature_maps``)::

    out_i = phi(q_i)^T S_i / (phi(q_i)^T Z_i + eps)
    S_i = a_i S_{i-1} + phi(k_i) v_i^T     (f x v)
    Z_i = a_i Z_{i-1} + phi(k_i)           (f)

where ``a_i`` is 1 for plain linear attention, a per-head constant for ``decay=``,
``exp(gate_i)`` for a data-dependent ``gate=`` (one per head, or one per feature channel
as in GLA, where ``a_i`` is ``Diag(exp(gate_i))``), and 0 where ``segment_ids`` starts a
new segment. Non-causal attention sums S and Z over all keys. ``causal`` runs one of the
forms: ``"chunked"`` (``chunked.py``, the fast default), ``"scan"`` (``recurrent.py``,
the reference recurrence) or ``"quadratic"`` (one chunk of the whole length); ``step``
(``step.py``) decodes one token. See ``docs/design.md`` for the numerics and memory.

Padding: a token masked by ``key_mask`` adds nothing to S or Z and its own output is 0,
whatever its q, k and v hold (NaN and inf included): masked inputs are replaced, not
multiplied, by zeros, in the forward pass and the gradient.

References:
  Katharopoulos et al. 2020, "Transformers are RNNs" (https://arxiv.org/abs/2006.16236).
  Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient
  Training" (https://arxiv.org/abs/2312.06635).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax.ops import checks, chunking, feature_maps
from linattn_jax.ops.additive import pallas, recurrent
from linattn_jax.ops.additive.chunked import run_chunks
from linattn_jax.ops.additive.inputs import (
    check_normalize,
    check_options,
    chunk_kernel,
    features,
    finish,
)
from linattn_jax.ops.additive.state import State, as_internal, zeros
from linattn_jax.typing import Array, FeatureMap, Float

METHODS = ("chunked", "scan", "quadratic")
# Opt-in kernels (``pallas.py``), outside METHODS: the XLA forms stay the default, and
# code that loops over METHODS runs no interpreted kernel on CPU.
KERNEL_METHODS = ("pallas",)


def noncausal(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s h d"],
    v: Float[Array, "b s h v"],
    *,
    feature_map: str | FeatureMap = "elu",
    key_mask: Array | None = None,
    query_mask: Array | None = None,
    segment_ids: Array | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
) -> Float[Array, "b t h v"]:
    """Non-causal linear attention: every query sees every (unmasked) key.

    Computes ``S = sum_j phi(k_j) v_j^T`` and ``Z = sum_j phi(k_j)`` with einsums,
    O(s*f*v + t*f*v), then ``out_i = phi(q_i)^T S / (phi(q_i)^T Z + eps)``.

    Args:
      q: queries ``[b, t, h, d]``.
      k: keys ``[b, s, h, d]``.
      v: values ``[b, s, h, v]``.
      feature_map: a name in ``feature_maps.names()`` or a callable ``[..., d] -> [..., f]``.
      key_mask: optional bool ``[b, s]``, True for real tokens. A masked key adds
        nothing to the numerator or the denominator, whatever its k and v hold.
      query_mask: optional bool ``[b, t]``, True for real queries; a masked query's
        output is 0 (and a NaN in it reaches no gradient). When None and ``t == s``
        (self-attention), ``key_mask`` masks the queries too; for cross-attention
        of equal lengths pass ``query_mask`` explicitly.
      segment_ids: optional int ``[b, t]`` (self-attention, ``t == s``): tokens
        attend only to keys of the same run of equal ids (packed sequences).
      normalize: divide by ``phi(q)^T Z + eps`` (True) or return the numerator.
      eps: added to the denominator.

    Returns:
      ``[b, t, h, v]`` in the dtype of ``v``.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, a bad
        ``key_mask``, ``query_mask`` or ``segment_ids``, or an unknown feature map.
    """
    b, t, h, _ = checks.check_qkv(q, k, v, causal=False)
    s_len = k.shape[1]
    check_options(q, k, normalize=normalize, eps=eps)
    check_normalize(feature_map, normalize)
    key_mask = checks.token_mask("key_mask", key_mask, b, s_len)
    query_mask = checks.token_mask("query_mask", query_mask, b, t)
    if query_mask is None and t == s_len:
        query_mask = key_mask
    phi_q, phi_k, v32 = features(q, k, v, feature_map, key_mask, query_mask)
    if segment_ids is None:
        num = jnp.einsum("bhtf,bhfv->bhtv", phi_q, jnp.einsum("bhsf,bhsv->bhfv", phi_k, v32))
        den = jnp.einsum("bhtf,bhf->bht", phi_q, jnp.sum(phi_k, axis=2)) if normalize else None
    else:
        if s_len != t:
            raise ValueError(
                f"segment_ids needs self-attention (query length == key length), got q "
                f"{q.shape} and k {k.shape}"
            )
        checks.check_segment_ids(segment_ids, b, t)
        num, den = _segments(phi_q, phi_k, v32, segment_ids, normalize=normalize)
    return finish(num, den, normalize, eps, v.dtype)


@functools.partial(jax.jit, static_argnames=("normalize",))
def _segments(phi_q, phi_k, v, segment_ids, *, normalize: bool):
    """Block-diagonal attention in linear time: an inclusive causal pass plus a
    strictly-causal pass over the reversed sequence, ``(numerator [b, h, t, v],
    denominator [b, h, t] | None)``. Jitted, as the causal forms are: called eagerly it
    compiles once per shape, not its chunk loops at every call."""
    (b, h, t, f), dtype = phi_q.shape, phi_q.dtype
    flip = functools.partial(jnp.flip, axis=2)
    state = zeros(b, h, f, v.shape[-1], dtype, with_z=normalize)
    run = functools.partial(run_chunks, chunk_size=checks.default_chunk_size(None, None))
    resets = checks.segment_resets(segment_ids, b, t, dtype)
    (num, den), _ = run(phi_q, phi_k, v, None, resets, state, diagonal=True)
    rev_resets = checks.segment_resets(jnp.flip(segment_ids, 1), b, t, dtype)
    (rev_num, rev_den), _ = run(
        flip(phi_q), flip(phi_k), flip(v), None, rev_resets, state, diagonal=False
    )
    return num + flip(rev_num), None if den is None else den + flip(rev_den)


def causal(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    *,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    segment_ids: Array | None = None,
    decay: Any = None,
    gate: Array | None = None,
    feature_map: str | FeatureMap = "elu",
    positions: Array | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
) -> Float[Array, "b t h v"] | tuple[Float[Array, "b t h v"], State]:
    """Causal linear attention: query i sees keys j <= i through the running (S, Z).

    Args:
      q: queries ``[b, t, h, d]``.
      k: keys ``[b, t, h, d]``.
      v: values ``[b, t, h, v]``.
      method: ``"chunked"`` (default, fast), ``"scan"`` (one step per token) or
        ``"quadratic"`` (masked ``t x t``, for short inputs). All give the same result.
        ``"pallas"`` opts in to the Pallas kernels of the chunked form (``pallas.py``:
        Triton on GPU, Mosaic on TPU, interpreted on CPU; the chunk rounded up to a
        power of two of at least 16); untimed on a device so far.
      chunk_size: tokens per chunk (``"chunked"``) or per recomputed block of the
        backward pass (``"scan"``); any length works. None: 64, or 16 with a
        per-channel gate (whose ``[c, c, f]`` relative decays grow with the chunk).
      initial_state: the state before token 0 (e.g. from an earlier piece of the
        same sequence, ``return_state=True``); zeros when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token adds
        nothing to S or Z (no decay either) and its own output is 0, whatever its
        q, k and v hold.
      segment_ids: optional int ``[b, t]``; the state resets wherever the id changes
        (packed sequences). ``initial_state`` belongs to token 0's segment.
      decay: optional fixed decay ``gamma`` in (0, 1], a scalar or one per head
        ``[h]``: ``S_i = gamma S_{i-1} + phi(k_i) v_i^T`` (RetNet, Lightning).
      gate: optional data-dependent log-decay, values <= 0, one per head
        ``[b, t, h]`` (``S_i = exp(gate_i) S_{i-1} + ...``: Mamba2, simple GLA) or
        one per feature channel ``[b, t, h, f]`` (``S_i = Diag(exp(gate_i)) S_{i-1}
        + ...``, Z likewise: GLA). ``-inf`` is a full reset. Combines with ``decay``.
      feature_map: a name in ``feature_maps.names()`` or a callable ``[..., d] -> [..., f]``.
      positions: optional int ``[b, t]`` token positions, for position-aware feature
        maps (cosFormer); ``arange(t)`` by default (pass an offset when streaming).
      normalize: divide by ``phi(q)^T Z + eps`` (True) or return the numerator only.
      eps: added to the denominator.

    Returns:
      ``out [b, t, h, v]`` in the dtype of ``v``, or ``(out, state)`` when
      ``return_state``; ``state`` is a float32 ``State`` (``LinearAttentionState``). For bfloat16
      ``q`` the chunked form's matmuls read bfloat16 operands with float32 accumulation
      (float16 ``q``: float32 operands, ``chunking.operand_dtype``); the state stays
      float32.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, an unknown
        method or feature map, ``chunk_size < 1``, or a bad state, mask, decay, gate
        or segment ids. Decays and gates out of range raise when their values are
        concrete; under ``jit`` they are clamped (``checks.log_decay``).
    """
    b, t, h, _ = checks.check_qkv(q, k, v, causal=True)
    check_options(q, k, normalize=normalize, eps=eps, return_state=return_state, decay=decay)
    if method not in METHODS + KERNEL_METHODS:
        raise ValueError(f"method must be one of {METHODS} or 'pallas', got {method!r}")
    checks.check_chunk_size(chunk_size)
    check_normalize(feature_map, normalize)
    if positions is not None:
        checks.check_shape("positions", positions, (b, t), "[batch, length]")
        positions = (positions, positions)
    key_mask = checks.token_mask("key_mask", key_mask, b, t)
    phi = feature_maps.get(feature_map)
    dtype = feature_maps.accumulation_dtype(q.dtype)
    # Time-major throughout ([b, t, h, .]): chunking.scan moves each chunk heads first.
    # A registered (parameter-free, per-token) map runs inside the chunks, on raw q and
    # k: no whole-sequence feature arrays, forward or backward.
    maps_inside = method not in ("scan", "pallas") and feature_maps.is_registered(phi)
    if maps_inside:  # run_chunks' phi_q, phi_k, v are then the raw q, k, v
        f = feature_maps.feature_dim(phi, q.shape[-1], h)
        phi_q, phi_k, v32 = q, k, v
    else:
        heads_first = method == "pallas"  # the kernels read each head's sequence whole
        phi_q, phi_k, v32 = features(
            q, k, v, phi, key_mask, key_mask, positions, heads_first=heads_first
        )
        f = phi_q.shape[-1]
    dv = v.shape[-1]
    g = checks.log_decay(decay, gate, b, t, h, dtype, channels=f, key_mask=key_mask)
    resets = None if segment_ids is None else checks.segment_resets(segment_ids, b, t, dtype)
    state = as_internal(initial_state, b, h, f, dv, dtype, with_z=normalize or return_state)
    chunk_size = t if method == "quadratic" else checks.default_chunk_size(chunk_size, g)
    if method == "pallas":
        eps_ = eps if normalize else None
        out, state = pallas.run(phi_q, phi_k, v32, g, resets, state, chunk_size, eps=eps_)
        out = jnp.swapaxes(out, 1, 2).astype(v.dtype)
        return (out, State(*state)) if return_state else out
    g, resets = (None if x is None else jnp.swapaxes(x, 1, 2) for x in (g, resets))
    xs = (phi_q, phi_k, v32, g, resets, state, chunk_size)
    if method == "scan":
        (num, den), state = _run_scan(*xs, time_axis=1)
        out = finish(num, den, normalize, eps, v.dtype, time_axis=1)
    else:
        live, kernel = None, None
        if maps_inside:
            live = None if key_mask is None else key_mask[:, :, None, None]
        else:
            kernel = chunk_kernel(q, k, phi, key_mask, g, heads_first=False)
        # The chunks divide by their own denominator (in cache, and their backward needs
        # no pass over the whole numerator).
        (out, _), state = _chunks(
            *xs, live, kernel, eps=eps if normalize else None, phi=phi if maps_inside else None,
            dtype=chunking.operand_dtype(q.dtype),
        )  # fmt: skip
        out = out.astype(v.dtype)
    return (out, State(*state)) if return_state else out


def _chunks(phi_q, phi_k, v, g, resets, state, chunk_size, live, kernel, *, eps, phi, dtype):
    """``run_chunks`` (time-major, the query sees its own key) as its own jitted function
    where its options are constants (inlined by XLA into the caller's program): traced and
    lowered once per shape and options, so a model's identical layers share one trace (as
    ``ops.delta``'s chunked form does); an ``eps`` array (a tracer) runs it inline."""
    arrays = (phi_q, phi_k, v, g, resets, state)
    fn, *kernel_arrays = (None,) if kernel is None else kernel
    if eps is not None and not isinstance(eps, int | float | np.generic):
        kernel = None if fn is None else (fn, *kernel_arrays)
        return run_chunks(*arrays, chunk_size, diagonal=True, kernel=kernel, dtype=dtype,
                          time_axis=1, eps=eps, phi=phi, live=live)  # fmt: skip
    return _jitted_chunks(arrays, live, tuple(kernel_arrays), chunk_size=chunk_size,
                          kernel_fn=fn, eps=eps, phi=phi, dtype=dtype)  # fmt: skip


# The reference recurrence jitted too: an eager call compiles its loops once per shape, not
# at every call (its loop body is a fresh closure each time: 0.6-0.8 s a call).
_run_scan = jax.jit(recurrent.run_scan, static_argnames=("block_size", "time_axis"))


@functools.partial(jax.jit, static_argnames=("chunk_size", "kernel_fn", "eps", "phi", "dtype"))
def _jitted_chunks(arrays, live, kernel_arrays, *, chunk_size, kernel_fn, eps, phi, dtype):
    kernel = None if kernel_fn is None else (kernel_fn, *kernel_arrays)
    return run_chunks(*arrays, chunk_size, diagonal=True, kernel=kernel, dtype=dtype,
                      time_axis=1, eps=eps, phi=phi, live=live)  # fmt: skip
