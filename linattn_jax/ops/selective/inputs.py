"""The selective scan's inputs: checks, the log-decays, padding and non-finite tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from linattn_jax.ops import checks, chunking, feature_maps


def check(x, dt, A, B, C, D, *, step: bool) -> tuple[int, int, int]:
    """Validates the inputs (``step``: one token, no length axis); returns ``(b, d, n)``."""
    lead = "[batch" if step else "[batch, length"
    rank = 2 if step else 3
    checks.check_rank("x", x, rank, f"{lead}, channels]")
    checks.check_rank("B", B, rank, f"{lead}, state_dim]")
    checks.check_float(("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C))
    checks.check_shape("dt", dt, x.shape, f"{lead}, channels]")
    checks.check_shape("C", C, B.shape, f"{lead}, state_dim]")
    if tuple(B.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(f"B and C must have the batch (and length) of x {x.shape}, got {B.shape}")
    d, n = x.shape[-1], B.shape[-1]
    checks.check_shape("A", A, (d, n), "[channels, state_dim]")
    if D is not None:
        checks.check_float(("D", D))
        checks.check_shape("D", D, (d,), "[channels]")
    if checks.is_concrete(A) and np.any(np.asarray(A) > 0):
        raise ValueError(f"A must be <= 0 (A = -exp(A_log)), got a maximum of {np.max(A)}")
    return x.shape[0], d, n


def log_decay(dt, A):
    """``dt A`` as ``[..., d, n]`` from ``dt [..., d]`` and ``A [d, n]``: the log of each
    token's decay. ``dt = 0`` (padding) is no decay even where ``A = -inf`` (0 * -inf is
    NaN); the double ``where`` keeps the gradients finite there."""
    A = A.reshape((1,) * (dt.ndim - 1) + A.shape)
    infinite = jnp.isneginf(A)
    gate = dt[..., None] * jnp.where(infinite, 0.0, A)
    return jnp.where(infinite & (dt[..., None] > 0), -jnp.inf, gate)


def operands(x, dt, A, B, C, key_mask):
    """``(u = dt x, dt, A, B, C, first spoilt token [b, 1, d])`` in the accumulation dtype
    (B and C in their own).

    Padding (``key_mask`` False) is replaced, never multiplied, by zeros first: ``dt = 0``
    and ``u = 0`` leave the state untouched. Then a real token whose ``x`` or ``dt`` (in a
    channel) or ``B`` (in any) is not finite has them replaced by zeros, so the chunks'
    masked matmuls never meet ``0 * NaN``; ``spoil`` sets what the per-token recurrence
    makes NaN (that channel's outputs from the token on, and its state). A non-finite
    ``C`` reaches only its own token's outputs.
    """
    dtype = feature_maps.accumulation_dtype(x.dtype)
    x, dt, B, C = (checks.where_token(key_mask, y) for y in (x, dt, B, C))
    x, dt = x.astype(dtype), dt.astype(dtype)
    good_b = jnp.all(jnp.isfinite(B), axis=-1, keepdims=True)
    ok = jnp.isfinite(x) & jnp.isfinite(dt) & good_b
    x, dt = (jnp.where(ok, y, 0.0) for y in (x, dt))
    B = jnp.where(good_b, B, jnp.zeros((), B.dtype))
    return dt * x, dt, A.astype(dtype), B, C, chunking.first_index(~ok, 1)


def finish(y, x, D, first, h, key_mask):
    """``y + D x`` (nothing when D is None), NaN from each channel's first spoilt token on
    (``operands``) in the outputs ``[b, t, d]`` and the final state ``h [b, d, n]``, then
    zeros at the padding."""
    if D is not None:
        y = y + D.astype(y.dtype)[None, None] * checks.where_token(key_mask, x).astype(y.dtype)
    y = checks.where_token(key_mask, chunking.nan_from(first, y, 1))
    bad = first[:, 0] < y.shape[1]  # [b, d]
    return y, jnp.where(bad[..., None], jnp.full((), jnp.nan, h.dtype), h)
