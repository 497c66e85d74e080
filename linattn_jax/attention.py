"""Linear attention (the additive rule), in every form: arrays in, arrays out.

For each query i, with a feature map phi (``linattn_jax.feature_maps``)::

    out_i = phi(q_i)^T S_i / (phi(q_i)^T Z_i + eps)
    S_i = a_i S_{i-1} + phi(k_i) v_i^T     (f x v)
    Z_i = a_i Z_{i-1} + phi(k_i)           (f)

where ``a_i`` is 1 for plain linear attention, a per-head constant for
``decay=``, ``exp(gate_i)`` for a data-dependent ``gate=`` (one per head, or one
per feature channel as in GLA, where ``a_i`` is the diagonal matrix
``Diag(exp(gate_i))``), and 0 where ``segment_ids`` starts a new segment.
Non-causal attention sums S and Z over all keys. The causal forms share one
recurrence and differ in how they run it:

* ``"scan"``: one ``lax.scan`` step per token (the reference recurrence);
* ``"chunked"``: a masked matmul inside chunks of ``chunk_size`` tokens and a
  ``lax.scan`` across chunks (the fast default);
* ``"quadratic"``: the masked ``t x t`` form, for short inputs;
* ``causal_linear_attention_step``: one token, O(1) in t, for decoding.

S and Z are kept apart, so every matmul has the widths the caller chose (no
ones column that would make a value width of 65 or 129); Z is a cheap
reduction, skipped when ``normalize=False`` and no state is returned.
States and sums are float32 whatever the input dtype (float64 for float64 inputs).
Mixed precision: for bfloat16 (or float16) inputs the chunked form's matmuls (the
``[c, c]`` scores, scores times values, queries times the state, and their
transposes in the gradient) read operands in that dtype and accumulate in float32;
the features, decays, sums, denominators and states stay float32, and so does the
product that writes the state (``phi(k)^T v``), so the chunked, scan and step forms
carry the same state to float32 accuracy. float32 and float64 inputs run every
product in their own dtype, as before.

Padding: a token masked by ``key_mask`` adds nothing to S or Z and its own
output is 0, whatever its q, k and v hold (NaN and inf included): masked
inputs are replaced, not multiplied, by zeros, in the forward pass and the
gradient.

Layout (the chunked form): q, k, v stay time-major, ``[b, t, h, .]``, as the caller
gave them; ``linattn_jax.chunking`` moves one chunk at a time heads first, and writes
the output time-major. A registered (parameter-free, per-token) feature map is applied
inside each chunk to its raw q and k, and each chunk divides by its own denominator,
so neither the features nor the numerator is ever a whole-sequence array, forward or
backward; other maps (random features, Hedgehog, cosFormer) are computed once outside.

Memory: the scan and chunked forms are differentiated through
``linattn_jax.chunking``, which stores only the state at each chunk boundary and
runs the chunks' backward in a reverse scan (for the chunked form a hand-written
one, ``_chunk_body_bwd``, that recomputes only a chunk's scores), so a gradient
costs O(t*d + (t/c)*f*v) extra memory, not the O(t*f*v) of autodiff through a
per-token scan. States are never rebuilt by subtracting from the final state
(that cancels catastrophically).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax import checks, chunking, feature_maps
from linattn_jax.typing import Array, FeatureMap, Float

METHODS = ("chunked", "scan", "quadratic")


class LinearAttentionState(NamedTuple):
    """The recurrent state of causal linear attention, float32 (float64 for float64 inputs).

    Attributes:
      s: ``[b, h, f, v]``, the running sum of ``a * phi(k) v^T``.
      z: ``[b, h, f]``, the running sum of ``a * phi(k)`` (the denominator's).
    """

    s: Float[Array, "b h f v"]
    z: Float[Array, "b h f"]


def init_state(batch: int, heads: int, feature_dim: int, value_dim: int) -> LinearAttentionState:
    """The empty state: ``s`` zeros ``[batch, heads, feature_dim, value_dim]``, ``z`` zeros."""
    checks.check_sizes(batch=batch, heads=heads, feature_dim=feature_dim, value_dim=value_dim)
    return LinearAttentionState(
        s=jnp.zeros((batch, heads, feature_dim, value_dim), jnp.float32),
        z=jnp.zeros((batch, heads, feature_dim), jnp.float32),
    )


# ----------------------------------------------------------------------------
# Public forms.
# ----------------------------------------------------------------------------


def linear_attention(
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
    check_normalize(feature_map, normalize)
    key_mask = checks.token_mask("key_mask", key_mask, b, s_len)
    query_mask = checks.token_mask("query_mask", query_mask, b, t)
    if query_mask is None and t == s_len:
        query_mask = key_mask
    phi_q, phi_k, v32 = features(q, k, v, feature_map, key_mask, query_mask)
    dtype = phi_q.dtype
    if segment_ids is None:
        num = jnp.einsum("bhtf,bhfv->bhtv", phi_q, jnp.einsum("bhsf,bhsv->bhfv", phi_k, v32))
        den = jnp.einsum("bhtf,bhf->bht", phi_q, jnp.sum(phi_k, axis=2)) if normalize else None
    else:
        if s_len != t:
            raise ValueError(
                f"segment_ids needs self-attention (query length == key length), got q "
                f"{q.shape} and k {k.shape}"
            )
        # Block-diagonal attention in linear time: an inclusive causal pass plus
        # a strictly-causal pass over the reversed sequence.
        flip = functools.partial(jnp.flip, axis=2)
        state = _zero_state(b, h, phi_q.shape[-1], v.shape[-1], dtype, normalize)
        resets = checks.segment_resets(segment_ids, b, t, dtype)
        (num, den), _ = chunked(phi_q, phi_k, v32, None, resets, state, 64, diagonal=True)
        rev_resets = checks.segment_resets(jnp.flip(segment_ids, 1), b, t, dtype)
        (rev_num, rev_den), _ = chunked(
            flip(phi_q), flip(phi_k), flip(v32), None, rev_resets, state, 64, diagonal=False
        )
        num = num + flip(rev_num)
        den = None if den is None else den + flip(rev_den)
    return finish(num, den, normalize, eps, v.dtype)


def causal_linear_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    *,
    feature_map: str | FeatureMap = "elu",
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    decay: Any = None,
    gate: Array | None = None,
    segment_ids: Array | None = None,
    positions: Array | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
) -> Float[Array, "b t h v"] | tuple[Float[Array, "b t h v"], LinearAttentionState]:
    """Causal linear attention: query i sees keys j <= i through the running (S, Z).

    Args:
      q: queries ``[b, t, h, d]``.
      k: keys ``[b, t, h, d]``.
      v: values ``[b, t, h, v]``.
      feature_map: a name in ``feature_maps.names()`` or a callable ``[..., d] -> [..., f]``.
      method: ``"chunked"`` (default, fast), ``"scan"`` (one step per token) or
        ``"quadratic"`` (masked ``t x t``, for short inputs). All give the same result.
      chunk_size: tokens per chunk (``"chunked"``) or per recomputed block of the
        backward pass (``"scan"``); any length works. None: 64, or 16 with a
        per-channel gate (whose ``[c, c, f]`` relative decays grow with the chunk).
      initial_state: the state before token 0 (e.g. from an earlier piece of the
        same sequence, ``return_state=True``); zeros when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token adds
        nothing to S or Z (no decay either) and its own output is 0, whatever its
        q, k and v hold.
      decay: optional fixed decay ``gamma`` in (0, 1], a scalar or one per head
        ``[h]``: ``S_i = gamma S_{i-1} + phi(k_i) v_i^T`` (RetNet, Lightning).
      gate: optional data-dependent log-decay, values <= 0, one per head
        ``[b, t, h]`` (``S_i = exp(gate_i) S_{i-1} + ...``: Mamba2, simple GLA) or
        one per feature channel ``[b, t, h, f]`` (``S_i = Diag(exp(gate_i)) S_{i-1}
        + ...``, Z likewise: GLA). ``-inf`` is a full reset. Combines with ``decay``.
      segment_ids: optional int ``[b, t]``; the state resets wherever the id changes
        (packed sequences). ``initial_state`` belongs to token 0's segment.
      positions: optional int ``[b, t]`` token positions, for position-aware feature
        maps (cosFormer); ``arange(t)`` by default (pass an offset when streaming).
      normalize: divide by ``phi(q)^T Z + eps`` (True) or return the numerator only.
      eps: added to the denominator.

    Returns:
      ``out [b, t, h, v]`` in the dtype of ``v``, or ``(out, state)`` when
      ``return_state``; ``state`` is a float32 ``LinearAttentionState``. For bfloat16
      (float16) ``q`` the chunked form's matmuls read their operands in that dtype,
      with float32 accumulation (see the module's docstring); the state stays float32.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, an unknown
        method or feature map, ``chunk_size < 1``, or a bad state, mask, decay, gate
        or segment ids. Decays and gates out of range raise when their values are
        concrete; under ``jit`` they are clamped (``checks.log_decay``).
    """
    b, t, h, _ = checks.check_qkv(q, k, v, causal=True)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if chunk_size is not None:
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
    maps_inside = method != "scan" and feature_maps.is_registered(phi)
    if maps_inside:  # chunked's phi_q, phi_k, v are then the raw q, k, v
        f = feature_maps.feature_dim(phi, q.shape[-1], h)
        phi_q, phi_k, v32 = q, k, v
    else:
        phi_q, phi_k, v32 = features(q, k, v, phi, key_mask, key_mask, positions, heads_first=False)
        f = phi_q.shape[-1]
    dv = v.shape[-1]
    g = checks.log_decay(decay, gate, b, t, h, dtype, channels=f, key_mask=key_mask)
    resets = None if segment_ids is None else checks.segment_resets(segment_ids, b, t, dtype)
    state = state_in(initial_state, b, h, f, dv, dtype, with_z=normalize or return_state)
    chunk_size = t if method == "quadratic" else checks.default_chunk_size(chunk_size, g)
    options = dict(dtype=chunking.operand_dtype(q.dtype), time_axis=1)
    if method == "scan":
        options.update(body=_scan_body)
    elif maps_inside:
        options.update(phi=phi, live=None if key_mask is None else key_mask[:, :, None, None])
    else:
        options.update(kernel=chunk_kernel(q, k, phi, key_mask, g, heads_first=False))
    # The chunked bodies divide by the denominator themselves (in cache, and their
    # backward needs no pass over the whole numerator); the scan body does not.
    divide_in_chunks = normalize and method != "scan"
    g, resets = (None if x is None else jnp.swapaxes(x, 1, 2) for x in (g, resets))
    (num, den), state = chunked(
        phi_q,
        phi_k,
        v32,
        g,
        resets,
        state,
        chunk_size,
        diagonal=True,
        eps=eps if divide_in_chunks else None,
        **options,
    )
    out = finish(num, den, normalize and not divide_in_chunks, eps, v.dtype, time_axis=1)
    if return_state:
        return out, LinearAttentionState(*state)
    return out


def causal_linear_attention_step(
    q: Float[Array, "b h d"],
    k: Float[Array, "b h d"],
    v: Float[Array, "b h v"],
    state: LinearAttentionState,
    *,
    feature_map: str | FeatureMap = "elu",
    decay: Any = None,
    gate: Array | None = None,
    position: Array | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[Float[Array, "b h v"], LinearAttentionState]:
    """One decoding step of causal linear attention: O(1) in the sequence length.

    ``causal_linear_attention`` over a sequence equals these steps run token by
    token from ``init_state`` (or the same ``initial_state``), outputs and state.

    Args:
      q: this token's query ``[b, h, d]``.
      k: this token's key ``[b, h, d]``.
      v: this token's value ``[b, h, v]``.
      state: the state after the previous token (``init_state`` before the first).
      feature_map: as in ``causal_linear_attention``.
      decay: as in ``causal_linear_attention`` (scalar or ``[h]``).
      gate: this token's log-decay, ``[b, h]`` or per channel ``[b, h, f]``.
      position: this token's int position ``[b]``; needed by position-aware feature
        maps (cosFormer), ignored by the others.
      normalize: as in ``causal_linear_attention``.
      eps: as in ``causal_linear_attention``.

    Returns:
      ``(out [b, h, v] in the dtype of v, new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, a bad state, decay or gate.
    """
    b, h, _ = checks.check_step_qkv(q, k, v)
    positions = None
    if position is not None:
        checks.check_shape("position", position, (b,), "[batch]")
        positions = (position[:, None], position[:, None])
    elif getattr(feature_maps.get(feature_map), "needs_positions", False):
        raise ValueError("this feature_map needs positions: pass position=[batch] int")
    check_normalize(feature_map, normalize)
    phi_q, phi_k, v32 = features(
        q[:, None], k[:, None], v[:, None], feature_map, positions=positions
    )
    f, dtype = phi_q.shape[-1], phi_q.dtype
    if gate is not None:
        if not hasattr(gate, "shape") or tuple(gate.shape) not in ((b, h), (b, h, f)):
            raise ValueError(
                f"gate must have shape [batch, heads]={(b, h)} or [batch, heads, features]="
                f"{(b, h, f)}, got {getattr(gate, 'shape', type(gate).__name__)}"
            )
        gate = gate[:, None]
    g = checks.log_decay(decay, gate, b, 1, h, dtype, channels=f)
    s, z = state_in(state, b, h, f, v.shape[-1], dtype, with_z=True)
    phi_q, phi_k, v32 = phi_q[:, :, 0], phi_k[:, :, 0], v32[:, :, 0]
    if g is not None:
        a = jnp.exp(g[:, :, 0])  # [b, h, 1|f]; exp(-inf) = 0 is a full reset
        s, z = a[..., None] * s, a * z
    s = s + phi_k[..., :, None] * v32[..., None, :]
    z = z + phi_k
    num = jnp.einsum("bhf,bhfv->bhv", phi_q, s)[:, :, None]
    den = jnp.einsum("bhf,bhf->bh", phi_q, z)[:, :, None]
    out = finish(num, den, normalize, eps, v.dtype)[:, 0]
    return out, LinearAttentionState(s=s, z=z)


# ----------------------------------------------------------------------------
# The recurrence, inside one chunk. Internal layout: [b, h, t, f] features,
# [b, h, t, v] values, [b, h, t, g] log-decays (-inf: a reset) and [b, 1, t, 1]
# segment resets (see ``linattn_jax.checks``); the state is the pair
# (S [b, h, f, v], Z [b, h, f] or None when no denominator is needed); outputs are
# the pair (numerator [b, h, t, v], denominator [b, h, t] or None).
# ----------------------------------------------------------------------------


def _scan_body(diagonal: bool, state, x):
    """One block of c tokens run one token at a time (the reference recurrence).

    Z rides along as one extra value column here (the scan is not the hot path,
    and its hand-written backward then serves both).
    """
    del diagonal  # the scan form is always inclusive
    q, k, v, g, r = x
    s, z = state
    if z is not None:
        s = jnp.concatenate([s, z[..., None]], axis=-1)
        v = jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)
    a = chunking.token_decays(g, r, q.shape[:3], q.dtype)
    seq = functools.partial(jnp.moveaxis, source=2, destination=0)
    s, out = _token_scan(s, seq(q), seq(k), seq(v), None if a is None else seq(a))
    out = jnp.moveaxis(out, 0, 2)
    if z is None:
        return (s, None), (out, None)
    return (s[..., :-1], s[..., -1]), (out[..., :-1], out[..., -1])


def _recurrent_step(state: Array, x: tuple[Array, Array, Array, Array | None]):
    """``S = a S + phi(k) v^T; out = phi(q)^T S`` for one token of every (b, h)."""
    q, k, v, a = x  # [b,h,f], [b,h,f], [b,h,v], [b,h,1|f] | None
    if a is not None:
        state = a[..., None] * state
    state = state + k[..., :, None] * v[..., None, :]
    return state, jnp.einsum("bhf,bhfv->bhv", q, state)


@jax.custom_vjp
def _token_scan(state, q, k, v, a):
    """``lax.scan(_recurrent_step)`` over a block of tokens, ``[c, b, h, .]`` inputs.

    Its gradient is a hand-written reverse scan over the block's states (stored
    while the block is recomputed): autodiff of the scan is many times slower.
    """
    return jax.lax.scan(_recurrent_step, state, (q, k, v, a))


def _token_scan_fwd(state, q, k, v, a):
    def step(s, x):
        s_next, out = _recurrent_step(s, x)
        return s_next, (out, s_next)

    final, (out, after) = jax.lax.scan(step, state, (q, k, v, a))
    return (final, out), (state, after, q, k, v, a)


def _token_scan_bwd(residuals, cotangents):
    state, after, q, k, v, a = residuals
    d_final, d_out = cotangents
    # The state before token i, needed only for the decay's gradient.
    before = None if a is None else jnp.concatenate([state[None], after[:-1]], axis=0)

    def step(d_s, x):
        # d_s: the cotangent of S_i from later tokens; S_i = a_i S_{i-1} + k_i v_i^T.
        s_i, s_prev, qi, ki, vi, ai, d_oi = x
        d_s = d_s + qi[..., :, None] * d_oi[..., None, :]
        d_q = jnp.einsum("bhfv,bhv->bhf", s_i, d_oi)
        d_k = jnp.einsum("bhfv,bhv->bhf", d_s, vi)
        d_v = jnp.einsum("bhfv,bhf->bhv", d_s, ki)
        if ai is None:
            return d_s, (d_q, d_k, d_v, None)
        d_a = jnp.sum(d_s * s_prev, axis=-1)  # [b, h, f]
        if ai.shape[-1] == 1:
            d_a = jnp.sum(d_a, axis=-1, keepdims=True)
        return ai[..., None] * d_s, (d_q, d_k, d_v, d_a)

    d_state, d_xs = jax.lax.scan(step, d_final, (after, before, q, k, v, a, d_out), reverse=True)
    return (d_state, *d_xs)


_token_scan.defvjp(_token_scan_fwd, _token_scan_bwd)


def chunked(
    phi_q,
    phi_k,
    v,
    g,
    resets,
    state,
    chunk_size,
    *,
    diagonal,
    body=None,
    kernel=None,
    dtype=None,
    time_axis=2,
    eps=None,
    phi=None,
    live=None,
):
    """The additive recurrence over chunks, internal layout in and out.

    ``time_axis``: 2 for the internal heads-first layout; 1 for time-major inputs and
    outputs (every ``[b, h, t, .]`` below is then ``[b, t, h, .]``, resets and ``live``
    ``[b, t, 1, 1]``), which ``chunking.scan`` moves heads first one chunk at a time.

    With ``body=None`` each chunk runs ``_chunk_body`` and its gradient is the
    hand-written ``_chunk_body_bwd``; another body (``_scan_body``) is differentiated
    by ``chunking.scan`` re-running it under ``jax.vjp``.

    ``kernel``: optional ``(fn, q [b,h,t,d], k [b,h,t,d], live [b,1,t,1] bool | None)``
    with ``fn(q_i . k_j, d)`` equal to ``phi(q_i) . phi(k_j)`` for live tokens: the scores
    inside a chunk then come from the d-wide dot products, and the features only carry
    the state (per-head decays only).

    ``dtype``: the operand dtype of ``_chunk_body``'s matmuls (``chunking.operand_dtype``
    of the caller's inputs; None: the features' own dtype, no cast).

    ``eps``: None, or (with ``Z`` in the state and ``body=None``) the chunks return the
    normalised output ``numerator / (denominator + eps)`` in place of the numerator,
    and None for the denominator.

    ``phi``: None, or a registered (per-token, parameter-free) feature map that each
    chunk applies itself: ``phi_q``, ``phi_k`` and ``v`` are then the raw q, k and v
    (any float dtype), and ``live`` (bool ``[b, 1, t, 1]``, None: all live) marks the
    tokens that count; the others are replaced by zeros before the map and their
    features zeroed after it, as ``features`` does. Its ``kernel_from_dots`` (Taylor)
    then gives the scores inside a chunk wherever ``kernel`` would.

    Returns ``((numerator [b,h,t,v], denominator [b,h,t] | None), final (S, Z | None))``.
    """
    if eps is not None and (body is not None or state[1] is None):
        raise ValueError("chunked: eps needs the chunk body (body=None) and Z in the state")
    xs = (phi_q, phi_k, v, g, resets)
    t = phi_q.shape[time_axis]
    scan = functools.partial(chunking.scan, length=t, time_axis=time_axis)
    if body is not None:
        return scan(functools.partial(body, diagonal), state, xs, chunk_size)
    fn = None
    if phi is not None:
        c, n = chunking.chunk_count(chunk_size, t)
        if live is None and n * c != t:
            # The padding of the last chunk must be dead: phi(0) need not be 0 (elu + 1).
            shape = [phi_q.shape[0], 1, 1, 1]
            shape[time_axis] = t
            live = jnp.ones(shape, bool)
        xs = xs + (live,)
        fn = _kernel_from_dots(phi, g)
    elif kernel is not None:
        fn, q, k, live = kernel
        xs = xs + (q, k, live)
    options = dict(dtype=dtype, eps=eps, phi=phi)
    body = functools.partial(_chunk_body, diagonal, fn, **options)
    body_bwd = functools.partial(_chunk_body_bwd, diagonal, fn, **options)
    return scan(body, state, xs, chunk_size, body_bwd=body_bwd)


# ----------------------------------------------------------------------------
# One chunk, forward and hand-written backward. The backward takes the state
# entering the chunk (stored by ``chunking.scan``) and the cotangent of the state
# after it, and runs only the transposed products: the chunk's outputs and its
# update of the state are never recomputed, only its decayed scores.
# ----------------------------------------------------------------------------


def _chunk_parts(diagonal: bool, kernel, x, *, dtype=None, phi=None):
    """The decayed pieces of one chunk, all that its gradient needs to recompute.

    Args:
      diagonal: whether query i sees key i (False: strictly causal).
      kernel: None, or ``fn(q . k, d)`` giving the scores from ``x``'s last entries.
      x: ``(phi_q [b,h,c,f], phi_k [b,h,c,f], log-decay [b,h,c,g] | None, segment
        resets [b,1,c,1] | None[, q [b,h,c,d], k [b,h,c,d], live [b,1,c,1] | None])``
        (no values); with ``phi``, ``(q, k, log-decay, resets, live)``.
      dtype: the operand dtype of the scores' matmul (None: no cast).
      phi: None, or the feature map this chunk applies to its raw q and k.

    Returns:
      ``(scores [b,h,c,c], phi_q decayed from the chunk's start [b,h,c,f], phi_k decayed
      to the chunk's end [b,h,c,f], the decay across the chunk [b,h,g] | None)``.
    """
    if phi is None:
        q, k, g, r = x[:4]
    else:
        q_raw, k_raw, g, r, live = x
        q_raw, k_raw = _live(live, q_raw), _live(live, k_raw)
        q, k = _live(live, phi(q_raw)), _live(live, phi(k_raw))
        x = (q, k, g, r, q_raw, k_raw, live)
    dec = chunking.decays(g, r, q.shape[:3], q.dtype)
    if kernel is None:
        scores = chunking.decayed_scores(q, k, dec, diagonal=diagonal, dtype=dtype)
    else:
        q_raw, k_raw, live = x[4:]
        dots = chunking.einsum("bhid,bhjd->bhij", q_raw, k_raw, dtype=dtype)
        scores = kernel(dots, q_raw.shape[-1])
        if live is not None:  # a masked token's features are zeros, not phi(0)
            scores = jnp.where(live & jnp.swapaxes(live, 2, 3), scores, 0.0)
        scores = chunking.decay_scores(scores, dec, diagonal=diagonal)
    if dec is None:
        return scores, q, k, None
    return scores, q * dec.into, k * dec.out_of, dec.across


def _live(live: Array | None, x: Array) -> Array:
    """``x [b, h, c, .]`` in its accumulation dtype, zeros where ``live [b, 1, c, 1]`` is
    False (a replacement, so a NaN there reaches nothing)."""
    x = feature_maps.upcast(x)
    return x if live is None else jnp.where(live, x, jnp.zeros((), x.dtype))


def _chunk_body(diagonal: bool, kernel, state, x, *, dtype=None, eps=None, phi=None):
    """One chunk of c tokens: a masked matmul inside, plus the incoming state.

    Args:
      diagonal, kernel, dtype: as in ``_chunk_parts``; ``dtype`` also for the products
        that read the values and the state (not the one that writes the state).
      eps: None, or return ``(numerator / (denominator + eps), None)`` (needs Z).
      phi: None, or the feature map applied here to x's raw q and k (``chunked``).
      state: ``(S [b, h, f, v], Z [b, h, f] | None)`` before the chunk.
      x: ``(phi_q [b,h,c,f], phi_k [b,h,c,f], v [b,h,c,v], log-decay [b,h,c,g] | None,
        segment resets [b,1,c,1] | None[, q, k, live])``.

    Returns:
      ``(state after the chunk, (numerator [b, h, c, v], denominator [b, h, c] | None))``.
    """
    v = _values(x, phi)
    s, z = state
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    parts = _chunk_parts(diagonal, kernel, _without_values(x), dtype=dtype, phi=phi)
    scores, q_in, k_out, across = parts
    num = mixed("bhij,bhjv->bhiv", scores, v) + mixed("bhif,bhfv->bhiv", q_in, s)
    # The state's update keeps float32 operands: it is what the scan and step forms write.
    s = _decay(across, s) + jnp.einsum("bhjf,bhjv->bhfv", k_out, v)
    if z is None:
        return (s, None), (num, None)
    den = _denominator(scores, q_in, z)
    z = _decay(across, z) + jnp.sum(k_out, axis=2)
    if eps is not None:
        return (s, z), (num / _divisor(den, eps)[..., None], None)
    return (s, z), (num, den)


def _divisor(den: Array, eps: float) -> Array:
    """``den + eps``, with 1 where that is 0: an all-zero query (masked, or the padding
    of the last chunk with ``eps=0``) then gives 0, not 0/0, and so does its gradient."""
    den = den + eps
    return jnp.where(den == 0, 1.0, den)


def _denominator(scores, q_in, z):
    """``phi(q_i)^T Z_i`` of a chunk's queries, ``[b, h, c]``."""
    return jnp.sum(scores, axis=-1) + jnp.einsum("bhif,bhf->bhi", q_in, z)


def _chunk_body_bwd(diagonal: bool, kernel, d_state, inputs, *, dtype=None, eps=None, phi=None):
    """The transpose of ``_chunk_body`` (``chunking.scan``'s ``body_bwd``).

    Args:
      diagonal, kernel, dtype, eps, phi: as in ``_chunk_body``.
      d_state: ``(dS [b,h,f,v], dZ [b,h,f] | None)``, the cotangent of the state after
        the chunk.
      inputs: ``((S, Z | None) entering the chunk, x, the chunk's outputs, their
        cotangents (d numerator [b,h,c,v], d denominator [b,h,c] | None))``; with
        ``eps`` the output and its cotangent are the normalised output's.

    Returns:
      ``((dS, dZ | None) before the chunk, d x)``.
    """
    (s, z), x, (out, _), (d_num, d_den) = inputs
    d_s, d_z = d_state
    v = _values(x, phi)
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    parts, vjp = jax.vjp(
        functools.partial(_chunk_parts, diagonal, kernel, dtype=dtype, phi=phi),
        _without_values(x),
    )
    scores, q_in, k_out, across = parts
    if eps is not None:  # out = num / (den + eps): the denominator's share of d out
        den = _divisor(_denominator(scores, q_in, z), eps)
        d_den = -jnp.sum(d_num * out, axis=-1) / den
        d_num = d_num / den[..., None]
    # With a denominator, dScores (d_num v^T + d_den) and d(phi(q)) (d_num S^T + d_den Z)
    # are sums that cancel where an output is near its values' mean: float32 operands
    # (bfloat16 ones doubled the error of q's gradient).
    cancels = mixed if z is None else jnp.einsum
    d_scores = cancels("bhiv,bhjv->bhij", d_num, v)
    d_v = mixed("bhij,bhiv->bhjv", scores, d_num) + mixed("bhjf,bhfv->bhjv", k_out, d_s)
    d_q_in = cancels("bhiv,bhfv->bhif", d_num, s)
    d_k_out = mixed("bhjv,bhfv->bhjf", v, d_s)
    d_across = None if across is None else _reduce_to(d_s * s, across.shape)
    d_s_prev = _decay(across, d_s) + mixed("bhif,bhiv->bhfv", q_in, d_num)
    d_z_prev = None
    if z is not None:
        d_scores = d_scores + d_den[..., None]
        d_q_in = d_q_in + d_den[..., None] * z[:, :, None]
        d_k_out = d_k_out + d_z[:, :, None]
        if across is not None:
            d_across = d_across + _reduce_to(d_z * z, across.shape)
        d_z_prev = _decay(across, d_z) + jnp.einsum("bhif,bhi->bhf", q_in, d_den)
    (d_x,) = vjp((d_scores, d_q_in, d_k_out, d_across))
    if phi is not None:  # the raw values' cotangent: none at a dead token
        d_v = _live(x[-1], d_v)
    return (d_s_prev, d_z_prev), d_x[:2] + (d_v,) + d_x[2:]


def _values(x, phi):
    """A chunk's values: as given, or (with ``phi``: raw inputs) upcast and zeroed at
    the dead tokens of ``live``, x's last entry."""
    return x[2] if phi is None else _live(x[-1], x[2])


def _without_values(x):
    """A chunk's inputs without v (``_chunk_parts``' x)."""
    return x[:2] + x[3:]


def _decay(a: Array | None, x: Array) -> Array:
    """The decay across a chunk, ``a [b, h, 1|f]`` (None: 1), times ``S`` or ``Z``."""
    if a is None:
        return x
    return a.reshape(a.shape + (1,) * (x.ndim - a.ndim)) * x


def _reduce_to(x: Array, shape: tuple[int, ...]) -> Array:
    """``x [b, h, f, ...]`` summed down to ``shape`` ``[b, h, 1|f]``."""
    x = jnp.sum(x, axis=tuple(range(len(shape), x.ndim)))
    return jnp.sum(x, axis=-1, keepdims=True) if shape[-1] == 1 else x


# ----------------------------------------------------------------------------
# Inputs and outputs, shared with sequence_parallel.py.
# ----------------------------------------------------------------------------


def features(
    q, k, v, feature_map, key_mask=None, query_mask=None, positions=None, *, heads_first=True
):
    """phi(q), phi(k) as ``[b, h, t, f]`` and v as ``[b, h, s, v]``, all float32 (or float64);
    with ``heads_first=False`` as given, ``[b, t, h, f]`` and ``[b, s, h, v]``.

    Masked tokens (bool ``[b, t]`` / ``[b, s]`` masks) are replaced by zeros before the
    feature map and their features zeroed after it, so nothing non-finite in them
    reaches an output or a gradient.

    ``positions``: ``(query positions [b, t], key positions [b, s])`` for maps with
    ``needs_positions``; by default each sequence counts from 0.

    A registered (parameter-free) map is rematerialised in the gradient
    (``jax.checkpoint``): its backward recomputes what it needs from q and k in the
    pass that writes their cotangents, rather than storing (and later reading) a
    second array per input. Maps with a projection keep autodiff's residuals (their
    recomputation would repeat a matmul).
    """
    phi = feature_maps.get(feature_map)
    q, k, v = (
        checks.where_token(query_mask, q),
        checks.where_token(key_mask, k),
        checks.where_token(key_mask, v),
    )
    if getattr(phi, "needs_positions", False):
        if positions is None:
            span = max(q.shape[1], k.shape[1]) - 1
            positions = [jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2]) for x in (q, k)]
        elif all(checks.is_concrete(p) and p.size for p in positions):
            span = int(max(np.max(p) for p in positions) - min(np.min(p) for p in positions))
        else:
            span = None
        max_length = getattr(phi, "max_length", None)
        if max_length is not None and span is not None and span > max_length:
            raise ValueError(
                f"this feature_map's reweighting holds for query-key distances up to "
                f"max_length={max_length}, got positions spanning {span}: build it with a "
                f"larger max_length"
            )
        phi_q, phi_k = phi(q, positions[0]), phi(k, positions[1])
    elif getattr(phi, "role_aware", False):
        phi_q, phi_k = phi(q, is_query=True), phi(k, is_query=False)
    else:
        remat = jax.checkpoint(phi) if feature_maps.is_registered(phi) else phi
        phi_q, phi_k = remat(q), remat(k)
    for name, x, y in [("phi(q)", phi_q, q), ("phi(k)", phi_k, k)]:
        if x.shape[:-1] != y.shape[:-1]:
            raise ValueError(
                f"feature_map must map [..., d] to [..., f]; {name} has shape {x.shape} "
                f"for input {y.shape}"
            )
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"feature_map gave different feature dims for q and k: {phi_q.shape} vs {phi_k.shape}"
        )
    dtype = feature_maps.accumulation_dtype(q.dtype)
    phi_q = checks.where_token(query_mask, phi_q.astype(dtype))
    phi_k = checks.where_token(key_mask, phi_k.astype(dtype))
    v = v.astype(dtype)
    if not heads_first:
        return phi_q, phi_k, v
    return tuple(jnp.swapaxes(x, 1, 2) for x in (phi_q, phi_k, v))


