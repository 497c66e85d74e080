"""Mamba-2's SSD recurrence (state space duality), on the additive family's engine.

For each batch row and head, with ``x_t`` the head's ``p`` channels, ``B_t`` and ``C_t`` the
``n``-wide input and output projections of the head's group, ``dt_t >= 0`` its step and
``A <= 0`` its (constant) rate::

    h_t = exp(dt_t A) h_{t-1} + B_t (dt_t x_t)^T        (n x p per head)
    y_t = h_t^T C_t + D x_t

This is the additive rule ``S_t = a_t S_{t-1} + phi(k_t) v_t^T`` with ``q = C``, ``k = B``,
``v = dt x``, the per-token, per-head log-decay ``log a_t = dt_t A``, the identity feature
map and no denominator (Dao and Gu 2024, Section 3). Every form here runs that family's own
code (``linattn_jax.ops.additive``: its chunk-parallel engine with its memory-lean
backward, its token scan, its step and its sequence-parallel form), so it keeps its
guarantees: ``key_mask`` padding is replaced, never multiplied, by zeros (a NaN or inf in
a padded ``x``, ``dt``, ``B`` or ``C`` reaches no output and no gradient); a NaN in a
real token spoils only its own and later outputs; ``-inf`` log-decays (``A = -inf``: the
head keeps only the current token) never subtract infinities; states are float32; for
bfloat16 inputs the chunks' matmuls read bfloat16 operands with float32 accumulation.

Heads and groups: ``x`` has ``h`` heads, ``B`` and ``C`` have ``g`` groups (Mamba-2's
``n_groups``), ``g`` dividing ``h``; head ``i`` reads group ``i // (h / g)`` (as
``repeat_interleave`` in ``transformers``). The chunked form repeats the groups to the heads
inside each group of chunks, never over the whole sequence (as the delta family's grouped
heads); the scan, the step and the sequence-parallel form repeat them first. Their gradient
sums over each group.

The state is ``SSDState(s)``, ``s [b, h, n, p]`` (the transpose of ``transformers``'
``ssm_state [b, h, p, n]``).

References:
  Dao and Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms
  Through Structured State Space Duality" (https://arxiv.org/abs/2405.21060).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax.ops import additive, checks, chunking, feature_maps
from linattn_jax.ops.additive import recurrent
from linattn_jax.ops.additive.chunked import run_chunks
from linattn_jax.typing import Array, Float

METHODS = ("chunked", "scan", "quadratic")


class SSDState(NamedTuple):
    """The SSD recurrence's state, float32 (float64 for float64 inputs).

    Attributes:
      s: ``[b, h, n, p]``: per head, the running ``sum_j exp(dt A ...) B_j (dt_j x_j)^T``.
    """

    s: Float[Array, "b h n p"]


State = SSDState  # the family interface's name


def init_state(batch: int, heads: int, state_dim: int, head_dim: int) -> State:
    """The empty state: zeros ``[batch, heads, state_dim, head_dim]`` float32."""
    checks.check_sizes(batch=batch, heads=heads, state_dim=state_dim, head_dim=head_dim)
    return State(s=jnp.zeros((batch, heads, state_dim, head_dim), jnp.float32))


def _as_internal(state, b: int, h: int, n: int, p: int, dtype) -> Array:
    """A user's state as ``S [b, h, n, p]`` in ``dtype`` (zeros when None)."""
    if state is None:
        return jnp.zeros((b, h, n, p), dtype)
    if not isinstance(state, State):
        raise ValueError(
            f"state must be an SSDState (linattn_jax.ops.ssd.State), got {type(state).__name__}"
        )
    checks.check_shape("state.s", state.s, (b, h, n, p), "[batch, heads, state_dim, head_dim]")
    return state.s.astype(dtype)


