"""The delta rule and Gated DeltaNet as a Pallas kernel: ``causal(..., method="pallas")``.

On GPU one kernel program per (batch and value head, block of value columns) walks that
head's chunks in order with its columns of the state ``S [dk, dv]`` in float32 in registers:
the state's columns evolve independently (``T``, ``W`` and the decays never read V), so the
value width splits over a second grid axis (``VALUE_BLOCK`` columns), at the price of each
block recomputing the chunk's ``[C, C]`` pieces. On TPU the grid is (batch and value head,
chunk): the chunk axis runs in order ("arbitrary") with the state in VMEM scratch between
its steps, so only one chunk's tiles sit in VMEM at a time (Pallas pipelines their copies),
whatever the length. Inside a chunk of C tokens both do what ``chunked.py`` does for every
chunk at once, the gated UT transform (one shared code, ``_Chunk`` and ``_chunk_grads``):

* the decays from the chunk's cumulative log-gates ``G`` and its runs between resets
  (``r``, the resets so far inside the chunk), masked before ``exp``;
* ``A = I + tril(diag(beta) (K K^T * D), -1)`` and its inverse ``T = A^{-1}`` by forward
  substitution, one row per step, on the ``[C, C]`` tile (row selections by iota masks,
  no dynamic indexing of values, so the same code lowers to Triton, Mosaic TPU and the
  interpreter);
* ``U = T diag(beta) V``, ``W = T diag(beta) (exp(G) * K)``, the writes ``U - W S``, the
  outputs ``O = (exp(G) * Q) S + (Q K^T * D) (U - W S)`` and the next state
  ``S' = exp(G_C) S + (exp(G_C - G) * K)^T (U - W S)``.

What stays in XLA around the kernel (``causal_chunks``): the non-finite screening of
``chunked.finite_inputs`` and ``chunking.nan_from`` (the kernel sees finite inputs only),
key masks (zeroed tokens, by the caller), padding to whole chunks (zero tokens are
inert), head grouping (q and k repeated to the value heads), and the gates' cumulative sums
per chunk and the reset runs, so that the kernel reads two ``[C, 1]`` columns per chunk.

Backends (``jax.lax.platform_dependent``): on GPU the Triton lowering of Pallas (the
kernel is plain array code: ``jnp.dot``, ``exp``, ``where``, reductions; Mosaic GPU's
warpgroup model would need a rewrite); on TPU Mosaic TPU; on CPU the Pallas interpreter of
the GPU kernels (``CPU_BACKEND``; ``"interpret-tpu"`` interprets the TPU ones; slow: for
tests, the XLA ``"chunked"`` form is the one to use there). Checked here by
the interpreter against the chunked form and by ``jax.export`` lowering for ``cuda`` and
``tpu``; not yet compiled or timed on a GPU or TPU (no device was lent). JAX 0.11
deprecates the Triton backend (it warns when lowering) for Mosaic GPU, the port to come.

The gradient (``jax.custom_vjp`` on the kernel): the forward kernel also writes the state
entering each chunk (``[n, dk, dv]`` per head: O((t / C) dk dv), never a state per token),
and a backward kernel walks the chunks from the last with the state's cotangent ``dS`` in
float32, recomputing each chunk's pieces (decays, ``T``, ``U``, ``W``) from its inputs and
stored state, then transposing the outputs, the state update, the two products with ``T``,
the inverse (``dL = -T^T dT T^T``, strictly lower), ``K K^T`` and ``Q K^T`` and the
decays (``dG`` from ``dD * D``, row sums minus column sums). The XLA wrapper's padding,
masking, cumulative sums and head repetition are differentiated by XLA. The cotangents
of q, k, beta and the gates gather over the value columns: each value block writes its
partial ones and XLA sums them (``[bh, nv, t, .]``, nv = dv / VALUE_BLOCK).

Numerics: every product is float32 (bfloat16 and float16 inputs are upcast first: unlike the
chunked form, no product reads bfloat16 operands), and there is no blocked substitution: the
inverse is formed row by row (C steps of ``O(C^2)`` each per chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from linattn_jax.ops import checks, chunking
from linattn_jax.ops.delta import chunked
from linattn_jax.ops.delta.state import repeat_heads
from linattn_jax.typing import Array

# The chunk sizes the kernel takes: Triton wants power-of-two tiles of at least 16 for its
# dots, Mosaic TPU multiples of 8 on the sublane axis.
CHUNK_SIZES = (16, 32, 64, 128)
# Value columns per kernel program on GPU (``value_block``): the state block [dk, 32] in
# float32 is 32 registers a thread at dk = 128 and 4 warps.
VALUE_BLOCK = 32
# What runs on CPU: the GPU kernels interpreted; "interpret-tpu": the TPU ones (tests).
CPU_BACKEND = "interpret"


def check_supported(*, chunk_size, gate_channels: int, dtype, dk: int, dv: int) -> int:
    """The chunk size ``method="pallas"`` runs with, or a ``ValueError`` naming the option
    it does not support."""
    if gate_channels > 1:
        raise ValueError(
            'method="pallas" supports a gate per head ([batch, length, heads]) or none, got '
            f"a gate per key channel (width {gate_channels}): use method='chunked' for KDA"
        )
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f'method="pallas" supports float32, bfloat16 and float16 q, got {dtype}')
    for name, d in (("key", dk), ("value", dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(
                f'method="pallas" needs a {name} head width that is a power of two >= 16, got {d}'
            )
    size = checks.default_chunk_size(chunk_size)
    if size not in CHUNK_SIZES:
        raise ValueError(f'method="pallas" needs chunk_size in {CHUNK_SIZES}, got {chunk_size}')
    return size


def causal_chunks(xs, state: Array, chunk_size: int, length: int, *, groups: int = 1):
    """``chunked.causal_chunks`` (same arguments and results, heads-first layout) by the
    Pallas kernels, forward and backward (see the module's docstring)."""
    return _causal(chunk_size, length, groups, xs, state)


def _causal(chunk_size, length, groups, xs, state):
    xs, first_v = chunked.finite_inputs(xs, groups)
    out, final = _run(xs, state, chunk_size, length, groups)
    out = chunking.nan_from(first_v, out, 2)
    return out, jnp.where(first_v < length, jnp.full((), jnp.nan, final.dtype), final)


def _run(xs, state: Array, c: int, length: int, groups: int):
    """The kernel on finite inputs: pads, folds the heads into the batch, and forms the
    per-chunk cumulative log-gates and reset runs."""
    q, k, v, beta, g, r = xs
    q, k = (repeat_heads(y, groups, 1) for y in (q, k))
    b, h, _, dk = q.shape
    dv = v.shape[-1]
    n = max(1, -(-length // c))
    pad = n * c - length
    dtype = state.dtype

    def padded(x, width):  # [b, h', t, width] -> [b, h, n*c, width], float32
        x = jnp.broadcast_to(x, (b, h, length, width)).astype(dtype)
        return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))

    q, k, v = padded(q, dk), padded(k, dk), padded(v, dv)
    beta = padded(beta[..., None], 1)
    zeros = jnp.zeros((b, h, n * c, 1), dtype)
    g = zeros if g is None else padded(g, 1)
    r = zeros if r is None else padded(r, 1)
    # A log-decay under reset_below is a reset (chunking.decays): never a huge cumulative sum.
    reset = g < chunking.reset_below(dtype)
    g = jnp.where(reset, 0.0, g)
    r = jnp.maximum(r, reset.astype(dtype))
    per_chunk = lambda x: jnp.cumsum(x.reshape(b, h, n, c, 1), axis=3).reshape(b, h, n * c, 1)
    g_cum, runs = per_chunk(g), per_chunk(r)
    flat = lambda x: x.reshape((b * h,) + x.shape[2:])
    ins = [flat(x) for x in (q, k, v, beta, g_cum, runs)] + [flat(state)]
    out, final = _chunks(c, *ins)
    out = out.reshape(b, h, n * c, dv)[:, :, :length]
    return out, final.reshape(b, h, dk, dv)


def _on_backend(call, *args, **options):
    """``call(*args, backend=..., **options)`` for the platform it runs on."""
    on = lambda backend: functools.partial(call, backend=backend, **options)
    return jax.lax.platform_dependent(
        *args, cpu=on(CPU_BACKEND), cuda=on("triton"), rocm=on("triton"), tpu=on("tpu")
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunks(c, q, k, v, beta, g_cum, runs, state):
    """The kernel over ``[b * h]`` heads of whole chunks: ``(out [bh, n*c, dv], final
    [bh, dk, dv])``; its gradient is the backward kernel."""
    return _on_backend(_forward_call, q, k, v, beta, g_cum, runs, state, c=c)[:2]


def _chunks_fwd(c, q, k, v, beta, g_cum, runs, state):
    out, final, states = _on_backend(_forward_call, q, k, v, beta, g_cum, runs, state, c=c)
    return (out, final), (q, k, v, beta, g_cum, runs, states)


def _chunks_bwd(c, residuals, cotangents):
    q, k, v, beta, g_cum, runs, states = residuals
    d_out, d_final = cotangents
    grads = _on_backend(_backward_call, q, k, v, beta, g_cum, runs, states, d_out, d_final, c=c)
    d_q, d_k, d_v, d_beta, d_g, d_state = grads
    return d_q, d_k, d_v, d_beta, d_g, jnp.zeros_like(runs), d_state


_chunks.defvjp(_chunks_fwd, _chunks_bwd)


def _options(backend: str) -> dict:
    if backend.startswith("interpret"):
        return {"interpret": True}
    if backend == "triton":
        from jax.experimental.pallas import triton as pl_triton

        return {"compiler_params": pl_triton.CompilerParams(num_warps=4, num_stages=1)}
    return {}


def value_block(dv: int) -> int:
    """The value columns one GPU kernel program carries (``VALUE_BLOCK``, at most ``dv``):
    the delta rule's state columns evolve independently (``T``, ``W`` and the decays do not
    read V), so the heads' value widths split over a second grid axis."""
    return min(dv, VALUE_BLOCK)


def _spec(*shape, partial: bool = False):
    """``[bh, *shape]`` cut per (head i, value block j): the head axis squeezed, block ``j``
    of width ``shape[-1]`` on the last axis; with ``partial``, ``[bh, nv, *shape]``: each
    value block's own partial result (summed after the kernel)."""
    if partial:
        return pl.BlockSpec((None, None, *shape), lambda i, j: (i, j) + (0,) * len(shape))
    return pl.BlockSpec((None, *shape), lambda i, j: (i,) + (0,) * (len(shape) - 1) + (j,))


def _whole(*shape):
    """``[bh, *shape]`` with every value block reading the head's whole block."""
    return pl.BlockSpec((None, *shape), lambda i, j: (i,) + (0,) * len(shape))


def _forward_call(q, k, v, beta, g_cum, runs, state, *, c: int, backend: str):
    """The forward ``pallas_call`` over (head, value block): ``(out [bh, n*c, dv], final
    [bh, dk, dv], the state entering each chunk [bh, n*dk, dv])``."""
    if backend in ("tpu", "interpret-tpu"):
        return _forward_chunk_grid(q, k, v, beta, g_cum, runs, state, c=c, backend=backend)
    bh, tokens, dk = q.shape
    dv, n = v.shape[-1], tokens // c
    bv = value_block(dv)
    shapes = [(tokens, dv), (dk, dv), (n * dk, dv)]
    keys = [_whole(*x.shape[1:]) for x in (q, k)]
    columns = [_whole(tokens, 1)] * 3
    return pl.pallas_call(
        functools.partial(_forward_kernel, c=c, n=n),
        grid=(bh, dv // bv),
        in_specs=[*keys, _spec(tokens, bv), *columns, _spec(dk, bv)],
        out_specs=[_spec(tokens, bv), _spec(dk, bv), _spec(n * dk, bv)],
        out_shape=[jax.ShapeDtypeStruct((bh, *shape), state.dtype) for shape in shapes],
        name="delta_rule_chunked_fwd",
        **_options(backend),
    )(q, k, v, beta, g_cum, runs, state)


def _backward_call(q, k, v, beta, g_cum, runs, states, d_out, d_final, *, c: int, backend: str):
    """The backward ``pallas_call`` over (head, value block): the cotangents of q, k, v,
    beta, the cumulative log-gates and the initial state (those of q, k, beta and the gates
    summed over the value blocks' partial ones)."""
    ins = (q, k, v, beta, g_cum, runs, states, d_out, d_final)
    if backend in ("tpu", "interpret-tpu"):
        return _backward_chunk_grid(*ins, c=c, backend=backend)
    bh, tokens, dk = q.shape
    dv, n = v.shape[-1], tokens // c
    bv = value_block(dv)
    nv = dv // bv
    partial = [(tokens, dk), (tokens, dk), (tokens, 1), (tokens, 1)]
    in_specs = [_whole(tokens, dk)] * 2 + [_spec(tokens, bv)] + [_whole(tokens, 1)] * 3
    in_specs += [_spec(n * dk, bv), _spec(tokens, bv), _spec(dk, bv)]
    out_shape = [jax.ShapeDtypeStruct((bh, nv, *shape), q.dtype) for shape in partial]
    out_shape += [jax.ShapeDtypeStruct((bh, tokens, dv), q.dtype)]
    out_shape += [jax.ShapeDtypeStruct((bh, dk, dv), q.dtype)]
    out_specs = [_spec(*shape, partial=True) for shape in partial]
    out_specs += [_spec(tokens, bv), _spec(dk, bv)]
    d_q, d_k, d_beta, d_g, d_v, d_state = pl.pallas_call(
        functools.partial(_backward_kernel, c=c, n=n, dk=dk),
        grid=(bh, nv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="delta_rule_chunked_bwd",
        **_options(backend),
    )(*ins)
    d_q, d_k, d_beta, d_g = (jnp.sum(x, axis=1) for x in (d_q, d_k, d_beta, d_g))
    return d_q, d_k, d_v, d_beta, d_g, d_state


def _per_chunk(rows: int, width: int, reverse: int | None = None):
    """``[bh, n*rows, width]`` cut per (head i, chunk j): block ``j`` of ``rows`` rows, or
    block ``reverse - 1 - j`` (the chunks from the last)."""
    if reverse is None:
        return pl.BlockSpec((None, rows, width), lambda i, j: (i, j, 0))
    return pl.BlockSpec((None, rows, width), lambda i, j: (i, reverse - 1 - j, 0))


def _per_head(*shape):
    """``[bh, *shape]``: the head's whole block at every chunk."""
    return pl.BlockSpec((None, *shape), lambda i, j: (i,) + (0,) * len(shape))


def _grid_options(backend: str) -> dict:
    if backend == "interpret-tpu":
        return {"interpret": True}
    from jax.experimental.pallas import tpu as pltpu

    semantics = ("parallel", "arbitrary")  # the chunks in order, the heads in any
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=semantics)}


def _scratch(dk: int, dv: int):
    from jax.experimental.pallas import tpu as pltpu

    return [pltpu.VMEM((dk, dv), jnp.float32)]


def _forward_chunk_grid(q, k, v, beta, g_cum, runs, state, *, c: int, backend: str):
    """``_forward_call`` on a (head, chunk) grid (TPU): one chunk's tiles in VMEM at a
    time, not the head's whole sequence."""
    bh, tokens, dk = q.shape
    dv, n = v.shape[-1], tokens // c
    in_specs = [_per_chunk(c, w) for w in (dk, dk, dv, 1, 1, 1)] + [_per_head(dk, dv)]
    out_specs = [_per_chunk(c, dv), _per_head(dk, dv), _per_chunk(dk, dv)]
    shapes = [(tokens, dv), (dk, dv), (n * dk, dv)]
    return pl.pallas_call(
        functools.partial(_forward_chunk_kernel, c=c, n=n),
        grid=(bh, n),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((bh, *shape), state.dtype) for shape in shapes],
        scratch_shapes=_scratch(dk, dv),
        name="delta_rule_chunked_fwd",
        **_grid_options(backend),
    )(q, k, v, beta, g_cum, runs, state)


def _backward_chunk_grid(q, k, v, beta, g_cum, runs, states, d_out, d_final, *, c, backend):
    """``_backward_call`` on a (head, chunk) grid (TPU), the chunks from the last."""
    bh, tokens, dk = q.shape
    dv, n = v.shape[-1], tokens // c
    chunks = [_per_chunk(c, w, n) for w in (dk, dk, dv, 1, 1, 1)]
    in_specs = chunks + [_per_chunk(dk, dv, n), _per_chunk(c, dv, n), _per_head(dk, dv)]
    out_specs = [_per_chunk(c, w, n) for w in (dk, dk, dv, 1, 1)] + [_per_head(dk, dv)]
    shapes = [(tokens, dk), (tokens, dk), (tokens, dv), (tokens, 1), (tokens, 1), (dk, dv)]
    d_q, d_k, d_v, d_beta, d_g, d_state = pl.pallas_call(
        functools.partial(_backward_chunk_kernel, c=c, n=n),
        grid=(bh, n),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((bh, *shape), q.dtype) for shape in shapes],
        scratch_shapes=_scratch(dk, dv),
        name="delta_rule_chunked_bwd",
        **_grid_options(backend),
    )(q, k, v, beta, g_cum, runs, states, d_out, d_final)
    return d_q, d_k, d_v, d_beta, d_g, d_state


