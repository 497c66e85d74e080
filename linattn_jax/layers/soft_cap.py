"""Softmax attention whose scores are soft-capped, ``cap * tanh(scores / cap)`` before the
mask and the softmax (Gemma 2's ``attn_logit_softcapping``): ``jax.nn.dot_product_attention``'s
call, which has no cap, written out when a cap is given."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def check_soft_cap(name: str, cap) -> float | None:
    """``cap`` as a float > 0, or None; else a ValueError naming ``name``."""
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < math.inf:
        raise ValueError(f"{name} must be None or a finite number > 0, got {cap!r}")
    return float(cap)


# One program when called eagerly (``jax.nn.dot_product_attention`` alone is a dozen);
# inlined into a caller's jitted program.
@functools.partial(jax.jit, static_argnames=("is_causal", "local_window_size", "scale", "soft_cap"))
def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    local_window_size: tuple[int, int] | None = None,
    scale: float | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """``jax.nn.dot_product_attention(q, k, v, mask=..., is_causal=..., local_window_size=...,
    scale=...)`` with the scores ``soft_cap * tanh(scores / soft_cap)`` (None: uncapped).

    Args:
      q: ``[b, t, h, d]``.
      k: ``[b, s, kv, d]`` (``kv`` dividing ``h``: grouped queries).
      v: ``[b, s, kv, dv]``.
      mask: None, or bool broadcasting to ``[b, 1, t, s]`` (True: attend).
      is_causal: query ``i`` sees keys ``j <= i``.
      local_window_size: ``(left, right)``: query ``i`` sees keys ``i - left .. i + right``.
      scale: the scores' factor (None: ``d ** -0.5``).
      soft_cap: the cap, or None.

    Returns:
      ``[b, t, h, dv]`` in ``q``'s dtype.
    """
    if soft_cap is None:
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=is_causal, local_window_size=local_window_size,
            scale=scale,
        )  # fmt: skip
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    grouped = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btgrd,bsgd->bgrts", grouped, k, preferred_element_type=jnp.float32)
    scores = soft_cap * jnp.tanh(scores * scale / soft_cap)
    near = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]  # query index minus key index
    allowed = jnp.ones((t, s), bool) if not is_causal else near >= 0
    if local_window_size is not None:
        left, right = local_window_size
        allowed = allowed & (near <= left) & (-near <= right)
    allowed = allowed[None, None, None]
    if mask is not None:  # [b, 1, t | 1, s]: the same for every head
        allowed = allowed & jnp.asarray(mask, bool)[:, :, None]
    # A row with no key allowed (padding) gets finite weights; its output is replaced later.
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", weights, v)
    return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype)
