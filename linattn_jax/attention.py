"""Linear attention, in every form: arrays in, arrays out.

For each query i, with a feature map phi (``linattn_jax.feature_maps``)::

    out_i = phi(q_i)^T S_i / (phi(q_i)^T Z_i + eps)
    S_i = a_i S_{i-1} + phi(k_i) v_i^T     (f x v)
    Z_i = a_i Z_{i-1} + phi(k_i)           (f)

where ``a_i`` is 1 for plain linear attention, a per-head constant for
``decay=``, ``exp(gate_i)`` for a data-dependent ``gate=``, and 0 where
``segment_ids`` starts a new segment. Non-causal attention sums S and Z over
all keys. The causal forms share one recurrence and differ in how they run it:

* ``"scan"``: one ``lax.scan`` step per token (the reference recurrence);
* ``"chunked"``: a masked matmul inside chunks of ``chunk_size`` tokens and a
  ``lax.scan`` across chunks (the fast default);
* ``"quadratic"``: the masked ``t x t`` form, for short inputs;
* ``causal_linear_attention_step``: one token, O(1) in t, for decoding.

Internally ``Z`` is carried as one extra column of ``S`` (values augmented by a
column of ones), so numerator and denominator come out of the same matmuls.
States and sums are float32 whatever the input dtype (float64 for float64 inputs).

Memory: the scan and chunked forms are differentiated by a ``custom_vjp`` that
stores only the state at each chunk boundary and recomputes the inside of a
chunk in a reverse scan, so a gradient costs O(t*d + (t/c)*f*v) extra memory,
not the O(t*f*v) of autodiff through a per-token scan. States are never rebuilt
by subtracting from the final state (that cancels catastrophically).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax import feature_maps
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
    for name, n in [
        ("batch", batch),
        ("heads", heads),
        ("feature_dim", feature_dim),
        ("value_dim", value_dim),
    ]:
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
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
      key_mask: optional bool ``[b, s]``, True for real tokens. A masked key is
        removed from the numerator and the denominator.
      segment_ids: optional int ``[b, t]`` (self-attention, ``t == s``): tokens
        attend only to keys of the same run of equal ids (packed sequences).
      normalize: divide by ``phi(q)^T Z + eps`` (True) or return the numerator.
      eps: added to the denominator.

    Returns:
      ``[b, t, h, v]`` in the dtype of ``v``.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, a bad ``key_mask`` or
        ``segment_ids``, or an unknown feature map.
    """
    b, t, h, _ = _check_qkv(q, k, v, causal=False)
    _check_normalize(feature_map, normalize)
    phi_q, phi_k, v32 = _features(q, k, v, feature_map, key_mask)
    dtype = phi_q.dtype
    if segment_ids is None:
        s = jnp.einsum("bhsf,bhsv->bhfv", phi_k, _augment(v32))
        out = jnp.einsum("bhtf,bhfv->bhtv", phi_q, s)
    else:
        if k.shape[1] != t:
            raise ValueError(
                f"segment_ids needs self-attention (query length == key length), got q "
                f"{q.shape} and k {k.shape}"
            )
        resets = _segment_resets(segment_ids, b, t, dtype)
        # Block-diagonal attention in linear time: an inclusive causal pass plus
        # a strictly-causal pass over the reversed sequence.
        flip = functools.partial(jnp.flip, axis=2)
        fwd, _ = _chunked(phi_q, phi_k, v32, None, resets, None, 64, include_diagonal=True)
        rev_resets = _segment_resets(jnp.flip(segment_ids, 1), b, t, dtype)
        bwd, _ = _chunked(
            flip(phi_q), flip(phi_k), flip(v32), None, rev_resets, None, 64, include_diagonal=False
        )
        out = fwd + flip(bwd)
    return _finish(out, normalize, eps, v.dtype)


