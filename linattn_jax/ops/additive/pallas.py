"""Pallas kernels for the additive rule's chunked form: ``causal(..., method="pallas")``.

One kernel program per (batch row, head) walks the chunks in order with a
``lax.fori_loop``, carrying the state ``S [f, v]`` (and ``Z [f]`` when a denominator or
the state is needed) in float32 (float64 for float64 inputs): for each chunk the masked
``[c, c]`` scores (per-head decays ``exp(G_i - G_j)``, or per-channel ones formed as a
``[c, c, f]`` relative decay masked before ``exp``), ``num = P V + Q_in S``, ``den =
rowsum P + Q_in Z``, and the update ``S <- a S + K_out^T V``. It writes the state
entering each chunk (O((t / c) f v) per head, as ``chunking.scan`` keeps per group),
which the backward kernel reads in a reverse loop: ``dS <- a dS + Q_in^T dNum``, and
every transposed product of the chunk.

What is elementwise and cheap stays in XLA around the kernels (``run``): the feature
map, padding and masks (``inputs.features``), the NaN-causality (``_finite_inputs``
before, ``chunking.nan_from`` after), the chunk's cumulative log-decays, resets and the
decay factors (``chunking.decays``), ``Q_in = phi(q) * into`` and ``K_out = phi(k) *
out_of``, and the division by the denominator; autodiff carries their gradients, and the
kernels' own ``jax.custom_vjp`` returns the cotangents of their inputs (the cumulative
log-decays' from the scores alone: ``dG = phi(q) dq - phi(k) dk`` of the intra-chunk
products).

Lowering: on GPU with Triton (``jax.experimental.pallas.triton``; deprecated in jax
0.11), on TPU with Mosaic TPU, on CPU in interpret mode (``lax.platform_dependent``).
Triton wants power-of-two product sides of at least 16: on every platform the chunk is
rounded up to one and the feature and value widths are padded with zeros (``_width``,
outside the kernels). For Mosaic TPU every array keeps its last two axes whole, so
per-token scalars travel as ``[T, 1]`` columns (and, per head, as ``[n, c]`` rows of each
chunk). Untuned: the per-channel scores form a ``[c, c, f]`` block per chunk in one
program (the XLA form splits it into sub-chunks of 16). Both lowerings are tested from CPU
(``jax.export``); no device has run or timed the kernels yet, so the XLA ``"chunked"`` form
stays the default.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from linattn_jax.ops import chunking
from linattn_jax.ops.additive.inputs import divisor
from linattn_jax.typing import Array


def run(
    phi_q: Array,
    phi_k: Array,
    v: Array,
    g: Array | None,
    resets: Array | None,
    state: tuple[Array, Array | None],
    chunk_size: int,
    *,
    eps: float | None,
):
    """The additive recurrence through the Pallas kernels, heads-first layout.

    Args:
      phi_q: query features ``[b, h, t, f]`` (float32 or float64; masked tokens zero).
      phi_k: key features ``[b, h, t, f]``.
      v: values ``[b, h, t, v]``.
      g: log-decays ``[b, h, t, 1|f]`` or None.
      resets: segment resets ``[b, 1, t, 1]`` or None.
      state: ``(S [b, h, f, v], Z [b, h, f] | None)`` before the first token.
      chunk_size: tokens per chunk.
      eps: None (return the numerator) or divide by ``denominator + eps`` (needs Z).

    Returns:
      ``(out [b, h, t, v], final (S, Z | None))``.
    """
    b, h, t, f = phi_q.shape
    dtype = phi_q.dtype
    phi_k, v, g, first_v, first = _finite_inputs(phi_k, v, g)
    # Triton's products want power-of-two sides of at least 16: the chunk is rounded up
    # (any chunk gives the same result) and the feature and value widths padded with zeros.
    c = _width(min(chunk_size, max(t, 1)))
    n = max(1, -(-t // c))
    fold = lambda x: chunking.fold(x, c, h)
    unfold = lambda x: chunking.unfold(x, h, n * c)
    dec = chunking.decays(fold(g), fold(resets), (b, h * n, c), dtype)
    per_channel = g is not None and g.shape[-1] != 1
    q, k, v = (fold(x) for x in (phi_q, phi_k, v))
    if dec is None:
        log_cum = jnp.zeros((b, h * n, c, 1), dtype)
        q_in, k_out, across, run_ = q, k, jnp.ones((b, h * n, 1), dtype), None
    else:
        log_cum, run_ = dec.log_cum, dec.run
        q_in, k_out, across = q * dec.into, k * dec.out_of, dec.across
    q, k, q_in, k_out, v, log_cum = (unfold(x) for x in (q, k, q_in, k_out, v, log_cum))
    g_width = log_cum.shape[-1]
    # Every kernel array keeps its last two axes whole (Mosaic TPU's tiling rule): per-token
    # scalars as [T, 1] columns, and per head also as [n, c] rows of each chunk; the decay
    # across each chunk as a column (for S) and a row (for Z).
    across = across.reshape(b, h, n, g_width)
    a_s, a_z = across[..., :, None], across[..., None, :]
    g_row = None if per_channel else log_cum.reshape(b, h, n, c)
    run_row = None
    if run_ is not None:  # per channel where a huge per-channel gate reset one channel
        run_ = unfold(jnp.broadcast_to(run_, (b, h * n, c, g_width)))
        run_row = None if per_channel else run_.reshape(b, h, n, c)
    s0, z0 = state
    z0 = None if z0 is None else z0[:, :, None, :]
    v_width = v.shape[-1]
    fp, vp = _width(f), _width(v_width)
    q, k, q_in, k_out, z0 = (_pad(x, -1, fp) for x in (q, k, q_in, k_out, z0))
    v, s0 = _pad(v, -1, vp), _pad(_pad(s0, -1, vp), -2, fp)
    if per_channel:  # padded channels: no decay, no reset (their state stays zero)
        log_cum, run_, a_z = (_pad(x, -1, fp) for x in (log_cum, run_, a_z))
        a_s = _pad(a_s, -2, fp)
    rows = (g_row, run_row)
    (num, den), (s, z) = _chunks(q, k, q_in, k_out, v, log_cum, a_s, a_z, s0, z0, run_, rows, c)
    num, s = num[..., :v_width], s[:, :, :f, :v_width]
    den = None if den is None else den[..., 0]
    z = None if z is None else z[:, :, 0, :f]
    num = num[:, :, :t]
    if den is not None:
        den = den[:, :, :t]
    num, den = chunking.nan_from(first_v, num, 2), chunking.nan_from(first, den, 2)
    s = jnp.where(first_v < t, jnp.full((), jnp.nan, s.dtype), s)
    if z is not None:
        z = jnp.where(first < t, jnp.full((), jnp.nan, z.dtype), z)
    if eps is not None:
        num = num / divisor(den, eps)[..., None]
    return num, (s, z)


def _finite_inputs(phi_k: Array, v: Array, g: Array | None):
    """Once per call: ``(phi_k, v, g)`` with their non-finite entries zeroed (a bad key or
    log-decay zeroes its token's key and log-decay, a bad value its entry; ``-inf`` log-decays
    are resets and stay), the index of the first spoilt value channel ``[b, h, 1, v]`` and
    that of the first bad token ``[b, h, 1]``, each ``t`` where there is none: the kernels
    never meet a non-finite input, and ``chunking.nan_from`` then sets what the per-token
    recurrence would make NaN (the chunked form's rule, ``docs/design.md``)."""
    ok = chunking.finite_tokens(phi_k, log_decays=g)
    phi_k, g = chunking.where_finite(ok, phi_k), chunking.where_finite(ok, g)
    good_v = ok[..., None] & jnp.isfinite(v)
    v = chunking.where_finite(good_v, v)
    return phi_k, v, g, chunking.first_index(~good_v, 2), chunking.first_index(~ok, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(12,))
def _chunks(q, k, q_in, k_out, v, log_cum, a_s, a_z, s0, z0, run_, rows, c):
    """The forward kernel: ``((num [b,h,T,v], den [b,h,T,1] | None), (S, Z [b,h,1,f] |
    None))``; ``rows`` are the per-head log-decays and runs as ``[b, h, n, c]`` rows (None
    per channel, or without resets), the same values as ``log_cum`` and ``run_``."""
    return _chunks_fwd(q, k, q_in, k_out, v, log_cum, a_s, a_z, s0, z0, run_, rows, c)[0]


def _options(c, n, log_cum, z, run_):
    return dict(
        c=c, n=n, per_channel=log_cum.shape[-1] != 1, with_z=z is not None,
        with_run=run_ is not None,
    )  # fmt: skip


def _chunks_fwd(q, k, q_in, k_out, v, log_cum, a_s, a_z, s0, z0, run_, rows, c):
    b, h, total, f = q.shape
    dv = v.shape[-1]
    n = total // c
    with_z = z0 is not None
    dtype = q.dtype
    g_row, run_row = rows
    ins = [q, k, q_in, k_out, v, log_cum, a_s, s0]
    ins += [] if z0 is None else [a_z, z0]
    ins += [] if g_row is None else [g_row]
    ins += [] if run_ is None else [run_] + ([] if run_row is None else [run_row])
    shape = lambda *s: jax.ShapeDtypeStruct((b, h) + s, dtype)
    outs = [shape(total, dv), shape(n, f, dv), shape(f, dv)]  # num, entering states, final
    if with_z:
        outs += [shape(total, 1), shape(n, 1, f), shape(1, f)]  # den, Z entering, final
    kernel = functools.partial(_fwd_kernel, **_options(c, n, log_cum, z0, run_))
    res = _call(kernel, ins, outs, (b, h))
    num, states, s = res[:3]
    den, z_states, z = res[3:] if with_z else (None, None, None)
    residuals = (q, k, q_in, k_out, v, log_cum, a_s, a_z, run_, rows, states, z_states)
    return ((num, den), (s, z)), residuals


def _chunks_bwd(c, residuals, cotangents):
    q, k, q_in, k_out, v, log_cum, a_s, a_z, run_, rows, states, z_states = residuals
    (d_num, d_den), (d_s, d_z) = cotangents
    b, h, total, f = q.shape
    n = total // c
    with_z = z_states is not None
    g_row, run_row = rows
    ins = [q, k, q_in, k_out, v, log_cum, a_s, states, d_num, d_s]
    ins += [] if not with_z else [a_z, z_states, d_den, d_z]
    ins += [] if g_row is None else [g_row]
    ins += [] if run_ is None else [run_] + ([] if run_row is None else [run_row])
    like = lambda x: jax.ShapeDtypeStruct(x.shape, q.dtype)
    outs = [like(x) for x in (q, k, q_in, k_out, v, a_s, states[:, :, 0])]
    outs += [like(a_z), like(z_states[:, :, 0])] if with_z else []
    kernel = functools.partial(_bwd_kernel, **_options(c, n, log_cum, z_states, run_))
    res = _call(kernel, ins, outs, (b, h))
    dq, dk, d_q_in, d_k_out, d_v, d_a_s, d_s0 = res[:7]
    d_a_z, d_z0 = res[7:] if with_z else (jnp.zeros_like(a_z), None)
    # The scores' cotangent to the cumulative log-decays: P_ij depends on G_i - G_j, and
    # q_i . dq_i (k_j . dk_j) sums dP_ij P_ij over j (over i).
    d_log = q * dq - k * dk
    d_log = d_log if log_cum.shape[-1] != 1 else jnp.sum(d_log, axis=-1, keepdims=True)
    zeros = lambda x: None if x is None else jnp.zeros_like(x)
    d_rows = (zeros(g_row), zeros(run_row))
    return (dq, dk, d_q_in, d_k_out, d_v, d_log, d_a_s, d_a_z, d_s0, d_z0, zeros(run_), d_rows)


_chunks.defvjp(_chunks_fwd, _chunks_bwd)


def _width(x: int) -> int:
    """The power of two at least ``x`` and 16 (Triton's smallest product side)."""
    return max(16, 1 << (x - 1).bit_length())


def _pad(x: Array | None, axis: int, width: int) -> Array | None:
    """``x`` padded with zeros to ``width`` along ``axis`` (None stays None)."""
    if x is None or x.shape[axis] == width:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, width - x.shape[axis])
    return jnp.pad(x, pads)


