"""The additive rule's chunked form, chunk-parallel: masked matmuls inside chunks, batched
over a group of chunks, and a scan that carries only the state.

Inside a chunk of c tokens the outputs are a masked ``[c, c]`` matmul of decayed scores
plus the queries times the state entering the chunk, and the chunk's own write to the
state is ``B = K_out^T V`` (and ``sum K_out`` for Z): neither needs the state. So a group
of chunks (their chunks folded into the head axis, ``chunking.fold``) forms every chunk's
scores, decays and write in one batched pass (``chunk_parts``, ``_writes``); a
``lax.scan`` then carries only ``(S, Z)`` through the group, one elementwise
``S_next = a S + B`` per chunk (``_states``); and the outputs of all its chunks follow,
batched, from the states entering them (``_outputs``). On GPU and TPU a group is
``chunking.GROUP_TOKENS`` tokens (every chunk of a shorter sequence); on CPU one chunk
(``chunking.GROUP_TOKENS_CPU``, measured in docs/benchmarks.md).

Memory and recompute: ``linattn_jax.ops.chunking.scan`` stores the state entering each
group; the hand-written backward (``group_body_bwd``) recomputes the group's scores and
states (one batched pass and the cheap state scan) rather than store them, then runs the
transposed products batched, with one reverse scan of ``dS_prev = a dS + Q_in^T dO``
between them. What is kept between the passes is O(t (f + dv) + (t / C) f dv), never a
state per token; the transient peak is one group's ``[c, c]`` scores and its states,
O(group (c + f dv / c)) per head.

Internal layout: ``[b, h, c, f]`` features, ``[b, h, c, v]`` values, ``[b, h, c, g]``
log-decays (-inf: a reset) and ``[b, 1, c, 1]`` segment resets (see
``linattn_jax.ops.checks``); the state is the pair ``(S [b, h, f, v], Z [b, h, f] | None)``
(None when no denominator is needed); outputs are the pair ``(numerator [b, h, c, v],
denominator [b, h, c] | None)``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

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
    group_tokens: int | None = None,
    groups: int = 1,
):
    """The additive recurrence over chunks, internal layout in and out.

    The chunks run ``group_tokens // chunk_size`` at a time (``group_body``; its
    gradient is the hand-written ``group_body_bwd``).

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
      dtype: the operand dtype of the chunks' matmuls (``chunking.operand_dtype`` of
        the caller's inputs; None: the features' own dtype, no cast).
      time_axis: 2 for the internal heads-first layout; 1 for time-major inputs and
        outputs (every ``[b, h, t, .]`` above is then ``[b, t, h, .]``, resets and
        ``live`` ``[b, t, 1, 1]``), which ``chunking.scan`` moves heads first one group
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
      group_tokens: tokens whose chunks run at once (at least one chunk); None:
        ``chunking.GROUP_TOKENS_CPU`` (one chunk) on CPU, ``chunking.GROUP_TOKENS`` on GPU
        and TPU (``chunking.per_backend``), at most ``chunking.GROUP_STATE_ELEMENTS``
        state elements per head.
      groups: the value heads that read each q and k head (``phi_q`` and ``phi_k`` then
        have ``h / groups`` heads, repeated inside each group of chunks, never over the
        whole sequence; their gradient sums over the group). ``phi`` (per-token) only, no
        ``kernel``.

    Returns:
      ``((numerator [b,h,t,v], denominator [b,h,t] | None), final (S, Z | None))``.
    """
    if groups > 1 and kernel is not None:
        raise ValueError("run_chunks: groups > 1 takes no kernel")
    if eps is not None and state[1] is None:
        raise ValueError("run_chunks: eps needs Z in the state")
    run = functools.partial(
        run_chunks, phi_q, phi_k, v, g, resets, chunk_size=chunk_size, diagonal=diagonal,
        kernel=kernel, dtype=dtype, time_axis=time_axis, eps=eps, phi=phi, live=live,
        groups=groups,
    )  # fmt: skip
    if group_tokens is None:
        on = lambda tokens: lambda s: run(s, group_tokens=tokens)
        return chunking.per_backend(
            state, cpu=on(chunking.GROUP_TOKENS_CPU), default=on(chunking.GROUP_TOKENS)
        )
    xs = (phi_q, phi_k, v, g, resets)
    t = phi_q.shape[time_axis]
    c, n = chunking.chunk_count(chunk_size, t)
    per_group = chunking.chunks_per_group(c, n, group_tokens, math.prod(state[0].shape[2:]))
    fn = None
    if phi is not None:
        if live is None and -(-n // per_group) * per_group * c != t:
            # The padding of the last chunk must be dead: phi(0) need not be 0 (elu + 1).
            shape = [phi_q.shape[0], 1, 1, 1]
            shape[time_axis] = t
            live = jnp.ones(shape, bool)
        xs = xs + (live,)
        fn = kernel_from_dots(phi, g)
    elif kernel is not None:
        fn, q, k, live = kernel
        xs = xs + (q, k, live)
    options = dict(c=c, diagonal=diagonal, kernel=fn, dtype=dtype, eps=eps, phi=phi, groups=groups)
    body = functools.partial(group_body, **options)
    body_bwd = functools.partial(group_body_bwd, **options)
    if groups > 1:
        body = functools.partial(_grouped_body, body, groups)
        body_bwd = functools.partial(_grouped_body_bwd, body_bwd, groups)
    finite, xs, first_v, first = _finite_inputs(xs, phi, time_axis, groups)
    (num, den), (s, z) = chunking.scan(
        body, state, xs, per_group * c, t, body_bwd=body_bwd, time_axis=time_axis
    )
    # What a non-finite input reaches is NaN from its token on, as in the per-token
    # recurrence: the outputs (a value channel, or all of them), the final state's columns.
    poison = lambda n, d: (
        chunking.nan_from(first_v, n, time_axis),
        chunking.nan_from(first, d, time_axis),
    )
    num, den = chunking.if_not(finite, poison, lambda n, d: (n, d), num, den)
    heads_first = (lambda x: x) if time_axis == 2 else (lambda x: jnp.swapaxes(x, 1, 2))
    s = jnp.where(heads_first(first_v) < t, jnp.full((), jnp.nan, s.dtype), s)
    if z is not None:
        z = jnp.where(heads_first(first) < t, jnp.full((), jnp.nan, z.dtype), z)
    return (num, den), (s, z)


def _repeat_qk(x, groups: int):
    """A group's ``(q, k, ...)`` (heads first) with q and k repeated ``groups`` times per
    head (head ``i`` serves value heads ``i * groups ... i * groups + groups - 1``)."""
    q, k, *rest = x
    return (jnp.repeat(q, groups, axis=1), jnp.repeat(k, groups, axis=1), *rest)


def _grouped_body(body, groups: int, state, x):
    """``group_body`` on grouped q and k, repeated for this group of chunks only."""
    return body(state, _repeat_qk(x, groups))


def _grouped_body_bwd(body_bwd, groups: int, d_final, inputs):
    """``group_body_bwd`` on grouped q and k: their cotangents summed over each group."""
    state, raw, out, d_out = inputs
    d_state, dx = body_bwd(d_final, (state, _repeat_qk(raw, groups), out, d_out))
    dx = list(dx)
    for i in (0, 1):
        d = dx[i]
        dx[i] = jnp.sum(d.reshape(d.shape[0], -1, groups, *d.shape[2:]), axis=2)
    return d_state, tuple(dx)


def chunk_parts(
    diagonal: bool, kernel, x, *, dtype=None, phi=None, groups: int = 1, heads: int = 1
):
    """The decayed pieces of one chunk, all that its gradient needs to recompute.

    Args:
      diagonal: whether query i sees key i (False: strictly causal).
      kernel: None, or ``fn(q . k, d)`` giving the scores from ``x``'s last entries.
      x: ``(phi_q [b,h,c,f], phi_k [b,h,c,f], log-decay [b,h,c,g] | None, segment
        resets [b,1,c,1] | None[, q [b,h,c,d], k [b,h,c,d], live [b,1,c,1] | None])``
        (no values); with ``phi``, ``(q, k, log-decay, resets, live)``.
      dtype: the operand dtype of the scores' matmul (None: no cast).
      phi: None, or the feature map this chunk applies to its raw q and k.
      groups: the heads that share each q and k (``_repeat_qk``; x folded from
        ``heads`` heads): with per-head decays (or none) and no ``kernel``, their
        ``q k^T`` is formed once per group and repeated (``_group_dots``).
      heads: see ``groups``.

    Returns:
      ``(scores [b,h,c,c], phi_q decayed from the chunk's start [b,h,c,f], phi_k decayed
      to the chunk's end [b,h,c,f], the decay across the chunk [b,h,g] | None)``.
    """
    x = _finite_keys(x, _raw_keys(kernel, phi))
    if phi is None:
        q, k, g, r = x[:4]
    else:
        q_raw, k_raw, g, r, live = x
        q_raw, k_raw = _live(live, q_raw), _live(live, k_raw)
        q, k = _live(live, phi(q_raw)), _live(live, phi(k_raw))
        x = (q, k, g, r, q_raw, k_raw, live)
    dec = chunking.decays(g, r, q.shape[:3], q.dtype)
    if kernel is None and groups > 1 and (dec is None or dec.log_cum.shape[-1] == 1):
        dots = _group_dots(q, k, heads, groups, dtype)
        scores = chunking.decay_scores(dots, dec, diagonal=diagonal)
    elif kernel is None:
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
    return scores, chunking.scaled(q, dec.into), chunking.scaled(k, dec.out_of), dec.across


def _group_dots(q: Array, k: Array, heads: int, groups: int, dtype=None) -> Array:
    """``q_i . k_j`` ``[b, m, c, c]`` of chunks folded from ``heads`` heads (``[b, m =
    heads * n, c, f]``, head-major) whose q and k repeat each of ``heads / groups`` heads
    ``groups`` times: one product per group (its first head's), repeated; its gradient
    sums the group's cotangents before the transposed products."""
    b, m, c, f = q.shape
    shape = (b, heads // groups, groups, m // heads, c)
    first = lambda x: x.reshape(shape + (f,))[:, :, 0]
    dots = chunking.einsum("bgnif,bgnjf->bgnij", first(q), first(k), dtype=dtype)
    return jnp.broadcast_to(dots[:, :, None], shape + (c,)).reshape(b, m, c, c)


def _live(live: Array | None, x: Array) -> Array:
    """``x [b, h, c, .]`` in its accumulation dtype, zeros where ``live [b, 1, c, 1]`` is
    False (a replacement, so a NaN there reaches nothing)."""
    x = feature_maps.upcast(x)
    return x if live is None else jnp.where(live, x, jnp.zeros((), x.dtype))


def group_body(
    state, x, *, c: int, diagonal: bool, kernel=None, dtype=None, eps=None, phi=None, groups=1
):
    """One group of chunks (``chunking.scan``'s body): masked matmuls inside each chunk,
    batched, plus the state entering each chunk.

    Args:
      state: ``(S [b, h, f, v], Z [b, h, f] | None)`` before the group.
      x: ``(phi_q [b,h,g,f], phi_k [b,h,g,f], v [b,h,g,v], log-decay [b,h,g,g] | None,
        segment resets [b,1,g,1] | None[, q, k, live])``: ``run_chunks``' xs cut to the
        group's g tokens.
      c: tokens per chunk.
      diagonal: as in ``chunk_parts``.
      kernel: as in ``chunk_parts``.
      dtype: as in ``chunk_parts``, and also for the products that read the values and
        the states (not the ones that write the state).
      eps: None, or return ``(numerator / (denominator + eps), None)`` (needs Z).
      phi: None, or the feature map applied here to x's raw q and k (``run_chunks``).
      groups: the heads sharing each q and k (``chunk_parts``; 1: none).

    Returns:
      ``(state after the group, (numerator [b, h, g, v], denominator [b, h, g] | None))``.
    """
    h, length = x[0].shape[1], x[0].shape[2]
    x = _fold(x, c, h)
    v = _values(x, phi, _good_values(x, _raw_keys(kernel, phi)))
    parts = chunk_parts(
        diagonal, kernel, _without_values(x), dtype=dtype, phi=phi, groups=groups, heads=h
    )
    states, final = _states(h, parts[3], _writes(parts, v, state[1] is not None), state)
    num, den = _outputs(parts, v, states, dtype=dtype, eps=eps)
    return final, (chunking.unfold(num, h, length), chunking.unfold(den, h, length))


def _fold(x, c: int, h: int):
    """A group's inputs with its chunks folded into the head axis (``chunking.fold``)."""
    return tuple(chunking.fold(y, c, h) for y in x)


def _writes(parts, v: Array, with_z: bool):
    """Each chunk's own write to the state, ``(K_out^T V [b,m,f,v], sum K_out [b,m,f] |
    None)``: float32 operands (it is what the scan and step forms write)."""
    k_out = parts[2]
    b_z = jnp.sum(k_out, axis=2) if with_z else None
    return jnp.einsum("bmjf,bmjv->bmfv", k_out, v), b_z


def _states(h: int, across, writes, state):
    """The scan over a group's chunks: ``(the state entering each chunk (S [b,m,f,v], Z
    [b,m,f] | None), the state after the group)``."""

    def step(carry, y):
        s, z = carry
        a, b_s, b_z = y
        z_next = None if z is None else _decay(a, z) + b_z
        return (_decay(a, s) + b_s, z_next), (s, z)

    ys = jax.tree.map(functools.partial(chunking.chunk_major, h), (across, *writes))
    final, states = jax.lax.scan(step, state, ys)
    return jax.tree.map(chunking.head_major, states), final


def _outputs(parts, v: Array, states, *, dtype=None, eps=None):
    """Every chunk's ``(numerator [b,m,c,v], denominator [b,m,c] | None)`` from the state
    entering it (with ``eps``: the normalised output and None)."""
    scores, q_in = parts[:2]
    s, z = states
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    num = mixed("bmij,bmjv->bmiv", scores, v) + mixed("bmif,bmfv->bmiv", q_in, s)
    if z is None:
        return num, None
    den = _denominator(scores, q_in, z)
    if eps is not None:
        return num / divisor(den, eps)[..., None], None
    return num, den


# The entries of run_chunks' xs through which a later token reaches earlier ones (keys,
# log-decays; the raw keys of a kernel_from_dots map; the values apart, per channel):
# non-finite ones are replaced by zeros and poison the outputs from their token on.
_KEYS, _VALUES, _LOG_DECAYS, _RAW_KEYS = 1, 2, 3, 6


def _finite_inputs(xs, phi, time_axis: int, groups: int = 1):
    """Once per call, over the whole sequence: ``(whether every input is finite (a
    scalar), xs (with ``phi``, a dead token's raw keys and values zeroed), the index of
    the first token whose value channel is spoilt [b, h, 1, v] (time-major [b, 1, h, v]),
    that of the first bad token [b, h, 1] ([b, 1, h]))``, each the sequence's length
    where there is none.

    Each chunk zeroes its own non-finite keys, log-decays and values (``_finite_keys``,
    ``_values``: a replacement, so a masked matmul never spreads ``0 * NaN`` to earlier
    tokens; causal: an output never depends on a later input), fused with the ops that
    read them; ``chunking.nan_from`` then sets what the per-token recurrence would make
    non-finite: every output from a bad token on (a bad key or gate), or one value
    channel from a non-finite value on (the value channels never mix). A call whose
    inputs are all finite skips the indices and ``nan_from`` (``chunking.if_not``: one
    read-only check).
    """
    xs = list(xs)
    if phi is not None and xs[-1] is not None:  # dead tokens (raw inputs) hold anything
        for i in (_KEYS, _VALUES):
            xs[i] = chunking.where_finite(xs[-1][..., 0], xs[i])
    raw_keys = xs[_RAW_KEYS] if len(xs) > _RAW_KEYS and phi is None else None
    keys, log_decays, v = xs[_KEYS], xs[_LOG_DECAYS], xs[_VALUES]
    finite = chunking.all_finite(keys, raw_keys, v, log_decays=log_decays)
    first = functools.partial(_first_bad, time_axis, groups)
    t = keys.shape[time_axis]

    def clean(*args):  # first_index's shapes: the values' (or their tokens') with t -> 1
        shape = v.shape[:time_axis] + (1,) + v.shape[time_axis + 1 :]
        return jnp.full(shape, t, jnp.int32), jnp.full(shape[:3], t, jnp.int32)

    return finite, tuple(xs), *chunking.if_not(finite, first, clean, keys, raw_keys, v, log_decays)


def _first_bad(time_axis: int, groups: int, keys, raw_keys, v, log_decays):
    """``_finite_inputs``' indices: ``(first spoilt value channel, first bad token)``."""
    ok = chunking.finite_tokens(keys, raw_keys)
    if groups > 1:  # grouped keys: a bad key poisons each of its value heads
        ok = jnp.repeat(ok, groups, axis=3 - time_axis)
    if log_decays is not None:
        ok = ok & chunking.finite_tokens(log_decays=log_decays)
    good_v = ok[..., None] & jnp.isfinite(v)
    return chunking.first_index(~good_v, time_axis), chunking.first_index(~ok, time_axis)


def _denominator(scores, q_in, z):
    """``phi(q_i)^T Z_i`` of a chunk's queries, ``[b, h, c]``."""
    return jnp.sum(scores, axis=-1) + jnp.einsum("bhif,bhf->bhi", q_in, z)


def group_body_bwd(
    d_final,
    inputs,
    *,
    c: int,
    diagonal: bool,
    kernel=None,
    dtype=None,
    eps=None,
    phi=None,
    groups=1,
):
    """The transpose of ``group_body`` (``chunking.scan``'s ``body_bwd``), from the state
    entering the group: its chunks' scores and states are recomputed (batched, and the
    elementwise state scan), then transposed.

    Args:
      d_final: ``(dS [b,h,f,v], dZ [b,h,f] | None)``, the cotangent of the state after
        the group.
      inputs: ``((S, Z | None) entering the group, x, the group's outputs, their
        cotangents (d numerator [b,h,g,v], d denominator [b,h,g] | None))``; with
        ``eps`` the output and its cotangent are the normalised output's.
      c, diagonal, kernel, dtype, eps, phi, groups: as in ``group_body``.

    Returns:
      ``((dS, dZ | None) before the group, d x)``.
    """
    state, raw, (out, _), (d_num, d_den) = inputs
    h = raw[0].shape[1]
    x = _fold(raw, c, h)
    good_v = _good_values(x, _raw_keys(kernel, phi))
    v = _values(x, phi, good_v)
    parts, vjp = jax.vjp(
        functools.partial(
            chunk_parts, diagonal, kernel, dtype=dtype, phi=phi, groups=groups, heads=h
        ),
        _without_values(x),
    )
    scores, q_in, k_out, across = parts
    (s, z), _ = _states(h, across, _writes(parts, v, state[1] is not None), state)
    d_num, out = (chunking.fold(y, c, h) for y in (d_num, out))
    if d_den is not None:
        d_den = chunking.fold(d_den, c, h)
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    if eps is not None:  # out = num / (den + eps): the denominator's share of d out
        den = divisor(_denominator(scores, q_in, z), eps)
        d_den = -jnp.sum(d_num * out, axis=-1) / den
        d_num = d_num / den[..., None]
    # What each chunk's outputs send back to the state entering it; then the state's
    # scan transposed gives the cotangent of the state after each chunk.
    into = (mixed("bmif,bmiv->bmfv", q_in, d_num), None)
    if z is not None:
        into = (into[0], jnp.einsum("bmif,bmi->bmf", q_in, d_den))
    (d_s, d_z), d_state = _states_bwd(h, across, into, d_final)
    # With a denominator, dScores (d_num v^T + d_den) and d(phi(q)) (d_num S^T + d_den Z)
    # are sums that cancel where an output is near its values' mean: float32 operands
    # (bfloat16 ones doubled the error of q's gradient).
    cancels = mixed if z is None else jnp.einsum
    d_scores = cancels("bmiv,bmjv->bmij", d_num, v)
    d_v = mixed("bmij,bmiv->bmjv", scores, d_num) + mixed("bmjf,bmfv->bmjv", k_out, d_s)
    d_q_in = cancels("bmiv,bmfv->bmif", d_num, s)
    d_k_out = mixed("bmjv,bmfv->bmjf", v, d_s)
    d_across = None if across is None else _reduce_to(d_s * s, across.shape)
    if z is not None:
        d_scores = d_scores + d_den[..., None]
        d_q_in = d_q_in + d_den[..., None] * z[:, :, None]
        d_k_out = d_k_out + d_z[:, :, None]
        if across is not None:
            d_across = d_across + _reduce_to(d_z * z, across.shape)
    (d_x,) = vjp((d_scores, d_q_in, d_k_out, d_across))
    # The raw values' cotangent: none at a dead token or where _values zeroed them.
    d_v = chunking.where_finite(good_v, d_v)
    if phi is not None:
        d_v = _live(x[-1], d_v)
    d_x = d_x[:2] + (d_v,) + d_x[2:]
    return d_state, tuple(_unfold_like(d, y, h) for d, y in zip(d_x, raw, strict=True))


def _states_bwd(h: int, across, into, d_final):
    """The transpose of ``_states``: from ``d_final``, the cotangent of the state after
    the group, and ``into``, what each chunk's outputs send to the state entering it
    (``(Q_in^T dO [b,m,f,v], Q_in^T dDen [b,m,f] | None)``), ``(the cotangent of the state
    after each chunk, that of the state entering the group)``."""

    def step(carry, y):
        d_s, d_z = carry
        a, into_s, into_z = y
        d_prev = _decay(a, d_s) + into_s, None if d_z is None else _decay(a, d_z) + into_z
        return d_prev, (d_s, d_z)

    ys = jax.tree.map(functools.partial(chunking.chunk_major, h), (across, *into))
    d_state, d_after = jax.lax.scan(step, d_final, ys, reverse=True)
    return jax.tree.map(chunking.head_major, d_after), d_state


def _unfold_like(d, x, h: int):
    """The cotangent ``d`` of ``chunking.fold(x)`` unfolded to ``x``'s shape (summed over
    the heads that ``fold`` broadcast); a non-float input's (float0) as it came."""
    if d is None or x is None or d.dtype == jax.dtypes.float0:
        return d if x is None or d is None else np.zeros(x.shape, jax.dtypes.float0)
    d = chunking.unfold(d, h, x.shape[2])
    return jnp.sum(d, axis=1, keepdims=True) if x.shape[1] != d.shape[1] else d


def _values(x, phi, good: Array) -> Array:
    """A chunk's values: as given, or (with ``phi``: raw inputs) upcast and zeroed at
    the dead tokens of ``live``, x's last entry; zeros where ``good`` (``_good_values``)
    is False."""
    v = x[2] if phi is None else _live(x[-1], x[2])
    return chunking.where_finite(good, v)


def _raw_keys(kernel, phi) -> bool:
    """Whether a chunk's inputs carry raw keys for a ``kernel`` (``chunk_parts``' x[5])."""
    return kernel is not None and phi is None


def _ok_tokens(x, raw: bool) -> Array:
    """``[b, h, c]`` bool: the tokens of a chunk (``chunk_parts``' x, no values) whose
    keys (and raw keys) and log-decays are all finite."""
    return chunking.finite_tokens(x[1], x[_RAW_KEYS - 1] if raw else None, log_decays=x[2])


def _good_values(x, raw: bool) -> Array:
    """``[b, h, c, v]`` bool: the finite values of a chunk's tokens that count."""
    return _ok_tokens(_without_values(x), raw)[..., None] & jnp.isfinite(x[2])


def _finite_keys(x, raw: bool):
    """A chunk's inputs without values (``chunk_parts``' x) with the keys, log-decays (and
    with a ``kernel`` the raw keys) zeroed at a token where any is not finite: so a masked
    matmul never spreads ``0 * NaN`` to earlier tokens (the outputs from there on are
    ``run_chunks``' NaN). Inside the chunk, fused with the ops that read it."""
    x = list(x)
    ok = _ok_tokens(x, raw)
    for i in (1, 2) + ((_RAW_KEYS - 1,) if raw else ()):
        x[i] = chunking.where_finite(ok, x[i])
    return tuple(x)


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
    x = x.reshape(x.shape[: len(shape)] + (-1,))  # the sums as products (chunking.row_sums)
    if shape[-1] == 1:
        return chunking.row_sums(x.reshape(x.shape[:-2] + (-1,)))[..., None]
    return chunking.row_sums(x)