def causal_linear_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    *,
    feature_map: str | FeatureMap = "elu",
    method: str = "chunked",
    chunk_size: int = 64,
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
        backward pass (``"scan"``); any length works, divisible or not.
      initial_state: the state before token 0 (e.g. from an earlier piece of the
        same sequence, ``return_state=True``); zeros when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens; a masked token adds
        nothing to S or Z (its own query still reads them).
      decay: optional fixed decay ``gamma`` in (0, 1], a scalar or one per head
        ``[h]``: ``S_i = gamma S_{i-1} + phi(k_i) v_i^T`` (RetNet, Lightning).
      gate: optional data-dependent log-decay ``[b, t, h]``, values <= 0:
        ``S_i = exp(gate_i) S_{i-1} + ...`` (Mamba2, simple GLA). Combines with ``decay``.
      segment_ids: optional int ``[b, t]``; the state resets wherever the id changes
        (packed sequences). ``initial_state`` belongs to token 0's segment.
      positions: optional int ``[b, t]`` token positions, for position-aware feature
        maps (cosFormer); ``arange(t)`` by default (pass an offset when streaming).
      normalize: divide by ``phi(q)^T Z + eps`` (True) or return the numerator only.
      eps: added to the denominator.

    Returns:
      ``out [b, t, h, v]`` in the dtype of ``v``, or ``(out, state)`` when
      ``return_state``; ``state`` is a float32 ``LinearAttentionState``.

    Raises:
      ValueError: on mismatched or wrong-rank shapes, an unknown method or feature
        map, ``chunk_size < 1``, or a bad state, mask, decay, gate or segment ids.
    """
    b, t, h, _ = _check_qkv(q, k, v, causal=True)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_chunk_size(chunk_size)
    _check_normalize(feature_map, normalize)
    if positions is not None:
        _check_shape("positions", positions, (b, t), "[batch, length]")
        positions = (positions, positions)
    phi_q, phi_k, v32 = _features(q, k, v, feature_map, key_mask, positions)
    f, dv, dtype = phi_q.shape[-1], v.shape[-1], phi_q.dtype
    log_decay = _log_decay(decay, gate, b, t, h, dtype)
    resets = None if segment_ids is None else _segment_resets(segment_ids, b, t, dtype)
    state = _state_in(initial_state, b, h, f, dv, dtype)
    if method == "quadratic":
        x = (phi_q, phi_k, _augment(v32), log_decay, resets)
        state, out = _chunk_body(True, state, x)
    else:
        body = _scan_body if method == "scan" else None
        out, state = _chunked(
            phi_q,
            phi_k,
            v32,
            log_decay,
            resets,
            state,
            chunk_size,
            include_diagonal=True,
            body=body,
        )
    out = _finish(out, normalize, eps, v.dtype)
    if return_state:
        return out, LinearAttentionState(s=state[..., :-1], z=state[..., -1])
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
      gate: this token's log-decay ``[b, h]``.
      position: this token's int position ``[b]``; needed by position-aware feature
        maps (cosFormer), ignored by the others.
      normalize: as in ``causal_linear_attention``.
      eps: as in ``causal_linear_attention``.

    Returns:
      ``(out [b, h, v] in the dtype of v, new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, a bad state, decay or gate.
    """
    for name, x in [("q", q), ("k", k), ("v", v)]:
        _check_rank(name, x, 3, "[batch, heads, dim]")
    b, h, _ = q.shape
    _check_same(("q", q), ("k", k), ("v", v), axes=(0, 1), what="batch and heads")
    _check_same(("q", q), ("k", k), axes=(2,), what="head dimension")
    # A one-token sequence through the shared recurrence.
    positions = None
    if position is not None:
        _check_shape("position", position, (b,), "[batch]")
        positions = (position[:, None], position[:, None])
    elif getattr(feature_maps.get(feature_map), "needs_positions", False):
        raise ValueError("this feature_map needs positions: pass position=[batch] int")
    _check_normalize(feature_map, normalize)
    phi_q, phi_k, v32 = _features(q[:, None], k[:, None], v[:, None], feature_map, None, positions)
    if gate is not None:
        _check_shape("gate", gate, (b, h), "[batch, heads]")
        gate = gate[:, None]
    log_decay = _log_decay(decay, gate, b, 1, h, phi_q.dtype)
    s = _state_in(state, b, h, phi_q.shape[-1], v.shape[-1], phi_q.dtype)
    a = None if log_decay is None else jnp.exp(log_decay[..., 0])
    s, out = _recurrent_step(s, (phi_q[:, :, 0], phi_k[:, :, 0], _augment(v32)[:, :, 0], a))
    out = _finish(out[:, :, None], normalize, eps, v.dtype)[:, 0]
    return out, LinearAttentionState(s=s[..., :-1], z=s[..., -1])