def _dot(a, b, contract=(1, 0)):
    """``a @ b`` contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``, float32
    accumulation."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(a.dtype)


def _as_row(col: Array, eye: Array) -> Array:
    """A ``[c, 1]`` column as a ``[1, c]`` row (a masked reduction: no transpose of a
    vector, which not every Pallas backend lowers)."""
    return jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)


def _as_col(row: Array, eye: Array) -> Array:
    """A ``[1, c]`` row as a ``[c, 1]`` column (as ``_as_row``)."""
    return jnp.sum(jnp.where(eye, row, 0.0), axis=1, keepdims=True)


def _rowsum(x: Array) -> Array:
    return jnp.sum(x, axis=1, keepdims=True)


class _Chunk:
    """One chunk's pieces, from its inputs (``[c, .]`` tiles) and the state entering it."""

    def __init__(self, q, k, v, beta, g, run, s, *, c: int):
        rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
        self.eye = eye = rows == cols
        self.last = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
        g_row, run_row, beta_row = (_as_row(x, eye) for x in (g, run, beta))
        g_last = jnp.sum(jnp.where(self.last, g, 0.0), axis=0, keepdims=True)  # [1, 1]
        run_last = jnp.sum(jnp.where(self.last, run, 0.0), axis=0, keepdims=True)
        same = run == run_row  # [c, c]: tokens i and j in one run between resets
        # D[i, j] = exp(G_i - G_j) for j <= i in one run, 0 elsewhere: masked before exp.
        below = (rows >= cols) & same
        self.decay = jnp.where(below, jnp.exp(jnp.where(below, g - g_row, 0.0)), 0.0)
        self.strict = jnp.where(rows > cols, self.decay, 0.0)
        # The lower factor transposed, Lt[j, i] = L[i, j] = beta_i (k_i . k_j) D[i, j],
        # built directly (K K^T is symmetric), so that the substitution reads columns.
        above = (cols > rows) & same
        decay_t = jnp.where(above, jnp.exp(jnp.where(above, g_row - g, 0.0)), 0.0)
        self.kk = _dot(k, k, (1, 1))
        lower_t = self.kk * decay_t * beta_row

        # T = (I + L)^{-1} by forward substitution: T_i = e_i - sum_{j<i} L_ij T_j.
        def substitute(row, t):
            l_i = jnp.sum(jnp.where(cols == row, lower_t, 0.0), axis=1, keepdims=True)
            t_i = jnp.where(cols == row, 1.0, 0.0) - jnp.sum(l_i * t, axis=0, keepdims=True)
            return jnp.where(rows == row, t_i, t)

        self.inv = jax.lax.fori_loop(1, c, substitute, eye.astype(s.dtype))
        # Decays from the chunk's start, to its end, and across it ([c, 1], [c, 1], [1, 1]).
        self.into = jnp.where(run == 0.0, jnp.exp(g), 0.0)
        self.out_of = jnp.where(run == run_last, jnp.exp(g_last - g), 0.0)
        self.across = jnp.where(run_last == 0.0, jnp.exp(g_last), 0.0)
        self.w = _dot(self.inv, beta * self.into * k)
        # Each token's write, given the state entering the chunk.
        self.u = _dot(self.inv, beta * v) - _dot(self.w, s)
        self.qk = _dot(q, k, (1, 1))
        self.scores = self.qk * self.decay

    def out(self, q, s):
        return _dot(self.into * q, s) + _dot(self.scores, self.u)

    def next_state(self, k, s):
        return self.across * s + _dot(self.out_of * k, self.u, (0, 0))