def chunk_kernel(q, k, feature_map, key_mask, g, *, heads_first=True):
    """``chunked``'s ``kernel`` argument: ``(phi.kernel_from_dots, q, k, live)``, q and k
    masked and upcast as ``features`` does (and laid out as it does for ``heads_first``),
    for a map that has ``kernel_from_dots`` (``feature_maps.taylor``); None for the
    others, and with per-channel decays (which do not factor out of the kernel)."""
    fn = _kernel_from_dots(feature_maps.get(feature_map), g)
    if fn is None:
        return None
    dtype = feature_maps.accumulation_dtype(q.dtype)
    q, k = (checks.where_token(key_mask, x).astype(dtype) for x in (q, k))
    live = None if key_mask is None else key_mask[:, :, None, None]
    if heads_first:
        q, k = jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)
        live = None if live is None else jnp.swapaxes(live, 1, 2)
    return fn, q, k, live


def _kernel_from_dots(phi, g):
    """``phi.kernel_from_dots``, or None: for a map without one, and with per-channel
    decays ``g [.., f]`` (which do not factor out of the kernel)."""
    if g is not None and g.shape[-1] != 1:
        return None
    return getattr(phi, "kernel_from_dots", None)


def check_normalize(feature_map, normalize: bool, *, name: str | None = None) -> None:
    """Refuses the combinations of feature map and ``normalize`` that give wrong answers.

    Raises:
      ValueError: a map that shifts each query's features (FAVOR+) without
        normalisation, or a signed map (identity, random Fourier) with it: its
        denominator can be zero or negative. ``name`` is the map's name in the message.
    """
    phi = feature_maps.get(feature_map)
    if not normalize and getattr(phi, "requires_normalize", False):
        raise ValueError(
            "this feature_map scales each query's features for stability, which only "
            "normalize=True cancels: use normalize=True"
        )
    if normalize and getattr(phi, "signed", False):
        if name is None:
            name = feature_map if isinstance(feature_map, str) else getattr(phi, "__name__", phi)
        raise ValueError(
            f"feature_map={name!r} has a signed kernel: the denominator phi(q)^T Z "
            "can be zero or change sign, so normalize=True can divide by about zero; use "
            "normalize=False (an RMSNorm per head then keeps the output's scale)"
        )


