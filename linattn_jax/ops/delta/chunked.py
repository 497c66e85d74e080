"""The delta rule's chunked form: the (gated) UT transform, chunk-parallel.

Inside a chunk of C tokens, with ``A = I + tril(diag(beta) (K K^T * D), -1)`` (D the decay
from key j to key i), ``[U | W] = A^{-1} diag(beta) [V | exp(G) * K]`` by a float32
triangular solve; then ``O = exp(G) * Q S + (Q K^T * D) (U - W S)`` and ``S_next =
exp(G_C) * S + (exp(G_C - G) * K)^T (U - W S)``.

Everything but the state runs for many chunks at once (as FLA's kernels and MaxText's
``jax_chunk_gated_delta_rule`` do): ``chunk_parts`` forms each chunk's scores, decays,
triangular solve, U and W, and its transition in state space, ``S_next = a S - M S + B``
with ``M = K_out^T W [dk, dk]`` and ``B = K_out^T U [dk, dv]``, batched over a group of
chunks; a ``lax.scan`` then carries only S through the group (one ``[dk, dk] x [dk, dv]``
product per chunk), and the outputs of all its chunks follow, batched, from the states
entering them (``chunk_outputs``). On GPU and TPU a group is ``chunking.GROUP_TOKENS`` tokens
(every chunk of a shorter sequence), so the chunk-local work is a few large batched
products, not one chunk's small ones at a time; on CPU a group is one chunk (measured:
batching gains nothing there and costs cache, docs/benchmarks.md), and a group of one chunk
updates its state directly, ``S_next = a S + K_out^T (U - W S)`` (``chunk_body``): the
write ``U - W S`` is the outputs' own, and ``M``, ``B`` and ``M S`` would cost more than
all the chunk's other products at C = 32 < dk.

Memory and recompute: ``linattn_jax.ops.chunking.scan`` stores the state entering each
group; the backward (``group_body_bwd``, hand-written) recomputes the group's
``chunk_parts`` and its states (one batched pass and the cheap state scan) rather than
store them, then runs the transposes of the outputs (batched), a reverse scan of the
transposed transition, and ``jax.vjp`` of ``chunk_parts`` (batched). What is kept between
the passes is O(t (dk + dv) + (t / C) dk dv), never a state per token; the transient peak
is one group's ``[C, C]`` pieces, O(group C) per head.

References:
  Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
  Length" (https://arxiv.org/abs/2406.06484).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from linattn_jax.ops import checks, chunking
from linattn_jax.ops.delta.state import repeat_heads
from linattn_jax.typing import Array


def causal_chunks(
    xs,
    state: Array,
    chunk_size: int | None,
    length: int,
    *,
    groups: int = 1,
    dtype=None,
    group_tokens: int | None = None,
    time_axis: int = 2,
):
    """The delta rule over chunks, heads first (``time_axis=2``) or time-major
    (``time_axis=1``: every ``[b, h, t, .]`` below is ``[b, t, h, .]``, in and out, and the
    chunks are moved heads first one at a time inside the loop, not the whole sequence).

    The chunks run ``group_tokens // chunk_size`` at a time (all of them when the
    sequence is shorter): ``linattn_jax.ops.chunking.scan`` carries the state across
    groups and stores it at each group's start; inside a group every chunk's local work
    is one batched pass, and a scan of one small product per chunk carries the state
    through it. The group sets the memory: the batched ``[C, C]`` pieces of one group
    (O(group_tokens C) per head) are the transient peak, forward and backward.

    Args:
      xs: ``(q [b,h,t,dk], k [b,h,t,dk], v [b,hv,t,dv], beta [b,hv,t], log-decay
        [b,hv,t,1|dk] | None, segment resets [b,1,t,1] | None)``.
      state: ``S [b, hv, dk, dv]`` before the first token.
      chunk_size: tokens per chunk (the last one is padded with inert zeros); None:
        ``checks.default_chunk_size`` for the backend (``chunking.per_backend``).
      length: ``t``.
      groups: ``hv // h``, the value heads that read each q and k head (repeated one
        group of chunks at a time, never over the whole sequence).
      dtype: the operand dtype of the products that make the output only
        (``chunking.operand_dtype``; None: no cast).
      group_tokens: tokens whose chunks run at once (at least one chunk); None: one
        chunk on CPU, ``chunking.GROUP_TOKENS`` on GPU and TPU (``chunking.per_backend``).
      time_axis: the token axis of ``xs`` and of the output, 2 or 1.

    Returns:
      ``(out [b, hv, t, dv], state after the last token)``.
    """
    if group_tokens is None or chunk_size is None:
        run = functools.partial(
            causal_chunks, length=length, groups=groups, dtype=dtype, time_axis=time_axis
        )

        def on(backend):  # the chunk size and group of each backend where not given
            size = checks.default_chunk_size(chunk_size, xs[4], on_cpu=backend == "cpu")
            if group_tokens is not None:
                return functools.partial(run, chunk_size=size, group_tokens=group_tokens)
            cpu = backend == "cpu"
            group = chunking.GROUP_TOKENS_CPU if cpu else chunking.GROUP_TOKENS
            return functools.partial(run, chunk_size=size, group_tokens=group)

        return chunking.per_backend(xs, state, cpu=on("cpu"), default=on("default"))
    c, n = chunking.chunk_count(chunk_size, length)
    per_group = chunking.chunks_per_group(c, n, group_tokens, math.prod(state.shape[2:]))
    options = dict(c=c, groups=groups, dtype=dtype)
    # One chunk per group (CPU): its state update directly, no transition in state space.
    one = per_group == 1
    body = functools.partial(chunk_body if one else group_body, **options)
    body_bwd = functools.partial(chunk_body_bwd if one else group_body_bwd, **options)
    xs, first_v = finite_inputs(xs, groups, time_axis)
    out, final = chunking.scan(
        body, state, xs, per_group * c, length, body_bwd=body_bwd, time_axis=time_axis
    )
    # What a non-finite input reaches is NaN from its token on, as in the per-token
    # recurrence: the outputs (a value channel, or all of them), the final state's columns.
    out = chunking.nan_from(first_v, out, time_axis)
    spoilt = first_v if time_axis == 2 else jnp.swapaxes(first_v, 1, 2)  # [b, hv, 1, dv]
    return out, jnp.where(spoilt < length, jnp.full((), jnp.nan, final.dtype), final)


def finite_inputs(xs, groups: int, time_axis: int = 2):
    """Once per call, over the whole sequence (the chunk loop then never meets a
    non-finite input): ``(xs with non-finite keys, values, betas and gates zeroed, the
    index of the first token whose value channel is spoilt [b, hv, 1, dv] (time-major
    ``[b, 1, hv, dv]``), the length where none is)``. Zeros keep the masked products and
    the solve from spreading ``0 * NaN`` to earlier tokens; every output from a bad token
    on (a bad key, beta or gate), or one value channel from a non-finite value on (the
    value channels never mix), is then set to NaN."""
    q, k, v, beta, g, r = xs
    ok_k = chunking.finite_tokens(k)
    k = chunking.where_finite(ok_k, k)
    ok = chunking.finite_tokens(beta, log_decays=g) & repeat_heads(ok_k, groups, 3 - time_axis)
    beta, g = (chunking.where_finite(ok, y) for y in (beta, g))
    good_v = ok[..., None] & jnp.isfinite(v)
    v = chunking.where_finite(good_v, v)
    return (q, k, v, beta, g, r), chunking.first_index(~good_v, time_axis)


def _group_parts(x, *, c: int, groups: int, dtype=None):
    """``chunk_parts`` of one group of tokens ``x`` (``causal_chunks``' xs cut to ``[b, h,
    g, .]``), its chunks folded into the head axis, the last one padded with zeros."""
    q, k, v, beta, g, r = x
    q, k = (repeat_heads(y, groups, 1) for y in (q, k))
    h = v.shape[1]
    return chunk_parts(tuple(chunking.fold(y, c, h) for y in (q, k, v, beta, g, r)), dtype=dtype)


def group_body(s: Array, x, *, c: int, groups: int, dtype=None) -> tuple[Array, Array]:
    """One group of chunks (``chunking.scan``'s body): ``(state after it, out [b, hv, g,
    dv])``, for ``s [b, hv, dk, dv]`` and ``x`` as ``causal_chunks``' xs cut to the group."""
    transition, reads = _group_parts(x, c=c, groups=groups, dtype=dtype)
    h, length = s.shape[1], x[2].shape[2]
    states, final = _states(h, transition, s)
    out, _ = chunk_outputs(reads, states, dtype=dtype)
    return final, chunking.unfold(out, h, length)