# ----------------------------------------------------------------------------
# The recurrence. Internal layout: [b, h, t, f] features, [b, h, t, v+1] values
# (the last column is ones, so the last state column is Z), [b, h, t] log-decay
# and [b, 1, t] resets (1.0 where a new segment starts).
# ----------------------------------------------------------------------------

_Inputs = tuple[Array, Array, Array, Array | None, Array | None]


def _chunk_body(include_diagonal: bool, state: Array, x: _Inputs) -> tuple[Array, Array]:
    """One chunk of c tokens: masked matmul inside, plus the incoming state.

    Args:
      include_diagonal: whether query i sees key i (False: strictly causal).
      state: ``[b, h, f, v+1]`` before the chunk.
      x: ``(phi_q [b,h,c,f], phi_k [b,h,c,f], v [b,h,c,v+1], log_decay [b,h,c] | None,
        resets [b,1,c] | None)``.

    Returns:
      ``(state after the chunk, out [b, h, c, v+1])``.
    """
    q, k, v, g, r = x
    c = q.shape[-2]
    scores = jnp.einsum("bhif,bhjf->bhij", q, k)
    mask = jnp.tril(jnp.ones((1, 1, c, c), bool), 0 if include_diagonal else -1)
    if g is None and r is None:
        scores = jnp.where(mask, scores, 0.0)
        q_in, k_out, carried = q, k, state
    else:
        # Cumulative log-decay inside the chunk; exp(G_i - G_j) <= 1 for j <= i.
        cum = jnp.zeros(q.shape[:-1], q.dtype) if g is None else jnp.cumsum(g, axis=-1)
        alive = jnp.ones((1, 1, c), bool)  # no reset since the chunk began
        if r is not None:
            run = jnp.cumsum(r, axis=-1)
            mask = mask & (run[..., :, None] == run[..., None, :])
            alive = run == 0
            same_as_last = run == run[..., -1:]
        else:
            same_as_last = alive
        diff = jnp.where(mask, cum[..., :, None] - cum[..., None, :], -jnp.inf)
        scores = scores * jnp.exp(diff)
        q_in = q * jnp.where(alive, jnp.exp(cum), 0.0)[..., None]
        k_out = k * jnp.where(same_as_last, jnp.exp(cum[..., -1:] - cum), 0.0)[..., None]
        carried = state * jnp.where(alive[..., -1], jnp.exp(cum[..., -1]), 0.0)[..., None, None]
    out = jnp.einsum("bhij,bhjv->bhiv", scores, v) + jnp.einsum("bhif,bhfv->bhiv", q_in, state)
    new_state = carried + jnp.einsum("bhjf,bhjv->bhfv", k_out, v)
    return new_state, out


def _recurrent_step(state: Array, x: tuple[Array, Array, Array, Array | None]):
    """``S = a S + phi(k) v^T; out = phi(q)^T S`` for one token of every (b, h)."""
    q, k, v, a = x  # [b,h,f], [b,h,f], [b,h,v+1], [b,h] | None
    if a is not None:
        state = a[..., None, None] * state
    state = state + k[..., :, None] * v[..., None, :]
    return state, jnp.einsum("bhf,bhfv->bhv", q, state)


def _scan_body(include_diagonal: bool, state: Array, x: _Inputs) -> tuple[Array, Array]:
    """One block of c tokens run one token at a time (the reference recurrence)."""
    del include_diagonal  # the scan form is always inclusive
    q, k, v, g, r = x
    a = None
    if g is not None or r is not None:
        a = jnp.exp(g) if g is not None else jnp.ones(q.shape[:-1], q.dtype)
        if r is not None:
            a = a * (1.0 - r)
    seq = functools.partial(jnp.moveaxis, source=2, destination=0)
    state, out = _token_scan(state, seq(q), seq(k), seq(v), None if a is None else seq(a))
    return state, jnp.moveaxis(out, 0, 2)


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
        d_a = jnp.einsum("bhfv,bhfv->bh", d_s, s_prev)
        return ai[..., None, None] * d_s, (d_q, d_k, d_v, d_a)

    d_state, d_xs = jax.lax.scan(step, d_final, (after, before, q, k, v, a, d_out), reverse=True)
    return (d_state, *d_xs)


