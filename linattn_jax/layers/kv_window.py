"""Sliding-window attention over a KV cache that holds the window only: a ring buffer.

A layer whose queries see themselves and the ``window - 1`` tokens before them needs, to
decode, the last ``window - 1`` keys and values, whatever the length so far. The cache's
``n`` slots (``n = window``, or fewer for a short run, which then may not wrap) hold token
``a`` (counting every token written, padding too) at slot ``a mod n``; a call attends over
the cache's slots and its own tokens, then writes its last ``min(t, n)`` tokens over the
oldest. So a prefill longer than the window, then steps, is the full forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.layers import soft_cap


def slot_tokens(position: jax.Array, n: int) -> jax.Array:
    """``[b, n]`` int32: the token each of ``n`` ring slots holds after ``position [b]``
    tokens were written (negative where none was)."""
    last = position[:, None] - 1
    return last - jnp.mod(last - jnp.arange(n, dtype=jnp.int32)[None, :], n)


def write_ring(cache: jax.Array, new: jax.Array, position: jax.Array) -> jax.Array:
    """``cache [b, n, ...]`` with the last ``min(t, n)`` of ``new [b, t, ...]`` (tokens
    ``position [b]`` on) written at their slots (distinct: no two writes to one slot)."""
    n, t = cache.shape[1], new.shape[1]
    m = min(t, n)
    slots = jnp.mod(position[:, None] + (t - m) + jnp.arange(m, dtype=jnp.int32)[None, :], n)
    write = jax.vmap(lambda c, x, i: c.at[i].set(x.astype(c.dtype)))
    return write(cache, new[:, t - m :], slots)


def attend_window(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    real: jax.Array,
    cache: tuple[jax.Array, jax.Array, jax.Array],
    position: jax.Array,
    window: int,
    scale: float | None,
    cap: float | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """Windowed causal attention of this call's tokens over a ring cache and themselves.

    Args:
      q: ``[b, t, h, d]`` queries (after RoPE), float32.
      k: ``[b, t, kv, d]`` this call's keys (after RoPE).
      v: ``[b, t, kv, d]`` this call's values.
      real: ``[b, t]`` bool, False at padding (no key for any query, now or later).
      cache: the ring's ``(k [b, n, kv, d], v [b, n, kv, d], mask [b, n] bool)``.
      position: ``[b]`` int32, the tokens written before this call.
      window: a query sees itself and the ``window - 1`` tokens before it.
      scale: the scores' factor (None: ``d ** -0.5``).
      cap: the scores' soft cap (``layers.soft_cap``), or None.

    Returns:
      ``(out [b, t, h, d] float32, the new (k, v, mask))``.
    """
    cache_k, cache_v, cache_mask = cache
    n, t = cache_k.shape[1], q.shape[1]
    query = position[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [b, t]
    keys = jnp.concatenate([slot_tokens(position, n), query], axis=1)  # [b, n + t]
    held = jnp.concatenate([cache_mask, real], axis=1)
    near = query[:, :, None] - keys[:, None, :]  # how far back each key is from each query
    allowed = (near >= 0) & (near < window) & held[:, None, :]
    f32 = lambda a: a.astype(jnp.float32)
    k_all = jnp.concatenate([f32(cache_k), f32(k)], axis=1)
    v_all = jnp.concatenate([f32(cache_v), f32(v)], axis=1)
    out = soft_cap.dot_product_attention(
        q, k_all, v_all, mask=allowed[:, None], scale=scale, soft_cap=cap
    )
    new = tuple(write_ring(c, x, position) for c, x in [(cache_k, k), (cache_v, v)])
    return out, (*new, write_ring(cache_mask, real, position))
