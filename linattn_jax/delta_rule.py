"""The delta rule, plain and gated, in every form: arrays in, arrays out.

For each token t, with state S ``[dk, dv]`` per batch and head and ``o_t = S_t^T q_t``::

    DeltaNet          S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    Gated DeltaNet    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    KDA               S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T

with ``alpha_t = exp(gate_t)``: one gate per head (Gated DeltaNet; Yang, Kautz and
Hatamizadeh, ICLR 2025) or one per key channel (Kimi Delta Attention, Kimi
Linear 2025); no gate is DeltaNet (Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length"). Each token writes
``beta_t (v_t - S^T k_t)``, the error of the state's prediction for its key.
``beta`` in [0, 1] is the usual range; up to 2 gives the transition negative
eigenvalues (Grazzi et al. 2025). With ``||k_t|| <= 1`` and ``0 <= beta_t <= 1``
every ``I - beta_t k_t k_t^T`` is a contraction, so the state stays bounded
(models L2-normalise k); there is no denominator: models normalise q, k and
the output instead. q is used as given, times ``scale`` (default 1).

Forms, all with the same inputs and state:

* ``"scan"``: one ``lax.scan`` step per token (the reference recurrence);
* ``"chunked"`` (default): inside a chunk of C tokens the UT transform, with
  ``A = I + tril(diag(beta) (K K^T * D), -1)`` (D the decay from key j to key i),
  ``[U | W] = A^{-1} diag(beta) [V | exp(G) * K]`` by a float32 triangular solve,
  then ``O = exp(G) * Q S + (Q K^T * D) (U - W S)`` and
  ``S_next = exp(G_C) * S + (exp(G_C - G) * K)^T (U - W S)``; a ``lax.scan``
  carries S across chunks;
* ``delta_rule_step``: one token, O(1) in t, for decoding.

Decays inside a chunk are differences of cumulative log-gates, masked before
``exp`` (``linattn_jax.chunking``), so gates of -30 per token and ``-inf`` (a full
reset) stay finite. Gradients store only the state at chunk boundaries.

Mixed precision: for bfloat16 (or float16) inputs the chunked form's products that
only read (``Q K^T``, ``Q S`` and ``(Q K^T * D) (U - W S)``, and their transposes in
the gradient) take operands in that dtype with float32 accumulation; everything that
reaches the state stays float32: ``K K^T``, the triangular solve, ``W S`` and the
update ``K^T (U - W S)``, so the state is the scan and step forms' to float32 accuracy.
float32 and float64 inputs run every product in their own dtype, as before.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax import checks, chunking, feature_maps
from linattn_jax.typing import Array, Float

DELTA_METHODS = ("chunked", "scan")


class DeltaRuleState(NamedTuple):
    """The recurrent state of the delta rule, float32 (float64 for float64 inputs).

    Attributes:
      s: ``[b, h, dk, dv]``.
    """

    s: Float[Array, "b h d v"]


def init_delta_state(batch: int, heads: int, key_dim: int, value_dim: int) -> DeltaRuleState:
    """The empty state: ``s`` zeros ``[batch, heads, key_dim, value_dim]``, float32."""
    checks.check_sizes(batch=batch, heads=heads, key_dim=key_dim, value_dim=value_dim)
    return DeltaRuleState(s=jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32))


def delta_rule(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    beta: Float[Array, "b t h"],
    *,
    gate: Array | None = None,
    method: str = "chunked",
    chunk_size: int | None = None,
    initial_state: DeltaRuleState | None = None,
    return_state: bool = False,
    key_mask: Array | None = None,
    segment_ids: Array | None = None,
    scale: float = 1.0,
) -> Float[Array, "b t h v"] | tuple[Float[Array, "b t h v"], DeltaRuleState]:
    """The causal delta rule (DeltaNet; Gated DeltaNet or KDA with a ``gate``).

    Args:
      q: queries ``[b, t, h, dk]``.
      k: keys ``[b, t, h, dk]`` (L2-normalised in the usual recipe).
      v: values ``[b, t, h, dv]``.
      beta: writing strengths ``[b, t, h]``, in [0, 2] (usually [0, 1]).
      gate: optional log-decays, values <= 0: ``[b, t, h]`` (one per head, Gated
        DeltaNet) or ``[b, t, h, dk]`` (one per key channel, KDA). ``-inf`` zeroes
        the state (a full reset).
      method: ``"chunked"`` (default, fast) or ``"scan"`` (one step per token).
      chunk_size: tokens per chunk (``"chunked"``) or per recomputed block of the
        backward pass (``"scan"``); any length works. None: 64, or 16 with a
        per-channel gate (whose ``[c, c, f]`` relative decays grow with the chunk).
      initial_state: the state before token 0; zeros when None.
      return_state: also return the state after the last token.
      key_mask: optional bool ``[b, t]``, True for real tokens. A masked token leaves
        the state untouched (beta 0, no decay) and its own output is 0, whatever
        its q, k, v, beta and gate hold.
      segment_ids: optional int ``[b, t]``; the state resets wherever the id changes.
      scale: multiplies q (the layers pass their recipe's scale).

    Returns:
      ``out [b, t, h, dv]`` in the dtype of ``v``, or ``(out, state)`` when
      ``return_state``; ``state`` is a float32 ``DeltaRuleState``. For bfloat16
      (float16) ``q`` the chunked form's output products read their operands in that
      dtype, with float32 accumulation (see the module's docstring).

    Raises:
      ValueError: on mismatched or wrong-rank shapes, non-float inputs, an unknown
        method, ``chunk_size < 1``, a bad beta (shape, or values outside [0, 2] when
        concrete), gate, mask, segment ids or state.
    """
    b, t, h, dk = checks.check_qkv(q, k, v, causal=True)
    if method not in DELTA_METHODS:
        raise ValueError(f"method must be one of {DELTA_METHODS}, got {method!r}")
    if chunk_size is not None:
        checks.check_chunk_size(chunk_size)
    key_mask = checks.token_mask("key_mask", key_mask, b, t)
    _check_beta(beta, (b, t, h), "[batch, length, heads]", key_mask)
    dtype, out_dtype = feature_maps.accumulation_dtype(q.dtype), v.dtype
    operands = chunking.operand_dtype(q.dtype)
    g = checks.log_decay(None, gate, b, t, h, dtype, channels=dk, key_mask=key_mask)
    resets = None if segment_ids is None else checks.segment_resets(segment_ids, b, t, dtype)
    q, k, v, beta = (checks.where_token(key_mask, x) for x in (q, k, v, beta))
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    q, k, v, beta = (heads_first(x.astype(dtype)) for x in (q * scale, k, v, beta))
    state = _state_in(initial_state, b, h, dk, v.shape[-1], dtype)
    body = _scan_body if method == "scan" else functools.partial(_chunk_body, dtype=operands)
    chunk_size = checks.default_chunk_size(chunk_size, g)
    out, state = chunking.scan(body, state, (q, k, v, beta, g, resets), chunk_size, t)
    out = jnp.swapaxes(out, 1, 2).astype(out_dtype)
    return (out, DeltaRuleState(state)) if return_state else out


def delta_rule_step(
    q: Float[Array, "b h d"],
    k: Float[Array, "b h d"],
    v: Float[Array, "b h v"],
    beta: Float[Array, "b h"],
    state: DeltaRuleState,
    *,
    gate: Array | None = None,
    scale: float = 1.0,
) -> tuple[Float[Array, "b h v"], DeltaRuleState]:
    """One decoding step of the delta rule: O(1) in the sequence length.

    ``delta_rule`` over a sequence equals these steps run token by token from the
    same initial state, outputs and state.

    Args:
      q: this token's query ``[b, h, dk]``.
      k: this token's key ``[b, h, dk]``.
      v: this token's value ``[b, h, dv]``.
      beta: this token's writing strength ``[b, h]``.
      state: the state after the previous token (``init_delta_state`` before the first).
      gate: this token's log-decay, ``[b, h]`` or per key channel ``[b, h, dk]``.
      scale: multiplies q.

    Returns:
      ``(out [b, h, dv] in the dtype of v, new float32 state)``.

    Raises:
      ValueError: on mismatched shapes, a bad beta, gate or state.
    """
    b, h, dk = checks.check_step_qkv(q, k, v)
    _check_beta(beta, (b, h), "[batch, heads]")
    dtype = feature_maps.accumulation_dtype(q.dtype)
    a = None
    if gate is not None:
        if not hasattr(gate, "shape") or tuple(gate.shape) not in ((b, h), (b, h, dk)):
            raise ValueError(
                f"gate must have shape [batch, heads]={(b, h)} or [batch, heads, key_dim]="
                f"{(b, h, dk)}, got {getattr(gate, 'shape', type(gate).__name__)}"
            )
        g = checks.log_decay(None, gate[:, None], b, 1, h, dtype, channels=dk)
        a = jnp.exp(g[:, :, 0])  # exp(-inf) = 0 is a full reset
    s = _state_in(state, b, h, dk, v.shape[-1], dtype)
    x = (q * scale, k, v, beta, a)
    s, out = _token_step(s, tuple(None if y is None else y.astype(dtype) for y in x))
    return out.astype(v.dtype), DeltaRuleState(s)


# ----------------------------------------------------------------------------
# The recurrence. Internal layout: [b, h, t, .] (heads first), beta [b, h, t],
# log-decays [b, h, t, 1|dk] (-inf: a reset) and segment resets [b, 1, t, 1].
# ----------------------------------------------------------------------------


def _token_step(s: Array, x) -> tuple[Array, Array]:
    """``S = a S; S += k (beta (v - S^T k))^T; o = S^T q`` for one token of every (b, h)."""
    q, k, v, beta, a = x  # [b,h,dk], [b,h,dk], [b,h,dv], [b,h], [b,h,1|dk] | None
    if a is not None:
        s = a[..., None] * s
    u = beta[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., :, None] * u[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q)


def _scan_body(s: Array, x) -> tuple[Array, Array]:
    """One block of tokens, one ``lax.scan`` step each (the reference recurrence)."""
    q, k, v, beta, g, r = x
    a = chunking.token_decays(g, r, q.shape[:3], q.dtype)
    seq = functools.partial(jnp.moveaxis, source=2, destination=0)
    a = None if a is None else seq(a)
    s, out = jax.lax.scan(_token_step, s, (seq(q), seq(k), seq(v), seq(beta), a))
    return s, jnp.moveaxis(out, 0, 2)


def _chunk_body(s: Array, x, *, dtype=None) -> tuple[Array, Array]:
    """One chunk of c tokens through the (gated) UT transform.

    Args:
      s: ``[b, h, dk, dv]`` before the chunk.
      x: ``(q [b,h,c,dk], k [b,h,c,dk], v [b,h,c,dv], beta [b,h,c],
        log-decay [b,h,c,1|dk] | None, segment resets | None)``.
      dtype: the operand dtype of the products that make the output only
        (``chunking.operand_dtype``; None: no cast).

    Returns:
      ``(state after the chunk, out [b, h, c, dv])``.
    """
    q, k, v, beta, g, r = x
    dv = v.shape[-1]
    dec = chunking.decays(g, r, q.shape[:3], q.dtype)
    qk = chunking.decayed_scores(q, k, dec, diagonal=True, dtype=dtype)
    kk = chunking.decayed_scores(k, k, dec, diagonal=False)  # float32: it feeds the solve
    if dec is None:
        q_in, k_in, k_out, s_carried = q, k, k, s
    else:
        q_in, k_in, k_out = q * dec.into, k * dec.into, k * dec.out_of
        s_carried = dec.across[..., None] * s
    # (I + diag(beta) KK) [U | W] = diag(beta) [V | K_in], in float32 (the inputs are
    # float32 here whatever the caller's dtype).
    rhs = beta[..., None] * jnp.concatenate([v, k_in], axis=-1)
    uw = unit_lower_solve(beta[..., None] * kk, rhs)
    u, w = uw[..., :dv], uw[..., dv:]
    # Each token's write, given the state: float32 operands (it reaches the next state).
    u = u - jnp.einsum("bhck,bhkv->bhcv", w, s)
    mixed = functools.partial(chunking.einsum, dtype=dtype)
    out = mixed("bhck,bhkv->bhcv", q_in, s) + mixed("bhij,bhjv->bhiv", qk, u)
    return s_carried + jnp.einsum("bhck,bhcv->bhkv", k_out, u), out


def unit_lower_solve(lower: Array, rhs: Array, block: int = 16) -> Array:
    """``(I + lower)^{-1} rhs`` for strictly lower-triangular ``lower [..., c, c]``.

    Forward substitution over blocks of ``block`` rows; inside a block, ``N = -L``
    is nilpotent (``N^block = 0``), so its inverse is the finite series
    ``I + N + ... = (I + N)(I + N^2)(I + N^4)...``: batched matmuls only, no
    sequential loop over rows. (XLA's CPU triangular solve was two orders of
    magnitude slower on these small batched systems; GPUs and TPUs prefer
    matmuls too.)
    """
    c = lower.shape[-1]
    n = -(-c // block)
    if n > 1 and n * block != c:
        pad = n * block - c
        lower = jnp.pad(lower, [(0, 0)] * (lower.ndim - 2) + [(0, pad), (0, pad)])
        rhs = jnp.pad(rhs, [(0, 0)] * (rhs.ndim - 2) + [(0, pad), (0, 0)])
        return unit_lower_solve(lower, rhs, block)[..., :c, :]
    size = min(block, c)
    solved = []
    for i in range(n):
        rows = slice(i * size, (i + 1) * size)
        r = rhs[..., rows, :]
        if i:
            r = r - lower[..., rows, : i * size] @ jnp.concatenate(solved, axis=-2)
        solved.append(_series_solve(lower[..., rows, rows], r))
    return jnp.concatenate(solved, axis=-2)


def _series_solve(lower: Array, rhs: Array) -> Array:
    """``(I + lower)^{-1} rhs`` by the product series of the nilpotent ``-lower``."""
    c = lower.shape[-1]
    power, out = -lower, rhs
    while True:
        out = out + power @ out  # the factors commute: apply each to rhs in turn
        c = (c + 1) // 2
        if c <= 1:
            return out
        power = power @ power


# ----------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------


def _check_beta(beta, shape: tuple[int, ...], layout: str, key_mask=None) -> None:
    """Shape and dtype always; the range [0, 2] of real tokens' values when concrete."""
    checks.check_shape("beta", beta, shape, layout)
    checks.check_float(("beta", beta))
    if checks.is_concrete(beta) and checks.is_concrete(key_mask) and beta.size:
        beta = np.asarray(beta)
        if key_mask is not None:
            beta = np.where(np.asarray(key_mask)[..., None], beta, 0.0)
        lo, hi = float(np.min(beta)), float(np.max(beta))
        if not (lo >= 0.0 and hi <= 2.0):
            raise ValueError(f"beta must lie in [0, 2], got values in [{lo}, {hi}]")


def _state_in(state: DeltaRuleState | None, b: int, h: int, dk: int, dv: int, dtype) -> Array:
    if state is None:
        return jnp.zeros((b, h, dk, dv), dtype)
    if not isinstance(state, DeltaRuleState):
        raise ValueError(f"state must be a DeltaRuleState, got {type(state).__name__}")
    checks.check_shape("state.s", state.s, (b, h, dk, dv), "[batch, heads, key_dim, value_dim]")
    return state.s.astype(dtype)