def chunk_parts(x, *, dtype=None):
    """Every chunk's local pieces, chunks folded into the head axis (``m = h * n``).

    Args:
      x: ``(q [b,m,c,dk], k [b,m,c,dk], v [b,m,c,dv], beta [b,m,c], log-decay
        [b,m,c,1|dk] | None, segment resets [b,m,c,1] | None)``.
      dtype: as in ``causal_chunks`` (the scores ``Q K^T`` only).

    Returns:
      ``((a [b,m,1|dk] | None, M [b,m,dk,dk], B [b,m,dk,dv]), (Q_in [b,m,c,dk], scores
      [b,m,c,c], W [b,m,c,dk], U [b,m,c,dv]))``: the transition ``S_next = a S - M S + B``
      and what the outputs read. The inputs are finite (``finite_inputs``).
    """
    q, k, v, beta, g, r = x
    dec = chunking.decays(g, r, q.shape[:3], q.dtype)
    qk = chunking.decayed_scores(q, k, dec, diagonal=True, dtype=dtype)
    kk = chunking.decayed_scores(k, k, dec, diagonal=False)  # float32: it feeds the solve
    across, q_in, k_out, u, w = _ut_transform(q, k, v, beta, kk, dec)
    # The transition in state space: float32 operands (it is what the state keeps).
    m = jnp.einsum("bmck,bmcl->bmkl", k_out, w)
    b_ = jnp.einsum("bmck,bmcv->bmkv", k_out, u)
    return (across, m, b_), (q_in, qk, w, u)