def _call(kernel, ins, outs, grid):
    """``pallas_call`` of ``kernel`` with one program per (batch row, head), each seeing
    its whole ``[b, h, ...]`` slice: Triton on GPU, Mosaic on TPU, interpreted on CPU."""

    def spec(x):
        rest = x.shape[2:]
        return pl.BlockSpec((None, None) + rest, lambda i, j: (i, j) + (0,) * len(rest))

    def call(params, interpret):
        fn = pl.pallas_call(
            kernel,
            out_shape=outs,
            grid=grid,
            in_specs=[spec(x) for x in ins],
            out_specs=[spec(x) for x in outs],
            interpret=interpret,
            compiler_params=params,
            name="linear_attention_chunks",
        )
        return lambda *xs: fn(*xs)

    triton = call(pltriton.CompilerParams(num_warps=4, num_stages=1), False)
    return jax.lax.platform_dependent(
        *ins, cpu=call(None, True), cuda=triton, rocm=triton, default=call(None, False)
    )


def _mm(a, b, *, ta: bool = False, tb: bool = False):
    """``a @ b`` (``a^T`` with ``ta``, ``b^T`` with ``tb``) of 2-d arrays, float32 or wider."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=a.dtype)


def _decay_mask(g_col, g_row, run_col, run_row, c: int, per_channel: bool):
    """The chunk's relative decays ``exp(G_i - G_j)`` for ``j <= i`` in the same run between
    resets, 0 elsewhere (masked before ``exp``): ``[c, c]`` from the log-decays' column
    ``[c, 1]`` and row ``[1, c]``, or per channel ``[c, c, f]`` from ``g_col [c, f]``."""
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    mask = row >= col
    if per_channel:
        mask = mask[:, :, None]
        if run_col is not None:
            mask = mask & (run_col[:, None, :] == run_col[None, :, :])
        diff = g_col[:, None, :] - g_col[None, :, :]
        return jnp.exp(jnp.where(mask, diff, -jnp.inf))
    if run_col is not None:
        mask = mask & (run_col == run_row)
    return jnp.exp(jnp.where(mask, g_col - g_row, -jnp.inf))


def _scores(q, k, decay, per_channel: bool):
    """``P [c, c]``: ``sum_f q_if k_jf decay_ij(f)``."""
    if per_channel:
        return jnp.sum(q[:, None, :] * k[None, :, :] * decay, axis=2)
    return _mm(q, k, tb=True) * decay


def _chunk(refs, i, c: int, per_channel: bool, with_run: bool):
    """Chunk ``i``'s ``(q, k, q_in, k_out, v, decays)`` from their refs."""
    q_ref, k_ref, qi_ref, ko_ref, v_ref, g_ref, g_row_ref, run_ref, run_row_ref = refs
    tokens = pl.ds(pl.multiple_of(i * c, c), c)
    x = tuple(r[tokens, :] for r in (q_ref, k_ref, qi_ref, ko_ref, v_ref))
    g_col = g_ref[tokens, :]
    g_row = None if per_channel else g_row_ref[pl.ds(i, 1), :]
    run_col = run_ref[tokens, :] if with_run else None
    run_row = run_row_ref[pl.ds(i, 1), :] if with_run and not per_channel else None
    return x + (_decay_mask(g_col, g_row, run_col, run_row, c, per_channel),)