def _forward_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, run_ref, s0_ref, *refs, c, n):
    o_ref, s_ref, states_ref = refs
    dk = s0_ref.shape[0]

    def chunk(i, s):
        at = pl.ds(pl.multiple_of(i * c, c), c)
        q, k = q_ref[at, :], k_ref[at, :]
        x = _Chunk(q, k, v_ref[at, :], beta_ref[at, :], g_ref[at, :], run_ref[at, :], s, c=c)
        states_ref[pl.ds(pl.multiple_of(i * dk, dk), dk), :] = s
        o_ref[at, :] = x.out(q, s)
        return x.next_state(k, s)

    s_ref[...] = jax.lax.fori_loop(0, n, chunk, s0_ref[...])


def _chunk_grads(q, k, v, beta, g, run, s, d_o, d_next, *, c: int):
    """One chunk's transpose: ``(d S entering it, (d q, d k, d v, d beta, d G))`` from the
    cotangents of its outputs ``d_o`` and of the state after it ``d_next``."""
    x = _Chunk(q, k, v, beta, g, run, s, c=c)
    q_in, k_out = x.into * q, x.out_of * k
    # The outputs and the next state, transposed.
    d_u = _dot(x.scores, d_o, (0, 0)) + _dot(k_out, d_next)
    d_scores = _dot(d_o, x.u, (1, 1))
    d_q_in = _dot(d_o, s, (1, 1))
    d_k_out = _dot(x.u, d_next, (1, 1))
    d_across = jnp.sum(jnp.sum(d_next * s, axis=1, keepdims=True), axis=0, keepdims=True)
    d_prev = x.across * d_next + _dot(q_in, d_o, (0, 0)) - _dot(x.w, d_u, (0, 0))
    d_w = -_dot(d_u, s, (1, 1))
    # U0 = T diag(beta) V and W = T diag(beta) (into * K), T = (I + L)^{-1}.
    b_v, b_k = beta * v, beta * x.into * k
    d_inv = _dot(d_u, b_v, (1, 1)) + _dot(d_w, b_k, (1, 1))
    d_bv, d_bk = _dot(x.inv, d_u, (0, 0)), _dot(x.inv, d_w, (0, 0))
    d_lower = -_dot(_dot(x.inv, d_inv, (0, 0)), x.inv, (1, 1))
    d_lower = jnp.where(x.strict != 0.0, d_lower, 0.0)  # L_ij = beta_i KK_ij D_ij, i > j
    d_kk = d_lower * beta * x.strict
    d_beta = _rowsum(d_lower * x.kk * x.strict)
    d_decay = d_lower * beta * x.kk + d_scores * x.qk
    d_qk = d_scores * x.decay
    d_q = _dot(d_qk, k) + x.into * d_q_in
    d_k = _dot(d_qk, q, (0, 0)) + _dot(d_kk, k) + _dot(d_kk, k, (0, 0))
    d_k = d_k + beta * x.into * d_bk + x.out_of * d_k_out
    d_beta = d_beta + _rowsum(d_bv * v) + _rowsum(d_bk * x.into * k)
    d_into = _rowsum(d_q_in * q) + _rowsum(d_bk * beta * k)
    d_out_of = _rowsum(d_k_out * k)
    # The decays are exp of differences of G: D_ij moves G_i up and G_j down.
    e = d_decay * x.decay
    d_g = _rowsum(e) - _as_col(jnp.sum(e, axis=0, keepdims=True), x.eye)
    d_g = d_g + d_into * x.into - d_out_of * x.out_of
    d_g_last = jnp.sum(d_out_of * x.out_of, axis=0, keepdims=True) + d_across * x.across
    d_g = d_g + jnp.where(x.last, d_g_last, 0.0)
    return d_prev, (d_q, d_k, beta * d_bv, d_beta, d_g)