def chunk_outputs(reads, states: Array, *, dtype=None):
    """``O = Q_in S + scores (U - W S)`` of every chunk from the state entering it.

    Args:
      reads: ``(Q_in, scores, W, U)`` of ``chunk_parts``, ``[b, m, c, .]``.
      states: ``[b, m, dk, dv]``, the state entering each chunk.
      dtype: the operand dtype of the two products that read the state and U.

    Returns:
      ``(out [b, m, c, dv], U - W S)``.
    """
    q_in, qk, w, u = reads
    # Each token's write, given the state: float32 operands (it reaches the next state).
    u = u - jnp.einsum("bmck,bmkv->bmcv", w, states)
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    out = mixed("bmck,bmkv->bmcv", q_in, states) + mixed("bmij,bmjv->bmiv", qk, u)
    return out, u


def _decay(a: Array | None, s: Array) -> Array:
    """``a [..., 1|dk]`` (None: 1) times ``s [..., dk, dv]``."""
    return s if a is None else a[..., None] * s


def _states(h: int, transition, state: Array) -> tuple[Array, Array]:
    """The scan over chunks: ``(the state entering each chunk [b, h*n, dk, dv], the final
    state)``."""

    def step(s, x):
        a, m, b_ = x
        return _decay(a, s) - jnp.einsum("bhkl,bhlv->bhkv", m, s) + b_, s

    xs = jax.tree.map(functools.partial(chunking.chunk_major, h), transition)
    final, states = jax.lax.scan(step, state, xs)
    return chunking.head_major(states), final


