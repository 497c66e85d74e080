"""The chunk engine under every family of recurrences: it knows no recurrence itself.

A family (``attention.py``, ``delta_rule.py``) writes the body of one chunk,
``body(state, x) -> (state, y)``; this module cuts the sequence into chunks,
scans the body across them, and gives the scan a memory-lean gradient: the
forward pass stores only the state entering each chunk, the backward pass
runs one chunk at a time in a reverse scan: the family's hand-written transpose
of the body (``body_bwd``) where it has one, else ``jax.vjp`` of the body (which
re-runs the chunk's forward). A gradient then costs O(t*d + (t/c) * state) extra
memory, not a state per token.

It also holds the decay bookkeeping inside a chunk that every family shares:
cumulative log-decays, the decay from key j to query i formed as a difference of
cumulative sums masked BEFORE ``exp`` (never ``exp(G_i) * exp(-G_j)``, which
overflows for strong decays), and the factors that carry the state across.

Mixed precision: for bfloat16 inputs the chunks' matmuls take their operands in
bfloat16 and accumulate in float32 (``einsum``, ``operand_dtype``); float16 inputs
read float32 operands (its range holds neither the scores nor the states); everything
elementwise (decays, their ``exp``, cumulative sums, states) stays float32.

Internal layout: heads first, ``[b, h, t, .]``; log-decays ``[b, h, t, g]`` with
``g`` 1 (per head) or the key width (per channel); resets ``[b, 1|h, t, 1|g]``.
``scan`` also reads and writes time-major arrays, ``[b, t, h, .]`` (``time_axis=1``),
moving only each chunk heads first: on CPU a whole-array transpose before and after
the scan costs more than the chunks' own small ones, which stay in cache.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax.typing import Array

Body = Callable[[Any, Any], tuple[Any, Any]]
BodyBwd = Callable[[Any, tuple[Any, Any, Any, Any]], tuple[Any, Any]]


def scan(
    body: Body,
    state: Any,
    xs: Any,
    chunk_size: int,
    length: int,
    body_bwd: BodyBwd | None = None,
    time_axis: int = 2,
) -> tuple[Any, Any]:
    """Runs ``body`` over chunks of ``xs`` with a memory-lean gradient.

    Args:
      body: ``(state, chunk) -> (state, y)``; ``chunk`` has the leaves of ``xs``
        cut to ``[b, h, c, ...]``, ``y`` is a pytree of ``[b, h, c, ...]`` arrays.
      state: the state before the first token (any pytree).
      xs: a pytree of ``[b, h, length, ...]`` arrays (None leaves allowed), or
        ``[b, length, h, ...]`` with ``time_axis=1``. The last chunk is padded with
        zeros: the bodies treat a zero token as inert (zero key, zero log-decay, no
        reset).
      chunk_size: tokens per chunk.
      length: the sequence length (the size of every leaf's token axis, ``time_axis``).
      body_bwd: optional hand-written transpose of ``body``, ``(d_state, (state, chunk,
        y, d_y)) -> (d_state before the chunk, d_chunk)``, given the state entering the
        chunk, the chunk's outputs ``y`` (kept from the forward pass) and the cotangents
        of the state after it and of ``y``; None: ``jax.vjp`` of ``body`` (which re-runs
        the chunk's forward in the reverse scan).
      time_axis: 2 (heads first) or 1 (time-major: ``xs`` and ``ys`` are
        ``[b, t, h, ...]``; ``body`` and ``body_bwd`` still see ``[b, h, c, ...]``).

    Returns:
      ``(ys with leaves [b, h, length, ...] (time_axis 2) or [b, length, h, ...]
      (time_axis 1), final state)``.
    """
    if time_axis not in (1, 2):
        raise ValueError(f"time_axis must be 1 or 2, got {time_axis}")
    c, n = chunk_count(chunk_size, length)
    widths = lambda x: [(0, n * c - length) if a == time_axis else (0, 0) for a in range(x.ndim)]
    if n * c != length:
        xs = jax.tree.map(lambda x: jnp.pad(x, widths(x)), xs)
    ys, state = _scan_chunks(body, body_bwd, c, time_axis, state, xs)
    return jax.tree.map(lambda y: jax.lax.slice_in_dim(y, 0, length, axis=time_axis), ys), state


def chunk_count(chunk_size: int, length: int) -> tuple[int, int]:
    """``(c, n)``: the tokens per chunk and the number of chunks ``scan`` runs over
    ``length`` tokens; ``n * c > length`` means the last chunk is padded. An empty
    sequence runs one inert padding token: the state passes through unchanged."""
    c = max(1, min(chunk_size, length))
    return c, max(1, -(-length // c))


# The chunks are read and written in place along the token axis (dynamic slices in
# the loop), not cut into a chunk-major [n, b, h, c, .] copy: on CPU those
# transposes of every input and output cost as much as the chunks' matmuls.


def _chunk(tree: Any, i: Array, c: int, axis: int) -> Any:
    """Chunk ``i`` (tokens ``i*c .. i*c + c - 1``) of every leaf, ``[b, h, c, ...]``."""

    def cut(x):
        x = jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=axis)
        return x if axis == 2 else jnp.swapaxes(x, 1, 2)

    return jax.tree.map(cut, tree)


def _put(tree: Any, chunk: Any, i: Array, c: int, axis: int) -> Any:
    """``tree`` with chunk ``i`` of every leaf replaced by ``chunk``'s ``[b, h, c, ...]``."""

    def put(x, y):
        y = y.astype(x.dtype) if axis == 2 else jnp.swapaxes(y, 1, 2).astype(x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(x, y, i * c, axis=axis)

    return jax.tree.map(put, tree, chunk)


def _full(chunk: Any, n: int, axis: int) -> Any:
    """Zeros shaped like ``n`` chunks of ``chunk``'s ``[b, h, c, ...]`` leaves, laid out
    with the tokens on ``axis``."""

    def full(y):
        b, h, c = y.shape[:3]
        lead = (b, h, n * c) if axis == 2 else (b, n * c, h)
        return jnp.zeros(lead + y.shape[3:], y.dtype)

    return jax.tree.map(full, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _scan_chunks(body, body_bwd, c, axis, state, xs):
    """``body`` over the chunks of ``c`` tokens of ``xs`` (``n*c`` tokens on ``axis``);
    its gradient is a reverse scan over the chunks from the states entering them
    (``body_bwd``, or ``jax.vjp`` of ``body``). Returns ``(ys, final state)``."""
    return _scan_chunks_fwd(body, body_bwd, c, axis, state, xs)[0]


def _scan_chunks_fwd(body, body_bwd, c, axis, state, xs):
    n = jax.tree.leaves(xs)[0].shape[axis] // c
    y_shape = jax.eval_shape(lambda s, x: body(s, x)[1], state, _chunk(xs, 0, c, axis))

    def step(carry, i):
        s, ys = carry
        s_next, y = body(s, _chunk(xs, i, c, axis))
        return (s_next, _put(ys, y, i, c, axis)), s

    carry = (state, _full(y_shape, n, axis))
    first = _peeled(n)
    if first:
        carry, _ = jax.lax.scan(step, carry, _FIRST)
    (final, ys), states = jax.lax.scan(step, carry, jnp.arange(first, n))
    # The outputs are the forward's own result: keeping them for body_bwd costs no pass.
    return (ys, final), (state, states, xs, None if body_bwd is None else ys)


def _peeled(n: int) -> int:
    """How many chunks (0 or 1) run before the loop, from the input state.

    A sequence of one or two chunks runs its first chunk apart, as a scan of one step
    (the loop's own program, which XLA runs without a loop): the state entering it is
    the input, not stored, and a zero initial state is a constant there that XLA folds
    away; a second chunk then makes a loop of one step, also dropped. That halves the
    state work of a two-chunk training sequence; for longer ones it would save a
    1/n share while compiling the chunk twice, so they keep one loop.
    """
    return 1 if n <= 2 else 0


_FIRST = np.zeros(1, np.int32)  # the chunk index of a one-step scan over the first chunk


def _scan_chunks_bwd(body, body_bwd, c, axis, residuals, cotangents):
    state, states, xs, ys = residuals
    d_ys, d_final = cotangents
    n = jax.tree.leaves(xs)[0].shape[axis] // c
    leaves, treedef = jax.tree.flatten(xs)
    # Only float inputs get a cotangent (a bool mask's is None: zero).
    floats = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
    float_inputs = [x for x, f in zip(leaves, floats, strict=True) if f]
    d_leaves, reads = _cotangent_buffers(float_inputs, (d_ys, ys))

    def step(carry, inputs):
        d_s, d_xs = carry
        i, s = inputs
        all_d_ys, all_ys = reads(d_xs)  # some read from the cotangents' buffers
        x, d_y = _chunk(xs, i, c, axis), _chunk(all_d_ys, i, c, axis)
        if body_bwd is not None:
            d_s, d_x = body_bwd(d_s, (s, x, _chunk(all_ys, i, c, axis), d_y))
        else:
            d_s, d_x = jax.vjp(body, s, x)[1]((d_s, d_y))
        d_x = [d for d, f in zip(jax.tree.leaves(d_x), floats, strict=True) if f]
        return (d_s, _put(d_xs, d_x, i, c, axis)), None

    first = _peeled(n)
    carry = (d_final, d_leaves)
    carry, _ = jax.lax.scan(step, carry, (jnp.arange(first, n), states), reverse=True)
    if first:  # the first chunk, from the input state
        carry, _ = jax.lax.scan(step, carry, (_FIRST, jax.tree.map(lambda x: x[None], state)))
    d_state, d_leaves = carry
    d_leaves = iter(d_leaves)
    d_xs = [next(d_leaves) if f else None for f in floats]
    return d_state, jax.tree.unflatten(treedef, d_xs)


_scan_chunks.defvjp(_scan_chunks_fwd, _scan_chunks_bwd)


def _cotangent_buffers(inputs: list, kept: Any) -> tuple[list, Callable]:
    """The buffers the reverse scan writes the cotangents of ``inputs`` into, and
    ``reads(buffers) -> kept``: ``kept`` (the outputs' cotangents and the kept outputs)
    with the leaves that lend a buffer read from it.

    Every chunk of a cotangent is written, so what its buffer holds before is never
    read. Where a kept array has an input's shape and dtype (the additive form's d out
    and output lend theirs to q and v when d == dv, d out to v otherwise), its buffer
    serves: the scan reads chunk i of it before writing chunk i of the cotangent there,
    and XLA updates it in place when nothing else reads it (else it copies it). The
    other inputs start from zeros: a fill on every call, or a copy where XLA merged two
    zero arrays into one. At t=16384 (b=1, h=8, d=64) this took the chunked gradient's
    scratch from 98 to 34 MiB and its time down by a sixth. The price: when only some
    inputs' cotangents are used, XLA can no longer drop the others' products, which
    write into a buffer the loop reads.
    """
    kept_leaves, kept_def = jax.tree.flatten(kept)
    reuse = {}  # input index -> kept leaf index
    for m, x in enumerate(inputs):
        for j, y in enumerate(kept_leaves):
            if j not in reuse.values() and (y.shape, y.dtype) == (x.shape, x.dtype):
                reuse[m] = j
                break
    buffers = [
        kept_leaves[reuse[m]] if m in reuse else jnp.zeros_like(x) for m, x in enumerate(inputs)
    ]

    def reads(buffers):
        leaves = list(kept_leaves)
        for m, j in reuse.items():
            leaves[j] = buffers[m]
        return jax.tree.unflatten(kept_def, leaves)

    return buffers, reads


def operand_dtype(dtype) -> jnp.dtype | None:
    """The dtype a chunk's matmuls read their operands in, for inputs of ``dtype``:
    bfloat16 stays itself (float32 accumulation), None for the others (no cast: float32
    and float64 run as they are, float16 reads float32 operands).

    The operands include what the chunk computed, not only the inputs: the ``[c, c]``
    scores and the state, which grow with the inputs' magnitudes and the sequence.
    bfloat16 has float32's range; float16 tops out at 65504, and a cast there turned
    scores or states of 1e5 into inf (NaN outputs of an SSD whose outputs peak at 3e3).
    """
    dtype = jnp.dtype(dtype)
    return dtype if dtype == jnp.dtype(jnp.bfloat16) else None


def einsum(subscripts: str, a: Array, b: Array, *, dtype=None) -> Array:
    """``jnp.einsum(subscripts, a, b)`` with both operands cast to ``dtype`` (None: no
    cast) and accumulated in their own (float32) dtype, via ``preferred_element_type``.

    The gradient's two products are mixed in the same way (autodiff would run them
    with float32 operands), and the cotangents come back in the operands' dtypes.
    Every index of ``a`` and ``b`` must appear in the other operand or the output.
    """
    if dtype is None:
        return jnp.einsum(subscripts, a, b)
    return _mixed_einsum(subscripts, jnp.dtype(dtype), a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mixed_einsum(subscripts, dtype, a, b):
    acc = jnp.result_type(a, b)
    return jnp.einsum(subscripts, a.astype(dtype), b.astype(dtype), preferred_element_type=acc)


def _mixed_einsum_fwd(subscripts, dtype, a, b):
    return _mixed_einsum(subscripts, dtype, a, b), (a, b)


def _mixed_einsum_bwd(subscripts, dtype, residuals, d_out):
    a, b = residuals
    ins, out = subscripts.split("->")
    sa, sb = ins.split(",")
    d_a = _mixed_einsum(f"{out},{sb}->{sa}", dtype, d_out, b).astype(a.dtype)
    d_b = _mixed_einsum(f"{sa},{out}->{sb}", dtype, a, d_out).astype(b.dtype)
    return d_a, d_b


_mixed_einsum.defvjp(_mixed_einsum_fwd, _mixed_einsum_bwd)


class Decays(NamedTuple):
    """The decay factors of one chunk, for log-decays ``g [b, h, c, g]`` and resets ``r``.

    ``G_i`` is the cumulative log-decay from the chunk's start to token i (inclusive).

    Attributes:
      log_cum: ``G [b, h, c, g]``.
      run: ``[b, 1|h, c, 1|g]`` the number of resets up to token i (0 when none).
      into: ``[b, h, c, g]`` the decay from the chunk's start to token i, ``exp(G_i)``,
        0 after a reset: what the incoming state contributes to token i.
      out_of: ``[b, h, c, g]`` the decay from token j to the chunk's end,
        ``exp(G_last - G_j)``, 0 before a later reset: how key j reaches the next state.
      across: ``[b, h, g]`` the decay across the whole chunk, ``exp(G_last)``, or 0.
    """

    log_cum: Array
    run: Array | None
    into: Array
    out_of: Array
    across: Array


def reset_below(dtype) -> float:
    """The log-decay under which a decay is a full reset: ``2 log(eps)`` of ``dtype``
    (-31.9 in float32, -72.1 in float64). What such a decay leaves of a state is below
    ``eps^2`` of it, under the rounding of the state itself, so a reset computes the same."""
    return 2.0 * float(np.log(np.finfo(dtype).eps))


def row_sums(x: Array) -> Array:
    """``x [..., n]`` summed over its last axis as a product with ones (see ``scaled``)."""
    return jnp.einsum("...n,n->...", x, jnp.ones((x.shape[-1],), x.dtype))


def scaled(x: Array, scale: Array) -> Array:
    """``x [..., n] * scale [..., 1|n]``. For one factor per row (``[..., 1]``) its
    gradient sums ``d x`` over the row as a product with ones: XLA:CPU's YNNPACK runs
    such row reductions (``jnp.sum``) an order of magnitude slower inside the chunk loop,
    which cost Gated DeltaNet a fifth of its forward+backward and the additive form with
    a decay a sixth (docs/benchmarks.md)."""
    return _scaled(x, scale) if scale.shape[-1] == 1 else x * scale


@jax.custom_vjp
def _scaled(x: Array, scale: Array) -> Array:
    return x * scale


def _scaled_fwd(x, scale):
    return x * scale, (x, scale)


def _scaled_bwd(residuals, d):
    x, scale = residuals
    d_scale = row_sums(d * x)[..., None]
    d_scale = jnp.sum(d_scale, axis=_broadcast_axes(d_scale.shape, scale.shape), keepdims=True)
    return (d * scale).astype(x.dtype), d_scale.reshape(scale.shape).astype(scale.dtype)


def _broadcast_axes(shape, like) -> tuple[int, ...]:
    """The axes along which ``like`` (of the same rank) was broadcast to ``shape``."""
    return tuple(i for i, (n, m) in enumerate(zip(shape, like, strict=True)) if m == 1 and n != 1)


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


def finite_tokens(*xs: Array | None, log_decays: Array | None = None) -> Array:
    """``[b, h|1, c]`` bool: the tokens whose entries are finite in every ``x [b, h|1, c, ...]``
    and, in ``log_decays``, not NaN or ``+inf`` (``-inf`` is a reset). None entries are
    skipped."""
    ok = None
    checked = [(x, jnp.isfinite) for x in xs] + [(log_decays, lambda g: g < jnp.inf)]
    for x, test in checked:
        if x is not None:
            good = jnp.all(test(x), axis=tuple(range(3, x.ndim)))
            ok = good if ok is None else ok & good
    return ok


def all_finite(*xs: Array | None, log_decays: Array | None = None) -> Array:
    """A scalar bool: every entry of every ``x`` finite and no log-decay NaN or ``+inf``
    (``finite_tokens`` over the whole call, reduced). One read-only pass: where it holds,
    a form skips its masking passes (``if_not``)."""
    ok = jnp.array(True)
    for x, test in [(x, jnp.isfinite) for x in xs] + [(log_decays, lambda g: g < jnp.inf)]:
        if x is not None:
            ok = ok & jnp.all(test(x))
    return ok


def if_not(ok: Array, fn: Callable[..., Any], clean: Callable[..., Any], *operands: Any) -> Any:
    """``clean(*operands)`` where the scalar ``ok`` holds, else ``fn(*operands)`` (a
    ``lax.cond``): the non-finite inputs' masks (``where_finite``, ``nan_from``) then cost
    nothing in a call whose inputs are all finite, forward and backward. Under ``vmap``
    with a batched ``ok`` both run (a select), with the same result."""
    return jax.lax.cond(ok, clean, fn, *operands)


def where_finite(ok: Array, x: Array | None) -> Array | None:
    """``x [b, h|1, c, ...]`` with zeros where ``ok`` (``[b, h|1, c]``, or ``x``'s shape)
    is False."""
    if x is None:
        return None
    mask = ok.reshape(ok.shape + (1,) * (x.ndim - ok.ndim))
    return jnp.where(mask, x, jnp.zeros((), x.dtype))


def first_index(bad: Array, axis: int) -> Array:
    """The index along ``axis`` of ``bad``'s first True (kept as a size-1 axis), or the
    axis' length where there is none: from there on, what a non-finite input reaches is
    NaN (``nan_from``). One reduction over the whole sequence, outside the chunk loop."""
    index = jax.lax.broadcasted_iota(jnp.int32, bad.shape, axis)
    length = bad.shape[axis]
    return jnp.min(jnp.where(bad, index, length), axis=axis, keepdims=True, initial=length)


def nan_from(first: Array, x: Array | None, axis: int) -> Array | None:
    """``x`` with NaN at and after index ``first`` along ``axis`` (``first_index``'s,
    broadcast from the left)."""
    if x is None:
        return None
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    first = first.reshape(first.shape + (1,) * (x.ndim - first.ndim))
    return jnp.where(index >= first, jnp.full((), jnp.nan, x.dtype), x)


def token_decays(g: Array | None, r: Array | None, shape: tuple[int, ...], dtype):
    """Each token's own decay ``a_i = exp(g_i)`` (0 at a reset; ``exp(-inf) = 0``) as
    ``[b, h, c, 1|g]``, or None: what the per-token (scan) forms multiply the state by."""
    if g is None and r is None:
        return None
    a = jnp.exp(g) if g is not None else jnp.ones(shape + (1,), dtype)
    return a if r is None else a * (1.0 - r)


def decays(g: Array | None, r: Array | None, shape: tuple[int, ...], dtype) -> Decays | None:
    """The chunk's ``Decays``, or None when it has neither log-decays nor resets.

    ``shape`` is ``[b, h, c]``: the shape of the per-head decays when ``g`` is None.
    A log-decay below ``reset_below(dtype)`` (``-inf`` included) zeroes the state: it
    becomes a reset here, with a log-decay of 0, so that no cumulative sum ever holds a
    huge value (float32 would absorb the later gates into it: ``-1e10 + -0.5 == -1e10``)
    or meets an infinity.
    """
    if g is None and r is None:
        return None
    if g is not None:
        reset = g < reset_below(g.dtype)
        g = jnp.where(reset, 0.0, g)
        reset = reset.astype(dtype)
        r = reset if r is None else jnp.maximum(r, reset)
    log_cum = jnp.zeros(shape + (1,), dtype) if g is None else chunk_cumsum(g)
    last = log_cum[:, :, -1:]
    into, out_of = jnp.exp(log_cum), jnp.exp(last - log_cum)  # both exponents <= 0
    run = None
    if r is not None:
        run = chunk_cumsum(r)
        into = jnp.where(run == 0, into, 0.0)
        out_of = jnp.where(run == run[:, :, -1:], out_of, 0.0)
    return Decays(log_cum, run, into, out_of, into[:, :, -1])


def chunk_cumsum(x: Array) -> Array:
    """``jnp.cumsum(x, axis=2)`` of a chunk ``x [b, h, c, ...]`` as one product with the
    ``[c, c]`` lower-triangular ones (float32 or wider: exact for the reset counts, the
    log-decays' rounding that of a sum in another order).

    On CPU XLA lowers ``cumsum`` to a tree of ``reduce_window`` ops whose pieces it fuses
    with what reads them (the decays' ``exp``) into kernels that LLVM compiles slowly:
    the two ``exp`` kernels of one Gated DeltaNet layer's decays took 1.3 s of its 5.5 s
    of kernel compilation (docs/benchmarks.md, "Compile time"); the product is a library
    call and leaves a plain ``exp``.

    Only for one channel (``[b, h, c]`` or ``[b, h, c, 1]``: per-head log-decays, reset
    counts). Per-channel inputs ``[b, h, c, f > 1]`` keep ``jnp.cumsum``: there the product
    and its layout changes cost more than they save at run time (GLA's forward+backward
    25% slower, KDA's 15%: docs/benchmarks.md, "Per-channel cumulative sums").
    """
    if math.prod(x.shape[3:]) > 1:
        return jnp.cumsum(x, axis=2)
    c = x.shape[2]
    lower = jnp.tril(jnp.ones((c, c), x.dtype))
    return jnp.einsum("ij,bhj...->bhi...", lower, x, precision=jax.lax.Precision.HIGHEST)


def decayed_scores(a: Array, b: Array, dec: Decays | None, *, diagonal: bool, dtype=None) -> Array:
    """``P[i, j] = sum_f a_if b_jf exp(G_if - G_jf)`` for ``j <= i`` (``j < i`` without
    ``diagonal``) in the same run between resets; 0 elsewhere.

    Args:
      a: ``[b, h, c, f]`` (e.g. queries).
      b: ``[b, h, c, f]`` (e.g. keys).
      dec: the chunk's decays (per head: ``g = 1``; per channel: ``g = f``), or None.
      diagonal: whether ``P[i, i]`` is kept.
      dtype: the matmuls' operand dtype (``operand_dtype``; None: as given). The
        per-channel ``[c, c, f]`` relative decays are never cast: only the products of
        features (already decayed, between sub-chunks) are.

    Returns:
      ``[b, h, c, c]``.
    """
    c = a.shape[2]
    if dec is None or dec.log_cum.shape[-1] == 1:
        scores = einsum("bhif,bhjf->bhij", a, b, dtype=dtype)
        return decay_scores(scores, dec, diagonal=diagonal)
    g = dec.log_cum
    mask = jnp.tril(jnp.ones((1, 1, c, c), bool), 0 if diagonal else -1)
    if c > SUB_CHUNK and c % SUB_CHUNK == 0:
        return _per_channel_scores_in_sub_chunks(a, b, dec, diagonal, dtype)
    # Per-channel decays: the [c, c, f] relative decay is formed explicitly; no
    # factorisation exp(G_i) * exp(-G_j) is safe for strong gates.
    return jnp.einsum("bhif,bhjf,bhijf->bhij", a, b, jnp.exp(masked_diff(g, dec.run, mask)))


def decay_scores(scores: Array, dec: Decays | None, *, diagonal: bool) -> Array:
    """``scores [b, h, c, c]`` (any kernel of queries i and keys j) masked as in
    ``decayed_scores`` and times ``exp(G_i - G_j)`` for per-head decays (``g = 1``)."""
    c = scores.shape[-1]
    mask = jnp.tril(jnp.ones((1, 1, c, c), bool), 0 if diagonal else -1)
    if dec is None:
        return jnp.where(mask, scores, 0.0)
    if dec.log_cum.shape[-1] != 1:
        raise ValueError(f"decay_scores needs per-head decays, got {dec.log_cum.shape}")
    return scores * jnp.exp(masked_diff(dec.log_cum, dec.run, mask)[..., 0])


SUB_CHUNK = 16


def masked_diff(g: Array, run: Array | None, mask: Array) -> Array:
    """``G_i - G_j`` as ``[b, h, i, j, g]``, -inf where ``mask`` [.., i, j] is False or a
    reset lies between: the mask goes in BEFORE exp (for j > i the difference is positive)."""
    mask = mask[..., None]
    if run is not None:
        mask = mask & (run[:, :, :, None] == run[:, :, None, :])
    return jnp.where(mask, g[:, :, :, None] - g[:, :, None, :], -jnp.inf)


def _per_channel_scores_in_sub_chunks(
    a: Array, b: Array, dec: Decays, diagonal: bool, dtype=None
) -> Array:
    """``decayed_scores`` for per-channel decays, in sub-chunks of ``SUB_CHUNK`` tokens.

    Between sub-chunks the decay factors through the last token before query i's
    sub-chunk, ``r``: ``exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j)`` with
    ``j <= r < i``, so both factors are <= 1 and the block is a matmul. Only the
    diagonal blocks form the ``[s, s, f]`` relative decay explicitly.
    """
    bsz, h, c, f = a.shape
    s, n = SUB_CHUNK, c // SUB_CHUNK
    g, run = dec.log_cum, dec.run
    blocks = lambda x: x.reshape(x.shape[:2] + (n, s) + x.shape[3:])
    # Reference of sub-chunk I: the last token of sub-chunk I - 1 (none for I = 0).
    ref = jnp.concatenate([g[:, :, :1] * 0, g[:, :, s - 1 : -1 : s]], axis=2)  # [b, h, n, f]
    before = jnp.arange(c)[None, :] < (jnp.arange(n) * s)[:, None]  # [n, j]: j <= ref(I)
    log_q = blocks(g) - ref[:, :, :, None]  # [b, h, n, s, f], <= 0
    log_k = jnp.where(before[None, None, :, :, None], ref[:, :, :, None] - g[:, :, None], -jnp.inf)
    if run is not None:
        run_ref = jnp.concatenate([run[:, :, :1] * 0 - 1, run[:, :, s - 1 : -1 : s]], axis=2)
        log_q = jnp.where(blocks(run) == run_ref[:, :, :, None], log_q, -jnp.inf)
        log_k = jnp.where(run[:, :, None] == run_ref[:, :, :, None], log_k, -jnp.inf)
    q_t = blocks(a) * jnp.exp(log_q)
    k_t = b[:, :, None] * jnp.exp(log_k)  # [b, h, n, c, f]
    off = einsum("bhnif,bhnjf->bhnij", q_t, k_t, dtype=dtype)  # [b, h, n, s, c]
    # The diagonal blocks, [s, s, f] relative decays with sub-chunks folded into heads.
    fold = lambda x: blocks(x).reshape(bsz, h * n, s, f)
    run = None if run is None else fold(jnp.broadcast_to(run, g.shape))
    mask = jnp.tril(jnp.ones((1, 1, s, s), bool), 0 if diagonal else -1)
    decay = jnp.exp(masked_diff(fold(g), run, mask))
    # float32 whatever the inputs: a three-operand product, not a matmul, and the decays
    # stay exact.
    inside = jnp.einsum("bmif,bmjf,bmijf->bmij", fold(a), fold(b), decay)
    eye = jnp.eye(n, dtype=a.dtype)[None, None, :, None, :, None]
    inside = inside.reshape(bsz, h, n, s, 1, s) * eye  # placed on the block diagonal
    return (off.reshape(bsz, h, n, s, n, s) + inside).reshape(bsz, h, c, c)


# Chunk-parallel groups: a group of n chunks runs its chunk-local work as one batched
# pass, the chunks folded into the head axis (``[b, h * n, c, .]``, chunk i of head j at
# j * n + i: a free reshape of ``[b, h, n * c, .]``); only the state's recurrence then
# runs chunk by chunk, in a scan over ``chunk_major`` arrays.

# Tokens whose chunks run at once on GPU and TPU (all of a shorter sequence): their
# batched [c, c] pieces, O(GROUP_TOKENS * c) per batch row and head, are the transient
# peak. On CPU one chunk at a time (``GROUP_TOKENS_CPU``, rounded up to one chunk): the
# batched products run no faster there than one chunk's, and a chunk's pieces stay in
# cache (docs/benchmarks.md). Both are read when a form is traced (the benchmark's
# ``recurrences --cpu-groups`` sets the CPU one).
GROUP_TOKENS = 8192
GROUP_TOKENS_CPU = 1

# Where the chunked forms' CPU and GPU/TPU choices differ (chunk sizes, groups, the
# triangular solve), ``per_backend`` takes the backend JAX runs on (``jax.default_backend()``)
# while tracing: only that backend's form is traced, differentiated and lowered. True: every
# backend's form is traced and ``lax.platform_dependent`` keeps the one of the platform the
# program is lowered for, as lowering for another platform than the host's needs
# (``jax.export(..., platforms=("cuda",))`` on a CPU machine): ``choose_at_lowering()``.
CHOOSE_AT_LOWERING = False


def per_backend(*args, cpu: Callable, default: Callable):
    """``cpu(*args)`` for a program that runs on CPU, ``default(*args)`` on GPU and TPU: for
    the backend JAX runs on (``jax.default_backend()``, read while tracing), or with
    ``CHOOSE_AT_LOWERING`` for the platform lowered for (``lax.platform_dependent``, which
    traces both)."""
    if CHOOSE_AT_LOWERING:
        return jax.lax.platform_dependent(*args, cpu=cpu, default=default)
    return (cpu if jax.default_backend() == "cpu" else default)(*args)


@contextlib.contextmanager
def choose_at_lowering():
    """Inside, the chunked forms hold every backend's form and the lowered platform's is
    kept (``CHOOSE_AT_LOWERING``): for ``jax.export`` or ``.lower(lowering_platforms=...)``
    to a platform other than the host's. JAX's caches are cleared on entry and exit, so no
    trace of the other setting is reused."""
    global CHOOSE_AT_LOWERING
    jax.clear_caches()
    CHOOSE_AT_LOWERING = True
    try:
        yield
    finally:
        CHOOSE_AT_LOWERING = False
        jax.clear_caches()


# A group's states (one per chunk, kept through its backward) are at most this many
# elements per batch row and head: 128 states of 64 x 64, GROUP_TOKENS at c = 64. Wide
# feature maps (Taylor's 1 + d + d^2) then run fewer chunks at once.
GROUP_STATE_ELEMENTS = 2**19


def chunks_per_group(c: int, n: int, group_tokens: int, state_size: int = 1) -> int:
    """How many of ``n`` chunks of ``c`` tokens a group holds: at most ``group_tokens //
    c`` and ``GROUP_STATE_ELEMENTS // state_size`` (at least one), spread evenly, so the
    last group is not mostly padding."""
    most = max(1, min(group_tokens // c, GROUP_STATE_ELEMENTS // state_size, n))
    groups = -(-n // most)
    return -(-n // groups)


def fold(x: Array | None, c: int, h: int) -> Array | None:
    """``[b, h|1, g, ...]`` -> ``[b, h * n, c, ...]``: a group's chunks folded into the
    head axis (one head broadcast to ``h``; the last chunk padded with zeros)."""
    if x is None:
        return None
    b, length = x.shape[0], x.shape[2]
    n = -(-length // c)
    x = jnp.broadcast_to(x, (b, h) + x.shape[2:])
    x = jnp.pad(x, [(0, 0), (0, 0), (0, n * c - length)] + [(0, 0)] * (x.ndim - 3))
    return x.reshape((b, h * n, c) + x.shape[3:])


def unfold(x: Array | None, h: int, length: int) -> Array | None:
    """``[b, h * n, c, ...]`` -> ``[b, h, length, ...]`` (the inverse of ``fold``)."""
    if x is None:
        return None
    b, m, c = x.shape[:3]
    return x.reshape((b, h, m // h * c) + x.shape[3:])[:, :, :length]


def chunk_major(h: int, x: Array | None) -> Array | None:
    """``[b, h * n, ...]`` -> ``[n, b, h, ...]``: the chunks as a scan's leading axis."""
    if x is None:
        return None
    b, m = x.shape[:2]
    return jnp.moveaxis(x.reshape((b, h, m // h) + x.shape[2:]), 2, 0)


def head_major(x: Array | None) -> Array | None:
    """``[n, b, h, ...]`` -> ``[b, h * n, ...]`` (the inverse of ``chunk_major``)."""
    if x is None:
        return None
    n, b, h = x.shape[:3]
    return jnp.moveaxis(x, 0, 2).reshape((b, h * n) + x.shape[3:])


def log_join(log_a: Array, a: tuple, log_b: Array, b: tuple) -> tuple[Array, tuple]:
    """``exp(log_a) a + exp(log_b) b`` for tuples of arrays ``a``, ``b``, stabilised:
    ``(m = max(log_a, log_b), the sums divided by exp(m))``, the weights broadcast from the
    left (the sequence-parallel forms' join of two stabilised states)."""
    m = jnp.maximum(log_a, log_b)
    grow = lambda w, x: w.reshape(w.shape + (1,) * (x.ndim - w.ndim))
    wa, wb = jnp.exp(log_a - m), jnp.exp(log_b - m)
    return m, tuple(grow(wa, x) * x + grow(wb, y) * y for x, y in zip(a, b, strict=True))
