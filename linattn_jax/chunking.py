"""The chunk engine under every family of recurrences: it knows no recurrence itself.

A family (``attention.py``, ``delta_rule.py``) writes the body of one chunk,
``body(state, x) -> (state, y)``; this module cuts the sequence into chunks,
scans the body across them, and gives the scan a memory-lean gradient: the
forward pass stores only the state entering each chunk, the backward pass
re-runs one chunk at a time in a reverse scan. A gradient then costs
O(t*d + (t/c) * state) extra memory, not a state per token.

It also holds the decay bookkeeping inside a chunk that every family shares:
cumulative log-decays, the decay from key j to query i formed as a difference of
cumulative sums masked BEFORE ``exp`` (never ``exp(G_i) * exp(-G_j)``, which
overflows for strong decays), and the factors that carry the state across.

Internal layout: heads first, ``[b, h, t, .]``; log-decays ``[b, h, t, g]`` with
``g`` 1 (per head) or the key width (per channel); resets ``[b, 1|h, t, 1|g]``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from linattn_jax.typing import Array

Body = Callable[[Any, Any], tuple[Any, Any]]


def scan(body: Body, state: Any, xs: Any, chunk_size: int, length: int) -> tuple[Any, Any]:
    """Runs ``body`` over chunks of ``xs`` with a memory-lean gradient.

    Args:
      body: ``(state, chunk) -> (state, y)``; ``chunk`` has the leaves of ``xs``
        cut to ``[b, h, c, ...]``, ``y`` is a pytree of ``[b, h, c, ...]`` arrays.
      state: the state before the first token (any pytree).
      xs: a pytree of ``[b, h, length, ...]`` arrays (None leaves allowed). The
        last chunk is padded with zeros: the bodies treat a zero token as inert
        (zero key, zero log-decay, no reset).
      chunk_size: tokens per chunk.
      length: the sequence length (the size of axis 2 of every leaf).

    Returns:
      ``(ys with leaves [b, h, length, ...], final state)``.
    """
    # An empty sequence runs one inert padding token: the state passes through unchanged.
    c = max(1, min(chunk_size, length))
    n = max(1, -(-length // c))
    pad = n * c - length

    def chunks(x: Array) -> Array:
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(x.shape[:2] + (n, c) + x.shape[3:]), 2, 0)

    def unchunk(y: Array) -> Array:
        y = jnp.moveaxis(y, 0, 2)
        return y.reshape(y.shape[:2] + (n * c,) + y.shape[4:])[:, :, :length]

    state, ys = _scan_chunks(body, state, jax.tree.map(chunks, xs))
    return jax.tree.map(unchunk, ys), state


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan_chunks(body, state, xs):
    """``lax.scan(body, state, xs)`` whose gradient recomputes each chunk."""
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
    A log-decay of ``-inf`` zeroes the state: it becomes a reset here, with a log-decay
    of 0, so that no difference of cumulative sums ever meets an infinity.
    """
    if g is None and r is None:
        return None
    if g is not None:
        reset = jnp.isneginf(g)
        g = jnp.where(reset, 0.0, g)
        reset = reset.astype(dtype)
        r = reset if r is None else jnp.maximum(r, reset)
    log_cum = jnp.zeros(shape + (1,), dtype) if g is None else jnp.cumsum(g, axis=2)
    last = log_cum[:, :, -1:]
    into, out_of = jnp.exp(log_cum), jnp.exp(last - log_cum)  # both exponents <= 0
    run = None
    if r is not None:
        run = jnp.cumsum(r, axis=2)
        into = jnp.where(run == 0, into, 0.0)
        out_of = jnp.where(run == run[:, :, -1:], out_of, 0.0)
    return Decays(log_cum, run, into, out_of, into[:, :, -1])


def decayed_scores(a: Array, b: Array, dec: Decays | None, *, diagonal: bool) -> Array:
    """``P[i, j] = sum_f a_if b_jf exp(G_if - G_jf)`` for ``j <= i`` (``j < i`` without
    ``diagonal``) in the same run between resets; 0 elsewhere.

    Args:
      a: ``[b, h, c, f]`` (e.g. queries).
      b: ``[b, h, c, f]`` (e.g. keys).
      dec: the chunk's decays (per head: ``g = 1``; per channel: ``g = f``), or None.
      diagonal: whether ``P[i, i]`` is kept.

    Returns:
      ``[b, h, c, c]``.
    """
    c = a.shape[2]
    mask = jnp.tril(jnp.ones((1, 1, c, c), bool), 0 if diagonal else -1)
    if dec is None:
        return jnp.where(mask, jnp.einsum("bhif,bhjf->bhij", a, b), 0.0)
    g = dec.log_cum
    if g.shape[-1] == 1:
        return jnp.einsum("bhif,bhjf->bhij", a, b) * jnp.exp(_masked_diff(g, dec.run, mask)[..., 0])
    if c > SUB_CHUNK and c % SUB_CHUNK == 0:
        return _per_channel_scores_in_sub_chunks(a, b, dec, diagonal)
    # Per-channel decays: the [c, c, f] relative decay is formed explicitly; no
    # factorisation exp(G_i) * exp(-G_j) is safe for strong gates.
    return jnp.einsum("bhif,bhjf,bhijf->bhij", a, b, jnp.exp(_masked_diff(g, dec.run, mask)))


SUB_CHUNK = 16


def _masked_diff(g: Array, run: Array | None, mask: Array) -> Array:
    """``G_i - G_j`` as ``[b, h, i, j, g]``, -inf where ``mask`` [.., i, j] is False or a
    reset lies between: the mask goes in BEFORE exp (for j > i the difference is positive)."""
    mask = mask[..., None]
    if run is not None:
        mask = mask & (run[:, :, :, None] == run[:, :, None, :])
    return jnp.where(mask, g[:, :, :, None] - g[:, :, None, :], -jnp.inf)


def _per_channel_scores_in_sub_chunks(a: Array, b: Array, dec: Decays, diagonal: bool) -> Array:
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
    off = jnp.einsum("bhnif,bhnjf->bhnij", q_t, k_t)  # [b, h, n, s, c]
    # The diagonal blocks, [s, s, f] relative decays with sub-chunks folded into heads.
    fold = lambda x: blocks(x).reshape(bsz, h * n, s, f)
    run = None if run is None else fold(jnp.broadcast_to(run, g.shape))
    mask = jnp.tril(jnp.ones((1, 1, s, s), bool), 0 if diagonal else -1)
    decay = jnp.exp(_masked_diff(fold(g), run, mask))
    inside = jnp.einsum("bmif,bmjf,bmijf->bmij", fold(a), fold(b), decay)
    eye = jnp.eye(n, dtype=a.dtype)[None, None, :, None, :, None]
    inside = inside.reshape(bsz, h, n, s, 1, s) * eye  # placed on the block diagonal
    return (off.reshape(bsz, h, n, s, n, s) + inside).reshape(bsz, h, c, c)