def group_body_bwd(d_final: Array, inputs, *, c: int, groups: int, dtype=None):
    """The transpose of ``group_body`` (``chunking.scan``'s ``body_bwd``), from the state
    entering the group: its chunks' pieces and states are recomputed (batched, and one
    ``[dk, dk] x [dk, dv]`` product per chunk), then transposed.

    Args:
      d_final: ``[b, hv, dk, dv]``, the cotangent of the state after the group.
      inputs: ``(S entering the group, x, out, d out [b, hv, g, dv])``.

    Returns:
      ``(d S entering the group, d x)``.
    """
    s, x, _, d_out = inputs
    parts, vjp = jax.vjp(functools.partial(_group_parts, c=c, groups=groups, dtype=dtype), x)
    (across, m, _), (q_in, qk, w, _) = parts
    h = s.shape[1]
    states, _ = _states(h, parts[0], s)
    _, u = chunk_outputs(parts[1], states, dtype=dtype)
    d_out = chunking.fold(d_out, c, h)  # [b, m, c, dv], the last chunk padded with zeros
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    # The outputs' transpose, batched.
    d_u = mixed("bmij,bmiv->bmjv", qk, d_out)
    d_qk = mixed("bmiv,bmjv->bmij", d_out, u)
    d_q_in = mixed("bmiv,bmkv->bmik", d_out, states)
    d_w = -jnp.einsum("bmcv,bmkv->bmck", d_u, states)
    d_local = mixed("bmck,bmcv->bmkv", q_in, d_out) - jnp.einsum("bmck,bmcv->bmkv", w, d_u)

    # The transition's transpose, one chunk at a time from the last: d S_next -> d S.
    def step(d_s, y):
        a, m_i, d_local_i = y
        d_prev = _decay(a, d_s) - jnp.einsum("bhkl,bhkv->bhlv", m_i, d_s) + d_local_i
        return d_prev, d_s

    ys = jax.tree.map(functools.partial(chunking.chunk_major, h), (across, m, d_local))
    d_state, d_next = jax.lax.scan(step, d_final, ys, reverse=True)
    d_next = chunking.head_major(d_next)  # [b, m, dk, dv]: d of the state after each chunk
    d_m = -jnp.einsum("bmkv,bmlv->bmkl", d_next, states)
    d_across = None if across is None else _d_decay(across, d_next, states)
    (d_x,) = vjp(((d_across, d_m, d_next), (d_q_in, d_qk, d_w, d_u)))
    return d_state, d_x


def chunk_local(x, *, c: int, groups: int, dtype=None):
    """What one chunk's update and outputs read, besides the state: ``(across [b,hv,1|dk] |
    None, Q_in, K_out [b,hv,c,dk], scores [b,hv,c,c], W [b,hv,c,dk], U [b,hv,c,dv])`` for
    ``x`` as ``causal_chunks``' xs cut to one chunk (padded to ``c`` tokens)."""
    q, k, v, beta, g, r = x
    q, k = (repeat_heads(y, groups, 1) for y in (q, k))
    h = v.shape[1]
    q, k, v, beta, g, r = (chunking.fold(y, c, h) for y in (q, k, v, beta, g, r))
    dec = chunking.decays(g, r, q.shape[:3], q.dtype)
    if dec is None or dec.log_cum.shape[-1] != 1:
        qk = chunking.decayed_scores(q, k, dec, diagonal=True, dtype=dtype)
        kk = chunking.decayed_scores(k, k, dec, diagonal=False)
    else:  # per-head decays: one [c, c] decay serves both scores
        mask = jnp.tril(jnp.ones((1, 1, c, c), bool))
        decay = jnp.exp(chunking.masked_diff(dec.log_cum, dec.run, mask)[..., 0])
        qk = chunking.einsum("bhif,bhjf->bhij", q, k, dtype=dtype) * decay
        strict = jnp.tril(jnp.ones((c, c), bool), -1)
        kk = jnp.where(strict, jnp.einsum("bhif,bhjf->bhij", k, k) * decay, 0.0)
    across, q_in, k_out, u, w = _ut_transform(q, k, v, beta, kk, dec)
    return across, q_in, k_out, qk, w, u