def finish(
    num: Array, den: Array | None, normalize: bool, eps: float, dtype, *, time_axis: int = 2
) -> Array:
    """Numerator ``[b, h, t, v]`` (over denominator ``[b, h, t]``) -> ``[b, t, h, v]``;
    with ``time_axis=1`` they are ``[b, t, h, v]`` and ``[b, t, h]`` already."""
    if normalize:
        num = num / _divisor(den, eps)[..., None]
    return (num if time_axis == 1 else jnp.swapaxes(num, 1, 2)).astype(dtype)


def _zero_state(b: int, h: int, f: int, dv: int, dtype, with_z: bool):
    z = jnp.zeros((b, h, f), dtype) if with_z else None
    return jnp.zeros((b, h, f, dv), dtype), z


def state_in(state: LinearAttentionState | None, b, h, f, dv, dtype, *, with_z: bool = True):
    """A user's state as the internal pair ``(S, Z | None)`` in ``dtype`` (zeros if None)."""
    if state is None:
        return _zero_state(b, h, f, dv, dtype, with_z)
    if not isinstance(state, LinearAttentionState):
        raise ValueError(f"state must be a LinearAttentionState, got {type(state).__name__}")
    checks.check_shape("state.s", state.s, (b, h, f, dv), "[batch, heads, feature_dim, value_dim]")
    checks.check_shape("state.z", state.z, (b, h, f), "[batch, heads, feature_dim]")
    return state.s.astype(dtype), state.z.astype(dtype) if with_z else None
