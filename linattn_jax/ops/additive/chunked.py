"""The additive rule's chunked form: one chunk's masked matmuls and their transpose.

Inside a chunk of c tokens the outputs are a masked ``[c, c]`` matmul of decayed scores
plus the queries times the incoming state; ``linattn_jax.ops.chunking`` scans the
chunks. The hand-written transpose (``chunk_body_bwd``) takes the state entering the
chunk and the cotangent of the state after it, and runs only the transposed products:
the chunk's outputs and its update of the state are never recomputed, only its decayed
scores (``chunk_parts``).

Internal layout: ``[b, h, c, f]`` features, ``[b, h, c, v]`` values, ``[b, h, c, g]``
log-decays (-inf: a reset) and ``[b, 1, c, 1]`` segment resets (see
``linattn_jax.ops.checks``); the state is the pair ``(S [b, h, f, v], Z [b, h, f] | None)``
(None when no denominator is needed); outputs are the pair ``(numerator [b, h, c, v],
denominator [b, h, c] | None)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking, feature_maps
from linattn_jax.ops.additive.inputs import divisor, kernel_from_dots
from linattn_jax.typing import Array


def run_chunks(
    phi_q: Array,
    phi_k: Array,
    v: Array,
    g: Array | None,
    resets: Array | None,
    state: tuple[Array, Array | None],
    chunk_size: int,
    *,
    diagonal: bool,
    kernel=None,
    dtype=None,
    time_axis: int = 2,
    eps: float | None = None,
    phi=None,
    live: Array | None = None,
):
    """The additive recurrence over chunks, internal layout in and out.

    Each chunk runs ``chunk_body``; its gradient is the hand-written ``chunk_body_bwd``.

    Args:
      phi_q: query features ``[b, h, t, f]`` (the raw q with ``phi``).
      phi_k: key features ``[b, h, t, f]`` (the raw k with ``phi``).
      v: values ``[b, h, t, v]``.
      g: log-decays ``[b, h, t, g]`` or None.
      resets: segment resets ``[b, 1, t, 1]`` or None.
      state: ``(S [b, h, f, v], Z [b, h, f] | None)`` before the first token.
      chunk_size: tokens per chunk.
      diagonal: whether query i sees key i (False: strictly causal).
      kernel: optional ``(fn, q [b,h,t,d], k [b,h,t,d], live [b,1,t,1] bool | None)`` with
        ``fn(q_i . k_j, d)`` equal to ``phi(q_i) . phi(k_j)`` for live tokens: the scores
        inside a chunk then come from the d-wide dot products, and the features only
        carry the state (per-head decays only).
      dtype: the operand dtype of ``chunk_body``'s matmuls (``chunking.operand_dtype`` of
        the caller's inputs; None: the features' own dtype, no cast).
      time_axis: 2 for the internal heads-first layout; 1 for time-major inputs and
        outputs (every ``[b, h, t, .]`` above is then ``[b, t, h, .]``, resets and
        ``live`` ``[b, t, 1, 1]``), which ``chunking.scan`` moves heads first one chunk
        at a time.
      eps: None, or (with Z in the state) the chunks return the normalised output
        ``numerator / (denominator + eps)`` in place of the numerator, and None for the
        denominator.
      phi: None, or a registered (per-token, parameter-free) feature map that each chunk
        applies itself: ``phi_q``, ``phi_k`` and ``v`` are then the raw q, k and v (any
        float dtype), and ``live`` (bool ``[b, 1, t, 1]``, None: all live) marks the
        tokens that count; the others are replaced by zeros before the map and their
        features zeroed after it, as ``inputs.features`` does. Its ``kernel_from_dots``
        (Taylor) then gives the scores inside a chunk wherever ``kernel`` would.
      live: see ``phi``.

    Returns:
      ``((numerator [b,h,t,v], denominator [b,h,t] | None), final (S, Z | None))``.
    """
    if eps is not None and state[1] is None:
        raise ValueError("run_chunks: eps needs Z in the state")
    xs = (phi_q, phi_k, v, g, resets)
    t = phi_q.shape[time_axis]
    fn = None
    if phi is not None:
        c, n = chunking.chunk_count(chunk_size, t)
        if live is None and n * c != t:
            # The padding of the last chunk must be dead: phi(0) need not be 0 (elu + 1).
            shape = [phi_q.shape[0], 1, 1, 1]
            shape[time_axis] = t
            live = jnp.ones(shape, bool)
        xs = xs + (live,)
        fn = kernel_from_dots(phi, g)
    elif kernel is not None:
        fn, q, k, live = kernel
        xs = xs + (q, k, live)
    options = dict(dtype=dtype, eps=eps, phi=phi)
    body = functools.partial(chunk_body, diagonal, fn, **options)
    body_bwd = functools.partial(chunk_body_bwd, diagonal, fn, **options)
    return chunking.scan(body, state, xs, chunk_size, t, body_bwd=body_bwd, time_axis=time_axis)


def chunk_parts(diagonal: bool, kernel, x, *, dtype=None, phi=None):
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


def chunk_body(diagonal: bool, kernel, state, x, *, dtype=None, eps=None, phi=None):
    """One chunk of c tokens: a masked matmul inside, plus the incoming state.

    Args:
      diagonal: as in ``chunk_parts``.
      kernel: as in ``chunk_parts``.
      dtype: as in ``chunk_parts``, and also for the products that read the values and
        the state (not the one that writes the state).
      eps: None, or return ``(numerator / (denominator + eps), None)`` (needs Z).
      phi: None, or the feature map applied here to x's raw q and k (``run_chunks``).
      state: ``(S [b, h, f, v], Z [b, h, f] | None)`` before the chunk.
      x: ``(phi_q [b,h,c,f], phi_k [b,h,c,f], v [b,h,c,v], log-decay [b,h,c,g] | None,
        segment resets [b,1,c,1] | None[, q, k, live])``.

    Returns:
      ``(state after the chunk, (numerator [b, h, c, v], denominator [b, h, c] | None))``.
    """
    x, ok, bad_v, spoilt_v = _finite_inputs(x, phi)
    bad, spoilt = chunking.poisoned(ok), ~jnp.all(ok, axis=2)
    v = _values(x, phi)
    s, z = state
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    parts = chunk_parts(diagonal, kernel, _without_values(x), dtype=dtype, phi=phi)
    scores, q_in, k_out, across = parts
    num = mixed("bhij,bhjv->bhiv", scores, v) + mixed("bhif,bhfv->bhiv", q_in, s)
    # The state's update keeps float32 operands: it is what the scan and step forms write.
    s = chunking.nan_where(spoilt_v, _decay(across, s) + jnp.einsum("bhjf,bhjv->bhfv", k_out, v))
    if z is None:
        return (s, None), (chunking.nan_where(bad_v, num), None)
    den = _denominator(scores, q_in, z)
    z = chunking.nan_where(spoilt, _decay(across, z) + jnp.sum(k_out, axis=2))
    if eps is not None:
        return (s, z), (chunking.nan_where(bad_v, num / divisor(den, eps)[..., None]), None)
    return (s, z), (chunking.nan_where(bad_v, num), chunking.nan_where(bad, den))


# The entries of a chunk's x through which a later token reaches earlier ones (keys,
# log-decays; the raw keys of a kernel_from_dots map; the values apart, per channel):
# non-finite ones are replaced by zeros and poison the outputs from their token on
# (``chunking.finite_values``).
_KEYS, _VALUES, _LOG_DECAYS, _RAW_KEYS = 1, 2, 3, 6


def _finite_inputs(x, phi):
    """``(x with non-finite keys, log-decays and values zeroed, ok [b, h|1, c], the outputs
    to poison [b, h, c, dv], the state columns to poison [b, h, 1, dv])``."""
    x = list(x)
    if phi is not None and x[-1] is not None:  # dead tokens (raw inputs) hold anything
        for i in (_KEYS, _VALUES):
            x[i] = chunking.where_finite(x[-1][..., 0], x[i])
    raw_keys = x[_RAW_KEYS] if len(x) > _RAW_KEYS and phi is None else None
    ok = chunking.finite_tokens(x[_KEYS], raw_keys, log_decays=x[_LOG_DECAYS])
    v, bad_v, spoilt_v = chunking.finite_values(ok, x[_VALUES])
    for i in (_KEYS, _LOG_DECAYS) + ((_RAW_KEYS,) if raw_keys is not None else ()):
        x[i] = chunking.where_finite(ok, x[i])
    x[_VALUES] = v
    return tuple(x), ok, bad_v, spoilt_v


def _denominator(scores, q_in, z):
    """``phi(q_i)^T Z_i`` of a chunk's queries, ``[b, h, c]``."""
    return jnp.sum(scores, axis=-1) + jnp.einsum("bhif,bhf->bhi", q_in, z)