def _ut_transform(q, k, v, beta, kk, dec):
    """A chunk's decayed queries and keys and its UT transform: ``(across | None, Q_in,
    K_out, U, W)`` with ``(I + diag(beta) KK) [U | W] = diag(beta) [V | K_in]``, in float32
    (the inputs are float32 here whatever the caller's dtype)."""
    if dec is None:
        q_in, k_in, k_out, across = q, k, k, None
    else:
        scaled = chunking.scaled
        q_in, k_in, k_out = scaled(q, dec.into), scaled(k, dec.into), scaled(k, dec.out_of)
        across = dec.across
    rhs = chunking.scaled(jnp.concatenate([v, k_in], axis=-1), beta[..., None])
    uw = unit_lower_solve(chunking.scaled(kk, beta[..., None]), rhs)
    dv = v.shape[-1]
    return across, q_in, k_out, uw[..., :dv], uw[..., dv:]


def _d_decay(a: Array, d_s: Array, s: Array) -> Array:
    """The cotangent of ``a [..., 1|dk]`` in ``_decay(a, s)``, given that of the product,
    ``d_s [..., dk, dv]`` (the sums as products with ones, ``chunking.row_sums``)."""
    prod = d_s * s
    if a.shape[-1] == 1:
        return chunking.row_sums(prod.reshape(prod.shape[:-2] + (-1,)))[..., None]
    return chunking.row_sums(prod)


def chunk_body(s: Array, x, *, c: int, groups: int, dtype=None) -> tuple[Array, Array]:
    """``group_body`` for a group of one chunk: ``S_next = a S + K_out^T (U - W S)``, the
    write ``U - W S`` shared with the outputs (no ``M = K_out^T W`` and ``M S``: with
    C < dk they cost more than the chunk's other products together, measured in
    docs/benchmarks.md)."""
    across, q_in, k_out, qk, w, u = chunk_local(x, c=c, groups=groups, dtype=dtype)
    out, u = chunk_outputs((q_in, qk, w, u), s, dtype=dtype)
    s_next = _decay(across, s) + jnp.einsum("bmck,bmcv->bmkv", k_out, u)
    return s_next, chunking.unfold(out, s.shape[1], x[2].shape[2])


def chunk_body_bwd(d_next: Array, inputs, *, c: int, groups: int, dtype=None):
    """The transpose of ``chunk_body`` (``chunking.scan``'s ``body_bwd``), recomputing the
    chunk's pieces from the state entering it: ``(d S entering, d x)`` for ``inputs =
    (S, x, out, d out [b, hv, c, dv])`` and ``d_next``, the cotangent of the state after."""
    s, x, _, d_out = inputs
    local, vjp = jax.vjp(functools.partial(chunk_local, c=c, groups=groups, dtype=dtype), x)
    across, q_in, k_out, qk, w, u = local
    u = u - jnp.einsum("bmck,bmkv->bmcv", w, s)
    d_out = chunking.fold(d_out, c, s.shape[1])
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    d_u = mixed("bmij,bmiv->bmjv", qk, d_out) + jnp.einsum("bmck,bmkv->bmcv", k_out, d_next)
    d_qk = mixed("bmiv,bmjv->bmij", d_out, u)
    d_q_in = mixed("bmiv,bmkv->bmik", d_out, s)
    d_k_out = jnp.einsum("bmcv,bmkv->bmck", u, d_next)
    d_w = -jnp.einsum("bmcv,bmkv->bmck", d_u, s)
    d_s = _decay(across, d_next) + mixed("bmck,bmcv->bmkv", q_in, d_out)
    d_s = d_s - jnp.einsum("bmck,bmcv->bmkv", w, d_u)
    d_across = None if across is None else _d_decay(across, d_next, s)
    (d_x,) = vjp((d_across, d_q_in, d_k_out, d_qk, d_w, d_u))
    return d_s, d_x


