"""The mLSTM's chunked form: each chunk's outputs and its write to the state from masked
``[c, c]`` matmuls, the stabiliser carried exactly from chunk to chunk, and a hand-written
backward from the state entering each chunk.

Inside a chunk of c tokens, with the stabilised state ``(C, n, m_0)`` entering it, the
log-weight of key j at query i (j <= i, same segment) and that of the entering state are::

    L_ij = A_ij + i_j,        A_ij = sum_{j < l <= i} f_l
    L_i0 = A_i0 + m_0,        A_i0 = sum_{l <= i} f_l

and ``m_i = max(L_i0, max_j L_ij)`` is exactly the per-token recurrence's
``m_i = max(f_i + m_{i-1}, i_i)`` unrolled. Every weight is then ``exp(L - m_i) <= 1``:
no gate of any size overflows. ``A_ij`` is formed to one rounding of its own size, not
as a difference of whole-chunk cumulative sums: with gates of -50 the chunk's sum reaches
-3200, whose float32 rounding (2e-4) would be a relative error in every weight. So the
gates are split into a coarse part ``hi`` on a power-of-two grid (its cumulative sums,
integers of the grid below ``2**22``, are exact, and so are their differences) and the
small rest ``lo = f - hi`` (``split_cumsum``). The state after the chunk is the last
row's weights applied to the keys; ``m`` after it is ``m_{c-1}``.

A segment reset at token s puts the zero state (``m = 0``) before s: the queries of its
run see neither the entering state nor the keys before s, and their maximum also holds
``A_is + f_s`` (the fresh ``m = 0`` decayed to i), as the recurrence's would.

Memory: ``linattn_jax.ops.chunking.scan`` keeps only the state entering each chunk and
the chunk's outputs; the backward (``chunk_body_bwd``) recomputes the chunk's weights
(``gate_weights``, by ``jax.vjp``: elementwise but for one ``[c, c]`` product, the forget
gates' exact gradient through ``interval_sums``) and its ``[c, c]`` scores, then runs the
transposed products (the work of nine ``[c, c]``-by-``[c, d]`` or ``[c, d]``-by-``[d, v]``
matmuls, in seven: the two transposes of ``[scores, w_0 q] [v; C]`` one each), where
autodiff of the body re-ran the forward and transposed the masked cumulative sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax.ops import checks, chunking


def split_cumsum(log_f):
    """``(H, Lo, lo)``: the cumulative sums of ``log_f [b, h, c]`` in two parts whose
    differences give ``A_ij = sum_{j < l <= i} f_l = (H_i - H_j) + (Lo_i - Lo_j)`` to one
    rounding of ``A_ij`` itself, and the small part ``lo`` whose sums ``Lo`` are.

    ``hi`` is ``log_f`` rounded to a power-of-two grid coarse enough that c of them sum to
    less than ``2**22`` grid steps: its cumulative sums and their differences are exact.
    ``lo = log_f - hi`` (exact, at most half a step) is small, and so is its sums' rounding.
    Only ``lo`` carries the gradient (``hi`` is a rounding of ``log_f``, not a function to
    differentiate: ``hi + lo`` is ``log_f``).
    """
    c = log_f.shape[-1]
    top = jnp.max(jnp.abs(log_f), axis=-1, keepdims=True) * c
    grid = jnp.ldexp(jnp.ones((), log_f.dtype), jnp.frexp(top)[1] - 22)
    hi = jax.lax.stop_gradient(jnp.round(log_f / grid) * grid)
    lo = log_f - hi
    return chunking.chunk_cumsum(hi), chunking.chunk_cumsum(lo), lo


@jax.custom_vjp
def interval_sums(lo):
    """``[b, h, c, c]``: ``Lo_i - Lo_j`` (``Lo`` the cumulative sums of ``lo [b, h, c]``),
    ``sum_{j < l <= i} lo_l`` below the diagonal and its negative above.

    Its transpose sums each ``lo_l``'s rectangle of pairs (``j < l <= i``) directly. The
    transpose of the difference of cumulative sums, a reverse cumulative sum of row sums
    minus column sums, gets the same number as a difference in which every pair with both
    ends after ``l`` cancels: after a strong forgetting (gates of -300) the earlier gates'
    gradient is 0 but came out as the rounding of the later O(1) pairs' sums (1.6e-7 per
    token, 1.6e-5 of the gradient's norm where the later gates' is 55x smaller).
    """
    return _interval_sums(lo)


def _interval_sums(lo):
    cum = chunking.chunk_cumsum(lo)
    return cum[..., :, None] - cum[..., None, :]


def _interval_sums_fwd(lo):
    return _interval_sums(lo), None


def _interval_sums_bwd(_, d):
    # d lo_l = sum_{j < l <= i} (d_ij - d_ji): the antisymmetric part's lower-left
    # rectangle, as a product with [j < l] and a sum over the rows i >= l. (The same sums
    # by blocks of 8 tokens, O(c^2) work, ran no faster on CPU: 1.45 ms against 1.5 for 8
    # heads of 32 chunks of 64; this product costs the forward+backward 5-10%.)
    e = d - jnp.swapaxes(d, -1, -2)
    idx = jnp.arange(d.shape[-1])
    before = (idx[:, None] < idx[None, :]).astype(d.dtype)  # [j, l]: j < l
    left = jnp.einsum("bhij,jl->bhil", e, before, precision=jax.lax.Precision.HIGHEST)
    below = idx[:, None] >= idx[None, :]  # [i, l]: i >= l
    return (jnp.sum(jnp.where(below, left, 0), axis=-2),)


interval_sums.defvjp(_interval_sums_fwd, _interval_sums_bwd)


def gate_weights(log_i, log_f, m_in, live, reset):
    """One chunk's weights: ``(w [b,h,c,c], w_0 [b,h,c], m [b,h,c])``, ``w_ij = exp(L_ij -
    m_i)`` (0 where j is not a key of i), ``w_0i = exp(L_i0 - m_i)``, both ``<= 1``.

    Args:
      log_i: log input gates ``[b, h, c]``.
      log_f: log forget gates ``[b, h, c]``.
      m_in: the stabiliser entering the chunk ``[b, h]`` (``-inf``: no state).
      live: ``[b, 1, c]`` bool, the tokens that count.
      reset: ``[b, 1, c]`` bool (the zero state before the token) or None.
    """
    c = log_f.shape[-1]
    rows = jnp.arange(c).reshape(1, 1, c, 1)
    cols = jnp.arange(c).reshape(1, 1, 1, c)
    causal = rows >= cols
    neg = jnp.full((), -jnp.inf, log_f.dtype)
    cum, rest, lo = split_cumsum(log_f)
    # A[i, j] = sum_{j < l <= i} f_l: exact differences first, then the small rests.
    pair = (cum[..., :, None] - cum[..., None, :]) + interval_sums(lo)
    keys = causal & live[..., None, :]
    log_0 = (cum + rest) + m_in[..., None]
    if reset is not None:
        run = chunking.chunk_cumsum(reset.astype(log_f.dtype))
        same = run[..., :, None] == run[..., None, :]
        keys = keys & same
        fresh = jnp.where(causal & same & reset[..., None, :], pair + log_f[..., None, :], neg)
        log_0 = jnp.where(run == 0, log_0, neg)
    log_w = jnp.where(keys, pair + log_i[..., None, :], neg)
    m = jnp.maximum(log_0, jnp.max(log_w, axis=-1))
    if reset is not None:
        m = jnp.maximum(m, jnp.max(fresh, axis=-1))
    w = jnp.exp(log_w - m[..., None])  # [b, h, c, c], <= 1
    w_0 = jnp.exp(log_0 - m)  # [b, h, c], <= 1
    return w, w_0, m


def chunk_body(state, x, *, dtype=None):
    """One chunk (``chunking.scan``'s body).

    Args:
      state: ``(C [b,h,d,v], n [b,h,d], m [b,h])`` entering the chunk (``m = -inf``: no
        state, as the sequence-parallel shards start).
      x: ``(q [b,h,c,d] scaled, k [b,h,c,d], v [b,h,c,v], log_i [b,h,c], log_f [b,h,c],
        live [b,1,c] bool, resets [b,1,c] bool | None)``, all finite.
      dtype: the operand dtype of the matmuls that make the outputs
        (``chunking.operand_dtype``; None: no cast).

    Returns:
      ``(state after the chunk, (numerator [b,h,c,v], denominator [b,h,c], m [b,h,c]))``,
      the numerator and denominator stabilised by each token's ``m``.
    """
    c_in, n_in, m_in = state
    q, k, v, log_i, log_f, live, reset = x
    w, w_0, m = gate_weights(log_i, log_f, m_in, live, reset)
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    scores = mixed("bhid,bhjd->bhij", q, k) * w
    # num = scores v + w_0 (q C): one product of [scores, w_0 q] with [v; C] (fewer, larger
    # matmuls: on CPU a [c, c + d] one costs less than two).
    reads = jnp.concatenate([scores, w_0[..., None] * q], axis=-1)
    num = mixed("bhij,bhjv->bhiv", reads, jnp.concatenate([v, c_in], axis=2))
    den = chunking.row_sums(scores) + w_0 * jnp.einsum("bhid,bhd->bhi", q, n_in)
    # The state after the chunk: the last row's weights (float32 operands, as the scan).
    k_out = k * w[:, :, -1, :, None]
    across = w_0[:, :, -1]
    c_out = across[..., None, None] * c_in + jnp.einsum("bhjd,bhjv->bhdv", k_out, v)
    n_out = across[..., None] * n_in + _token_sums(k_out)
    return (c_out, n_out, m[:, :, -1]), (num, den, m)


def _token_sums(x):
    """``x [b, h, c, d]`` summed over its tokens, as a product with ones (``row_sums``)."""
    return jnp.einsum("bhcd,c->bhd", x, jnp.ones((x.shape[2],), x.dtype))


def chunk_body_bwd(d_state, inputs, *, dtype=None):
    """The transpose of ``chunk_body`` (``chunking.scan``'s ``body_bwd``), from the state
    entering the chunk; its weights and scores are recomputed.

    Args:
      d_state: ``(dC [b,h,d,v], dn [b,h,d], dm [b,h])``, the cotangent of the state after
        the chunk.
      inputs: ``(state entering the chunk, x, the chunk's outputs (numerator,
        denominator, m), their cotangents)``, as in ``chunk_body``.
      dtype: as in ``chunk_body``.

    Returns:
      ``(d state before the chunk, d x)`` (None for the bool ``live`` and ``resets``).
    """
    (c_in, n_in, m_in), x, _, (d_num, d_den, d_m) = inputs
    d_c, d_n, d_m_out = d_state
    q, k, v, log_i, log_f, live, reset = x
    (w, w_0, _), gates_vjp = jax.vjp(
        lambda li, lf, mi: gate_weights(li, lf, mi, live, reset), log_i, log_f, m_in
    )
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    dots = mixed("bhid,bhjd->bhij", q, k)
    scores = dots * w
    wl = w[:, :, -1]  # [b, h, c]: the last row's weights, which write the keys to the state
    k_out = k * wl[..., None]
    across = w_0[:, :, -1]
    c = q.shape[2]
    # num = [scores, w_0 q] [v; C]: its two transposed products, each one matmul. The
    # scores' cotangent (d_num v^T + d_den) sums terms that cancel where an output is near
    # its values' mean: float32 operands.
    written = jnp.concatenate([v, c_in], axis=2)  # [b, h, c + d, v]
    back = jnp.einsum("bhiv,bhjv->bhij", d_num, written)  # [d_num v^T, d_num C^T]
    d_scores, from_c = back[..., :c] + d_den[..., None], back[..., c:]
    reads = jnp.concatenate([scores, w_0[..., None] * q], axis=-1)
    d_written = mixed("bhij,bhiv->bhjv", reads, d_num)  # [scores^T d_num; (w_0 q)^T d_num]
    d_dots = d_scores * w
    d_w = d_scores * dots
    d_v = d_written[:, :, :c] + jnp.einsum("bhjd,bhdv->bhjv", k_out, d_c)
    d_k_out = jnp.einsum("bhjv,bhdv->bhjd", v, d_c) + d_n[:, :, None]
    d_k = mixed("bhij,bhid->bhjd", d_dots, q) + d_k_out * wl[..., None]
    d_w = d_w.at[:, :, -1].add(chunking.row_sums(d_k_out * k))
    q_n = jnp.einsum("bhid,bhd->bhi", q, n_in)
    d_q = (
        mixed("bhij,bhjd->bhid", d_dots, k)
        + w_0[..., None] * from_c
        + (w_0 * d_den)[..., None] * n_in[:, :, None]
    )
    d_w_0 = chunking.row_sums(from_c * q) + d_den * q_n
    d_across = jnp.sum(d_c * c_in, axis=(2, 3)) + jnp.sum(d_n * n_in, axis=2)
    d_w_0 = d_w_0.at[:, :, -1].add(d_across)
    d_c_in = across[..., None, None] * d_c + d_written[:, :, c:]
    d_n_in = across[..., None] * d_n + jnp.einsum("bhid,bhi->bhd", q, w_0 * d_den)
    d_m = d_m.at[:, :, -1].add(d_m_out)
    d_log_i, d_log_f, d_m_in = gates_vjp((d_w, d_w_0, d_m))
    no_grad = lambda y: None if y is None else np.zeros(y.shape, jax.dtypes.float0)
    return (d_c_in, d_n_in, d_m_in), (
        d_q,
        d_k,
        d_v,
        d_log_i,
        d_log_f,
        no_grad(live),
        no_grad(reset),
    )


def run_chunks(xs, state, chunk_size: int | None, *, dtype=None):
    """``chunk_body`` over the chunks of the time-major ``xs`` (``api``'s operands):
    ``((numerator [b,t,h,v], denominator [b,t,h], m [b,t,h]), final state)``.

    ``chunk_size`` None: the backend picks it (``chunking.per_backend``):
    ``checks.CHUNK_SIZE_CPU`` (32) on CPU, ``checks.CHUNK_SIZE`` (64) on GPU and TPU; the
    lowered program holds only its own backend's chunks.
    """
    if chunk_size is None:
        on = lambda size: functools.partial(run_chunks, chunk_size=size, dtype=dtype)
        return chunking.per_backend(
            xs,
            state,
            cpu=on(checks.default_chunk_size(None, on_cpu=True)),
            default=on(checks.default_chunk_size(None)),
        )
    t = xs[0].shape[1]
    body = functools.partial(chunk_body, dtype=dtype)
    body_bwd = functools.partial(chunk_body_bwd, dtype=dtype)
    return chunking.scan(body, state, xs, chunk_size, t, body_bwd=body_bwd, time_axis=1)