def _check(x, dt, A, B, C, D, *, step: bool):
    """Validates the inputs (``step``: one token, no length axis); returns ``(b, h, p, g, n)``."""
    lead = "[batch, heads" if step else "[batch, length, heads"
    rank = 3 if step else 4
    checks.check_rank("x", x, rank, f"{lead}, head_dim]")
    checks.check_rank("B", B, rank, f"{lead.replace('heads', 'groups')}, state_dim]")
    checks.check_rank("C", C, rank, f"{lead.replace('heads', 'groups')}, state_dim]")
    checks.check_float(("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C))
    checks.check_same_dtype(("B", B), ("C", C))
    *tokens, h, p = x.shape
    checks.check_shape("dt", dt, (*tokens, h), f"{lead}]")
    checks.check_shape("A", A, (h,), "[heads]")
    if D is not None:
        checks.check_float(("D", D))
        checks.check_shape("D", D, (h,), "[heads]")
    checks.check_same(("B", B), ("C", C), axes=tuple(range(rank)), what="shape")
    if tuple(B.shape[:-2]) != tuple(tokens):
        raise ValueError(
            f"B and C must have the batch (and length) of x {tuple(x.shape)}, got {B.shape}"
        )
    g, n = B.shape[-2:]
    if h % g:
        raise ValueError(f"B and C's groups ({g}) must divide x's heads ({h}), got B {B.shape}")
    if checks.is_concrete(A) and np.any(np.asarray(A) > 0):
        raise ValueError(f"A must be <= 0 (A = -exp(A_log)), got {np.asarray(A)}")
    return tokens[0], h, p, g, n


def _operands(x, dt, A, B, C, key_mask, heads: int, repeat: bool = True):
    """``(q = C, k = B, v = dt x, log-decay dt A)`` of the additive rule, the groups repeated
    to ``heads`` (unless not ``repeat``: the chunked engine repeats them per group of
    chunks); q and k in their own dtype, v and the log-decay in float32 (float64).
    Padding is replaced by zeros before anything reads it (so no NaN there reaches a
    gradient through ``dt * x`` or ``dt * A``)."""
    dtype = feature_maps.accumulation_dtype(x.dtype)
    x, dt, B, C = (checks.where_token(key_mask, y) for y in (x, dt, B, C))
    groups = heads // B.shape[-2] if repeat else 1
    q, k = (C, B) if groups == 1 else (jnp.repeat(y, groups, axis=-2) for y in (C, B))
    dt = dt.astype(dtype)
    v = dt[..., None] * x.astype(dtype)
    A = A.astype(dtype).reshape((1,) * (dt.ndim - 1) + A.shape)
    # A = -inf is a reset at every token (whatever dt); the double where keeps the
    # gradient of dt finite there (0 * -inf is NaN).
    reset = jnp.isneginf(A)
    gate = jnp.where(reset, -jnp.inf, dt * jnp.where(reset, 0.0, A))
    return q, k, v, gate


def _skip(out, x, D, key_mask):
    """``out + D x`` (``D [h]``; nothing when None), in float32, padding 0."""
    if D is None:
        return out
    x = checks.where_token(key_mask, x).astype(out.dtype)
    return out + D.astype(out.dtype).reshape((1,) * (x.ndim - 2) + (-1, 1)) * x


def causal(
    x: Float[Array, "b t h p"],
    dt: Float[Array, "b t h"],
    A: Float[Array, " h"],
    B: Float[Array, "b t g n"],
    C: Float[Array, "b t g n"],
    *,
    D: Float[Array, " h"] | None = None,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    segment_ids: Array | None = None,
) -> Float[Array, "b t h p"] | tuple[Float[Array, "b t h p"], State]:
    """Mamba-2's SSD recurrence over a sequence: ``y_t = h_t^T C_t + D x_t``.

    Args:
      x: inputs ``[b, t, h, p]`` (``h`` heads of ``p`` channels).
      dt: steps ``[b, t, h]``, >= 0 (Mamba-2: ``softplus(. + dt_bias)``, clamped).
      A: rates ``[h]``, <= 0 (Mamba-2: ``-exp(A_log)``); ``-inf``: the head keeps only the
        current token (a reset at every token).
      B: input projections ``[b, t, g, n]`` (``g`` groups dividing ``h``).
      C: output projections ``[b, t, g, n]``, B's dtype.
      D: optional skip ``[h]``: adds ``D x_t``.
      method: ``"chunked"`` (default, fast), ``"scan"`` (one step per token) or
        ``"quadratic"`` (one chunk of the whole length, for short inputs). All give the
        same result.
      chunk_size: tokens per chunk (``"chunked"``) or per recomputed block of the
        backward pass (``"scan"``); any length works. None: 64.
      initial_state: the state before token 0; zeros when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token leaves the
        state untouched (no write, no decay) and outputs 0, whatever its x, dt, B and C
        hold.
      segment_ids: optional int ``[b, t]``; the state resets wherever the id changes
        (packed sequences). ``initial_state`` belongs to token 0's segment.

    Returns:
      ``y [b, t, h, p]`` in x's dtype, or ``(y, state)`` when ``return_state``; ``state``
      is a float32 ``SSDState``.

    Raises:
      ValueError: on wrong ranks or mismatched shapes, non-float inputs, groups that do
        not divide the heads, an unknown method, ``chunk_size < 1``, a bad state, mask or
        segment ids; on concrete ``A > 0`` or ``dt < 0`` (at real tokens).
    """
    b, h, p, _, n = _check(x, dt, A, B, C, D, step=False)
    t = x.shape[1]
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if chunk_size is not None:
        checks.check_chunk_size(chunk_size)
    checks.check_bool("return_state", return_state)
    key_mask = checks.token_mask("key_mask", key_mask, b, t)
    checks.check_steps("dt", dt, key_mask)
    return _causal(
        x, dt, A, B, C, D, key_mask, segment_ids, initial_state, method=method,
        chunk_size=chunk_size, return_state=return_state,
    )  # fmt: skip


@checks.one_program()
def _causal(
    x, dt, A, B, C, D, key_mask, segment_ids, initial_state, *, method, chunk_size, return_state
):
    b, t, h, p = x.shape
    n = B.shape[-1]
    dtype = feature_maps.accumulation_dtype(x.dtype)
    q, k, v, gate = _operands(x, dt, A, B, C, key_mask, h, repeat=method == "scan")
    g = checks.log_decay(None, gate, b, t, h, dtype, key_mask=key_mask)
    resets = None if segment_ids is None else checks.segment_resets(segment_ids, b, t, dtype)
    state = (_as_internal(initial_state, b, h, n, p, dtype), None)
    chunk_size = t if method == "quadratic" else checks.default_chunk_size(chunk_size, g)
    g, resets = (None if y is None else jnp.swapaxes(y, 1, 2) for y in (g, resets))
    if method == "scan":
        q, k = (y.astype(dtype) for y in (q, k))
        (out, _), (s, _) = recurrent.run_scan(q, k, v, g, resets, state, chunk_size, time_axis=1)
    else:
        (out, _), (s, _) = _run_chunks(
            q,
            k,
            v,
            g,
            resets,
            state,
            chunk_size,
            diagonal=True,
            dtype=chunking.operand_dtype(x.dtype),
            time_axis=1,
            phi=feature_maps.get("identity"),
            live=None if key_mask is None else key_mask[:, :, None, None],
            groups=h // q.shape[-2],
        )
    out = _skip(out, x, D, key_mask).astype(x.dtype)
    return (out, State(s)) if return_state else out


# The additive chunks as their own jitted function (inlined by XLA into the caller's
# program): traced and lowered once per shape and options, so a Mamba-2 model's identical
# layers share one trace (as ``ops.delta``'s chunked form does).
_run_chunks = jax.jit(
    run_chunks,
    static_argnames=("chunk_size", "diagonal", "dtype", "time_axis", "phi", "groups"),
)


def step(
    x: Float[Array, "b h p"],
    dt: Float[Array, "b h"],
    A: Float[Array, " h"],
    B: Float[Array, "b g n"],
    C: Float[Array, "b g n"],
    state: State,
    *,
    D: Float[Array, " h"] | None = None,
) -> tuple[Float[Array, "b h p"], State]:
    """One token of the SSD recurrence, O(1) in the sequence length.

    ``causal`` over a sequence equals these steps run token by token from ``init_state``
    (or the same ``initial_state``), outputs and state.

    Args:
      x: this token's inputs ``[b, h, p]``.
      dt: its steps ``[b, h]``, >= 0.
      A: rates ``[h]``, <= 0, as in ``causal``.
      B: its input projections ``[b, g, n]``.
      C: its output projections ``[b, g, n]``.
      state: the state after the previous token (``init_state`` before the first).
      D: optional skip ``[h]``, as in ``causal``.

    Returns:
      ``(y [b, h, p] in x's dtype, the new float32 state)``.

    Raises:
      ValueError: on mismatched shapes or dtypes, or a bad state, A or dt.
    """
    b, h, p, _, n = _check(x, dt, A, B, C, D, step=True)
    checks.check_steps("dt", dt)
    if state is None:
        raise ValueError(
            "state must be the SSDState after the previous token (init_state(...) before "
            "the first), got None"
        )
    dtype = feature_maps.accumulation_dtype(x.dtype)
    s = _as_internal(state, b, h, n, p, dtype)
    q, k, v, gate = _operands(x, dt, A, B, C, None, h)
    a = jnp.exp(gate)[..., None]  # [b, h, 1]; exp(-inf) = 0: a reset
    s, out = recurrent.token_step(s, (q.astype(dtype), k.astype(dtype), v, a))
    return _skip(out, x, D, None).astype(x.dtype), State(s)


def sequence_parallel(
    x: Float[Array, "b t h p"],
    dt: Float[Array, "b t h"],
    A: Float[Array, " h"],
    B: Float[Array, "b t g n"],
    C: Float[Array, "b t g n"],
    *,
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    D: Float[Array, " h"] | None = None,
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
):
    """``causal`` with the length sharded over mesh axis ``axis_name`` (LASP: each device
    runs its shard from a zero state; the shards' states are all-gathered and folded in;
    ``linattn_jax.ops.additive.sequence_parallel``).

    Args:
      x: inputs ``[b, t, h, p]`` (a global array); t must be divisible by the size of
        ``axis_name``.
      dt: steps ``[b, t, h]``, as in ``causal``.
      A: rates ``[h]``, as in ``causal``.
      B: input projections ``[b, t, g, n]``, as in ``causal``.
      C: output projections ``[b, t, g, n]``, as in ``causal``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis (or axes) that splits the batch too.
      D: optional skip ``[h]``, as in ``causal``.
      chunk_size: as in ``causal``.
      initial_state: as in ``causal``.
      return_state: as in ``causal``.

    Returns:
      ``y [b, t, h, p]``, or ``(y, state)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not divide, or
        any error of ``causal``.
    """
    b, h, p, _, n = _check(x, dt, A, B, C, D, step=False)
    checks.check_bool("return_state", return_state)
    checks.check_steps("dt", dt)
    s = _as_internal(initial_state, b, h, n, p, feature_maps.accumulation_dtype(x.dtype))
    q, k, v, gate = _operands(x, dt, A, B, C, None, h)
    # The additive state's Z (the denominator's) is not read without normalize: zeros.
    start = additive.State(s=s, z=jnp.zeros(s.shape[:3], s.dtype))
    out, final = additive.sequence_parallel(
        q,
        k.astype(q.dtype),
        v,
        axis_name=axis_name,
        mesh=mesh,
        batch_axis=batch_axis,
        feature_map="identity",
        chunk_size=chunk_size,
        initial_state=start,
        return_state=True,
        gate=gate,
        normalize=False,
    )
    out = _skip(out.astype(v.dtype), x, D, None).astype(x.dtype)
    return (out, State(final.s)) if return_state else out


# The long names, re-exported at the top level (``linattn_jax.ssd`` and so on).
ssd = causal
ssd_step = step
init_ssd_state = init_state
sequence_parallel_ssd = sequence_parallel
SSD_METHODS = METHODS