def unit_lower_solve(lower: Array, rhs: Array) -> Array:
    """``(I + lower)^{-1} rhs`` for strictly lower-triangular ``lower [..., c, c]``.

    Triangular substitution, backward stable whatever the system's conditioning (the
    nilpotent product series ``(I + N)(I + N^2)...`` cancels catastrophically when beta
    nears 2 with repeated keys: the system's entries are then +-2 all the way down).
    Which substitution, measured batched over all chunks (``python -m
    experiments.benchmark triangular``, docs/benchmarks.md): on CPU blocked forward
    substitution in plain ops with a hand-written gradient (``blocked_solve``), several
    times faster there than XLA's ``triangular_solve`` (a LAPACK call per system), than
    inverting and multiplying, and than the product series; on GPU and TPU XLA's
    ``triangular_solve`` (cuBLAS's batched trsm, the TPU's own), one op with no loop.
    """
    return chunking.per_backend(lower, rhs, cpu=blocked_solve, default=xla_solve)


def xla_solve(lower: Array, rhs: Array) -> Array:
    """``(I + lower)^{-1} rhs`` by XLA's ``triangular_solve`` (the GPU and TPU choice)."""
    # unit_diagonal: the (zero) diagonal of ``lower`` is neither read nor differentiated.
    return jax.lax.linalg.triangular_solve(
        lower, rhs, left_side=True, lower=True, unit_diagonal=True
    )


@jax.custom_vjp
def blocked_solve(lower: Array, rhs: Array) -> Array:
    """``(I + lower)^{-1} rhs`` by blocked forward substitution (``_substitution``)."""
    return _substitution(lower, rhs)


def _blocked_solve_fwd(lower, rhs):
    x = _substitution(lower, rhs)
    return x, (lower, x)


def _blocked_solve_bwd(residuals, d_x):
    # x = A^{-1} rhs: d rhs = A^{-T} d x (back substitution, as a forward one on the
    # reversed rows and columns) and d lower = -tril(d rhs x^T, -1). Autodiff through
    # the row loop would keep its carry at every row: 16 copies of the right-hand side.
    lower, x = residuals
    flip = lambda y: jnp.flip(y, axis=(-2, -1))
    d_rhs = jnp.flip(_substitution(flip(jnp.swapaxes(lower, -1, -2)), jnp.flip(d_x, -2)), -2)
    c = lower.shape[-1]
    below = jnp.tril(jnp.ones((c, c), bool), -1)
    d_lower = jnp.where(below, -jnp.einsum("...in,...jn->...ij", d_rhs, x), 0.0)
    return d_lower.astype(lower.dtype), d_rhs


blocked_solve.defvjp(_blocked_solve_fwd, _blocked_solve_bwd)


def _substitution(lower: Array, rhs: Array, block: int = 16) -> Array:
    """Forward substitution: over blocks of ``block`` rows by matmuls with the rows
    solved before, and row by row inside a block."""
    c = lower.shape[-1]
    solved = []  # blocks of solved rows, [..., rows, n]
    for start in range(0, c, block):
        stop = min(start + block, c)
        r = rhs[..., start:stop, :]
        if start:
            r = r - lower[..., start:stop, :start] @ jnp.concatenate(solved, axis=-2)
        solved.append(_substitute(lower[..., start:stop, start:stop], r))
    return jnp.concatenate(solved, axis=-2)


def _substitute(lower: Array, rhs: Array) -> Array:
    """``(I + lower)^{-1} rhs`` row by row (a loop of ``lower.shape[-1]`` steps)."""

    def row(i, x):  # x holds the rows solved so far, zeros after them
        lower_i = jax.lax.dynamic_index_in_dim(lower, i, axis=-2, keepdims=False)
        rhs_i = jax.lax.dynamic_index_in_dim(rhs, i, axis=-2, keepdims=False)
        x_i = rhs_i - jnp.einsum("...j,...jn->...n", lower_i, x)
        return jax.lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

    return jax.lax.fori_loop(0, lower.shape[-1], row, jnp.zeros_like(rhs))