def chunk_body_bwd(diagonal: bool, kernel, d_state, inputs, *, dtype=None, eps=None, phi=None):
    """The transpose of ``chunk_body`` (``chunking.scan``'s ``body_bwd``).

    Args:
      diagonal: as in ``chunk_body``.
      kernel: as in ``chunk_body``.
      dtype: as in ``chunk_body``.
      eps: as in ``chunk_body``.
      phi: as in ``chunk_body``.
      d_state: ``(dS [b,h,f,v], dZ [b,h,f] | None)``, the cotangent of the state after
        the chunk.
      inputs: ``((S, Z | None) entering the chunk, x, the chunk's outputs, their
        cotangents (d numerator [b,h,c,v], d denominator [b,h,c] | None))``; with
        ``eps`` the output and its cotangent are the normalised output's.

    Returns:
      ``((dS, dZ | None) before the chunk, d x)``.
    """
    (s, z), x, (out, _), (d_num, d_den) = inputs
    raw = x
    x, ok, bad_v, spoilt_v = _finite_inputs(x, phi)
    # Poisoned outputs and states are constants (NaN): no cotangent flows from them.
    d_num, out = (chunking.where_finite(~bad_v, y) for y in (d_num, out))
    if d_den is not None:
        d_den = chunking.where_finite(~chunking.poisoned(ok), d_den)
    d_s, d_z = d_state
    d_s = chunking.where_finite(~spoilt_v, d_s)
    d_z = None if d_z is None else chunking.where_finite(jnp.all(ok, axis=2), d_z)
    v = _values(x, phi)
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    parts, vjp = jax.vjp(
        functools.partial(chunk_parts, diagonal, kernel, dtype=dtype, phi=phi),
        _without_values(x),
    )
    scores, q_in, k_out, across = parts
    if eps is not None:  # out = num / (den + eps): the denominator's share of d out
        den = divisor(_denominator(scores, q_in, z), eps)
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
    d_x = list(d_x[:2] + (d_v,) + d_x[2:])
    for i in (_KEYS, _LOG_DECAYS, _RAW_KEYS):  # no cotangent reaches a zeroed input
        if i < len(d_x) and d_x[i] is not None and d_x[i].ndim == 4:
            d_x[i] = chunking.where_finite(ok, d_x[i])
    d_x[_VALUES] = chunking.where_finite(jnp.isfinite(raw[_VALUES]) & ok[..., None], d_v)
    return (d_s_prev, d_z_prev), tuple(d_x)


def _values(x, phi):
    """A chunk's values: as given, or (with ``phi``: raw inputs) upcast and zeroed at
    the dead tokens of ``live``, x's last entry."""
    return x[2] if phi is None else _live(x[-1], x[2])


def _without_values(x):
    """A chunk's inputs without v (``chunk_parts``' x)."""
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