def _split(refs: list, with_z: bool, per_channel: bool, with_run: bool, z_count: int):
    """The optional refs after the fixed ones: ``(z refs (z_count of them, or Nones), g_row,
    run, run_row)``, in ``_chunks_fwd``'s order; ``refs`` keeps what follows them."""
    take = lambda cond: refs.pop(0) if cond else None
    z_refs = tuple(take(with_z) for _ in range(z_count))
    g_row = take(not per_channel)
    run_ = take(with_run)
    run_row = take(with_run and not per_channel)
    return z_refs, g_row, run_, run_row


def _fwd_kernel(*refs, c, n, per_channel, with_z, with_run):
    q_ref, k_ref, qi_ref, ko_ref, v_ref, g_ref, as_ref, s0_ref = refs[:8]
    rest = list(refs[8:])
    (az_ref, z0_ref), g_row_ref, run_ref, run_row_ref = _split(
        rest, with_z, per_channel, with_run, 2
    )
    num_ref, states_ref, s_ref = rest[:3]
    den_ref, z_states_ref, z_ref = rest[3:] if with_z else (None, None, None)
    ins = (q_ref, k_ref, qi_ref, ko_ref, v_ref, g_ref, g_row_ref, run_ref, run_row_ref)

    def body(i, carry):
        s, z = carry
        tokens = pl.ds(pl.multiple_of(i * c, c), c)
        q, k, q_in, k_out, v, decay = _chunk(ins, i, c, per_channel, with_run)
        states_ref[i] = s
        p = _scores(q, k, decay, per_channel)
        num_ref[tokens, :] = _mm(p, v) + _mm(q_in, s)
        s_next = as_ref[i] * s + _mm(k_out, v, ta=True)
        if not with_z:
            return s_next, z
        z_states_ref[i] = z
        den = jnp.sum(p, axis=1, keepdims=True) + jnp.sum(q_in * z, axis=1, keepdims=True)
        den_ref[tokens, :] = den
        return s_next, az_ref[i] * z + jnp.sum(k_out, axis=0, keepdims=True)

    z0 = z0_ref[...] if with_z else jnp.zeros((), s0_ref.dtype)
    s, z = jax.lax.fori_loop(0, n, body, (s0_ref[...], z0))
    s_ref[...] = s
    if with_z:
        z_ref[...] = z