def _backward_kernel(*refs, c, n, dk):
    q_ref, k_ref, v_ref, beta_ref, g_ref, run_ref, states_ref, do_ref, ds_ref = refs[:9]
    dq_ref, dk_ref, dbeta_ref, dg_ref, dv_ref, ds0_ref = refs[9:]

    def chunk(j, d_next):
        i = n - 1 - j
        at = pl.ds(pl.multiple_of(i * c, c), c)
        x = [ref[at, :] for ref in (q_ref, k_ref, v_ref, beta_ref, g_ref, run_ref)]
        s = states_ref[pl.ds(pl.multiple_of(i * dk, dk), dk), :]
        d_prev, grads = _chunk_grads(*x, s, do_ref[at, :], d_next, c=c)
        for ref, grad in zip((dq_ref, dk_ref, dv_ref, dbeta_ref, dg_ref), grads, strict=True):
            ref[at, :] = grad
        return d_prev

    ds0_ref[...] = jax.lax.fori_loop(0, n, chunk, ds_ref[...])


def _forward_chunk_kernel(*refs, c: int, n: int):
    """The forward on a (head, chunk) grid (TPU): the chunk axis runs in order and the
    state waits in VMEM scratch between its steps."""
    q_ref, k_ref, v_ref, beta_ref, g_ref, run_ref, s0_ref = refs[:7]
    o_ref, s_ref, states_ref, carry_ref = refs[7:]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        carry_ref[...] = s0_ref[...]

    s = carry_ref[...]
    q, k = q_ref[...], k_ref[...]
    x = _Chunk(q, k, v_ref[...], beta_ref[...], g_ref[...], run_ref[...], s, c=c)
    states_ref[...] = s
    o_ref[...] = x.out(q, s)
    carry_ref[...] = x.next_state(k, s)

    @pl.when(j == n - 1)
    def _():
        s_ref[...] = carry_ref[...]


def _backward_chunk_kernel(*refs, c: int, n: int):
    """The backward on a (head, chunk) grid (TPU), the chunks from the last (the index maps
    reverse them), ``dS`` waiting in VMEM scratch."""
    ins, outs, carry_ref = refs[:9], refs[9:15], refs[15]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        carry_ref[...] = ins[8][...]

    x = [ref[...] for ref in ins[:8]]
    d_prev, grads = _chunk_grads(*x, carry_ref[...], c=c)
    for ref, grad in zip(outs[:5], grads, strict=True):
        ref[...] = grad
    carry_ref[...] = d_prev

    @pl.when(j == n - 1)
    def _():
        outs[5][...] = carry_ref[...]