_token_scan.defvjp(_token_scan_fwd, _token_scan_bwd)


def _chunked(
    phi_q: Array,
    phi_k: Array,
    v: Array,
    log_decay: Array | None,
    resets: Array | None,
    state: Array | None,
    chunk_size: int,
    *,
    include_diagonal: bool,
    body: Callable[..., tuple[Array, Array]] | None = None,
) -> tuple[Array, Array]:
    """Runs ``body`` (default ``_chunk_body``) over chunks with a memory-lean gradient.

    Returns ``(out [b, h, t, v+1], final state [b, h, f, v+1])``.
    """
    b, h, t, f = phi_q.shape
    v = _augment(v)
    if state is None:
        state = jnp.zeros((b, h, f, v.shape[-1]), v.dtype)
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t

    def chunks(x: Array | None) -> Array | None:
        # Zero padding is inert: a zero key adds nothing, a zero log-decay keeps S.
        if x is None:
            return None
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(x.shape[:2] + (n, c) + x.shape[3:]), 2, 0)

    xs = tuple(map(chunks, (phi_q, phi_k, v, log_decay, resets)))
    body = functools.partial(body or _chunk_body, include_diagonal)
    state, out = _scan_chunks(body, state, xs)
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, -1)[:, :, :t]
    return out, state


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan_chunks(body, state, xs):
    """``lax.scan(body, state, xs)`` whose gradient recomputes each chunk.

    The forward stores only the state entering each chunk; the backward is a
    reverse scan that re-runs one chunk at a time under ``jax.vjp``.
    """
    return jax.lax.scan(body, state, xs)


def _scan_chunks_fwd(body, state, xs):
    def step(s, x):
        s_next, y = body(s, x)
        return s_next, (y, s)

    final, (ys, states) = jax.lax.scan(step, state, xs)
    return (final, ys), (states, xs)


def _scan_chunks_bwd(body, residuals, cotangents):
    states, xs = residuals
    d_final, d_ys = cotangents

    def step(d_s, inputs):
        s, x, d_y = inputs
        _, vjp = jax.vjp(body, s, x)
        d_s_prev, d_x = vjp((d_s, d_y))
        return d_s_prev, d_x

    d_state, d_xs = jax.lax.scan(step, d_final, (states, xs, d_ys), reverse=True)
    return d_state, d_xs


_scan_chunks.defvjp(_scan_chunks_fwd, _scan_chunks_bwd)


# ----------------------------------------------------------------------------
# Inputs and outputs.
# ----------------------------------------------------------------------------


def _features(q, k, v, feature_map, key_mask, positions=None):
    """phi(q), phi(k) as ``[b, h, t, f]`` and v as ``[b, h, s, v]``, all float32 (or float64).

    ``positions``: ``(query positions [b, t], key positions [b, s])`` for maps with
    ``needs_positions``; by default each sequence counts from 0.
    """
    phi = feature_maps.get(feature_map)
    if getattr(phi, "needs_positions", False):
        if positions is None:
            positions = [jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2]) for x in (q, k)]
        phi_q, phi_k = phi(q, positions[0]), phi(k, positions[1])
    elif getattr(phi, "role_aware", False):
        phi_q, phi_k = phi(q, is_query=True), phi(k, is_query=False)
    else:
        phi_q, phi_k = phi(q), phi(k)
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
    phi_q, phi_k = phi_q.astype(dtype), phi_k.astype(dtype)
    if key_mask is not None:
        b, s = k.shape[:2]
        _check_shape("key_mask", key_mask, (b, s), "[batch, key_length]")
        if key_mask.dtype != jnp.bool_:
            raise ValueError(f"key_mask must be bool (True = real token), got {key_mask.dtype}")
        phi_k = jnp.where(key_mask[:, :, None, None], phi_k, 0.0)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    return heads_first(phi_q), heads_first(phi_k), heads_first(v.astype(dtype))


def _check_normalize(feature_map, normalize: bool) -> None:
    if not normalize and getattr(feature_maps.get(feature_map), "requires_normalize", False):
        raise ValueError(
            "this feature_map scales each query's features for stability, which only "
            "normalize=True cancels: use normalize=True"
        )


def _augment(v: Array) -> Array:
    """Appends a column of ones: the state's last column then sums phi(k), i.e. Z."""
    return jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], axis=-1)