def _bwd_kernel(*refs, c, n, per_channel, with_z, with_run):
    q_ref, k_ref, qi_ref, ko_ref, v_ref, g_ref, as_ref, states_ref, dnum_ref, ds_ref = refs[:10]
    rest = list(refs[10:])
    (az_ref, z_states_ref, dden_ref, dz_ref), g_row_ref, run_ref, run_row_ref = _split(
        rest, with_z, per_channel, with_run, 4
    )
    dq_ref, dk_ref, dqi_ref, dko_ref, dv_ref, das_ref, ds0_ref = rest[:7]
    daz_ref, dz0_ref = rest[7:] if with_z else (None, None)
    ins = (q_ref, k_ref, qi_ref, ko_ref, v_ref, g_ref, g_row_ref, run_ref, run_row_ref)

    def body(step, carry):
        d_s, d_z = carry  # the cotangent of the state after chunk i
        i = n - 1 - step
        tokens = pl.ds(pl.multiple_of(i * c, c), c)
        q, k, q_in, k_out, v, decay = _chunk(ins, i, c, per_channel, with_run)
        s = states_ref[i]
        d_num = dnum_ref[tokens, :]
        p = _scores(q, k, decay, per_channel)
        d_p = _mm(d_num, v, tb=True)
        d_q_in = _mm(d_num, s, tb=True)
        d_k_out = _mm(v, d_s, tb=True)
        d_a = jnp.sum(d_s * s, axis=1, keepdims=True)  # [f, 1]
        das_ref[i] = d_a if per_channel else jnp.sum(d_a, axis=0, keepdims=True)
        if with_z:
            z = z_states_ref[i]
            d_den = dden_ref[tokens, :]
            d_p = d_p + d_den
            d_q_in = d_q_in + d_den * z
            d_k_out = d_k_out + d_z
            d_a_z = d_z * z  # [1, f]
            daz_ref[i] = d_a_z if per_channel else jnp.sum(d_a_z, axis=1, keepdims=True)
        dv_ref[tokens, :] = _mm(p, d_num, ta=True) + _mm(k_out, d_s)
        dqi_ref[tokens, :] = d_q_in
        dko_ref[tokens, :] = d_k_out
        if per_channel:
            w = d_p[:, :, None] * decay
            dq_ref[tokens, :] = jnp.sum(w * k[None, :, :], axis=1)
            dk_ref[tokens, :] = jnp.sum(w * q[:, None, :], axis=0)
        else:
            w = d_p * decay
            dq_ref[tokens, :] = _mm(w, k)
            dk_ref[tokens, :] = _mm(w, q, ta=True)
        d_s_prev = as_ref[i] * d_s + _mm(q_in, d_num, ta=True)
        if not with_z:
            return d_s_prev, d_z
        d_z_prev = az_ref[i] * d_z + jnp.sum(d_den * q_in, axis=0, keepdims=True)
        return d_s_prev, d_z_prev

    d_z = dz_ref[...] if with_z else jnp.zeros((), ds_ref.dtype)
    d_s, d_z = jax.lax.fori_loop(0, n, body, (ds_ref[...], d_z))
    ds0_ref[...] = d_s
    if with_z:
        dz0_ref[...] = d_z