def _finish(out: Array, normalize: bool, eps: float, dtype) -> Array:
    """``[b, h, t, v+1]`` (numerator | denominator) -> ``[b, t, h, v]`` in ``dtype``."""
    num, den = out[..., :-1], out[..., -1:]
    if normalize:
        num = num / (den + eps)
    return jnp.swapaxes(num, 1, 2).astype(dtype)


def _state_in(state: LinearAttentionState | None, b: int, h: int, f: int, dv: int, dtype):
    """A user's state as the internal ``[b, h, f, v+1]`` array in ``dtype`` (zeros if None)."""
    if state is None:
        return jnp.zeros((b, h, f, dv + 1), dtype)
    if not isinstance(state, LinearAttentionState):
        raise ValueError(f"state must be a LinearAttentionState, got {type(state).__name__}")
    _check_shape("state.s", state.s, (b, h, f, dv), "[batch, heads, feature_dim, value_dim]")
    _check_shape("state.z", state.z, (b, h, f), "[batch, heads, feature_dim]")
    s, z = state.s.astype(dtype), state.z.astype(dtype)
    return jnp.concatenate([s, z[..., None]], axis=-1)


def _log_decay(decay, gate, b: int, t: int, h: int, dtype) -> Array | None:
    """``log(decay)`` + ``gate`` as ``[b, h, t]`` in ``dtype``, or None when neither is given."""
    if decay is None and gate is None:
        return None
    total = jnp.zeros((b, h, t), dtype)
    if decay is not None:
        decay = jnp.asarray(decay).astype(dtype)
        if decay.shape not in ((), (h,)):
            raise ValueError(f"decay must be a scalar or [heads]=({h},), got shape {decay.shape}")
        if not isinstance(decay, jax.core.Tracer):
            bad = np.asarray(decay)
            if np.any(~((bad > 0) & (bad <= 1))):
                raise ValueError(f"decay must lie in (0, 1], got {bad}")
        total = total + jnp.log(jnp.broadcast_to(decay, (h,)))[None, :, None]
    if gate is not None:
        _check_shape("gate", gate, (b, t, h), "[batch, length, heads]")
        total = total + jnp.swapaxes(gate.astype(dtype), 1, 2)
    return total


def _segment_resets(segment_ids, b: int, t: int, dtype) -> Array:
    """1.0 at tokens whose id differs from the previous token's, as ``[b, 1, t]``."""
    _check_shape("segment_ids", segment_ids, (b, t), "[batch, length]")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    change = jnp.concatenate([jnp.zeros((b, 1), bool), change], axis=1)
    return change.astype(dtype)[:, None, :]


def _check_chunk_size(chunk_size) -> None:
    if (
        not isinstance(chunk_size, (int, np.integer))
        or isinstance(chunk_size, bool)
        or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")


def _check_rank(name: str, x, rank: int, layout: str) -> None:
    if not hasattr(x, "shape") or len(x.shape) != rank:
        shape = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {shape}")


def _check_shape(name: str, x, shape: tuple[int, ...], layout: str) -> None:
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(shape):
        got = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have shape {layout}={tuple(shape)}, got {got}")


def _check_same(*named, axes: tuple[int, ...], what: str) -> None:
    shapes = {name: tuple(x.shape[a] for a in axes) for name, x in named}
    if len(set(shapes.values())) > 1:
        got = ", ".join(f"{name} {x.shape}" for name, x in named)
        raise ValueError(f"{' and '.join(shapes)} must agree in {what}; got {got}")


def _check_qkv(q, k, v, *, causal: bool) -> tuple[int, int, int, int]:
    """Validates ``[b, t, h, d]`` queries against keys and values; returns ``q.shape``."""
    for name, x in [("q", q), ("k", k), ("v", v)]:
        _check_rank(name, x, 4, "[batch, length, heads, dim]")
    _check_same(("q", q), ("k", k), ("v", v), axes=(0, 2), what="batch and heads")
    _check_same(("k", k), ("v", v), axes=(1,), what="key length")
    _check_same(("q", q), ("k", k), axes=(3,), what="head dimension")
    if causal:
        _check_same(("q", q), ("k", k), axes=(1,), what="length (causal attention)")
    return q.shape
