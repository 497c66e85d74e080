"""Rotary position embeddings (RoPE; Su et al. 2021), full or partial, and the positions
they read: restarting at every segment of a packed row, counting only real tokens, and
continuing from a KV cache's length when decoding.

The rotation is the "rotate half" form of GPT-NeoX, Llama and Qwen: the first
``rotary_dim`` channels of a head are two halves ``(x1, x2)`` rotated pairwise,
``(x1 cos - x2 sin, x2 cos + x1 sin)`` at angles ``position * theta^(-2i / rotary_dim)``;
the other channels pass unchanged (partial RoPE, Qwen3-Next's ``partial_rotary_factor``).
The frequencies may be scaled as released long-context configs do (``layers.rope_scaling``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linattn_jax.layers import rope_scaling
from linattn_jax.ops import checks


def rotary_dim(head_dim: int, partial_rotary_factor: float | None, rotary_dim: int | None) -> int:
    """The rotated channels per head: ``rotary_dim``, or ``int(head_dim * factor)``
    (HF's rule), or all of them.

    Raises:
      ValueError: both given, a factor outside (0, 1], or a size that is odd, below 2 or
        above ``head_dim``.
    """
    if rotary_dim is not None and partial_rotary_factor is not None:
        raise ValueError(
            f"give rotary_dim or partial_rotary_factor, not both; got rotary_dim={rotary_dim} "
            f"and partial_rotary_factor={partial_rotary_factor}"
        )
    if partial_rotary_factor is not None:
        factor = partial_rotary_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
        rotary_dim = int(head_dim * factor)
    elif rotary_dim is None:
        rotary_dim = head_dim
    checks.check_int("rotary_dim", rotary_dim, 2)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim must be even and at most head_dim={head_dim}, got {rotary_dim}"
        )
    return rotary_dim


# Each one program when called eagerly; inlined into a caller's jitted program.
@functools.partial(jax.jit, static_argnames=("rotary_dim", "theta", "scaling"))
def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    rotary_dim: int,
    theta: float,
    scaling: rope_scaling.RopeScaling | None = None,
) -> jax.Array:
    """``x [b, t, h, d]`` with its first ``rotary_dim`` channels rotated by ``positions
    [b, t]`` (int), in float32, returned in ``x``'s dtype; ``scaling`` (``rope_scaling``;
    None: none) sets the frequencies and the cosines' and sines' factor."""
    half = rotary_dim // 2
    seq_len = None
    if scaling is not None and scaling.rope_type == "dynamic":
        seq_len = jnp.max(positions) + 1
    inv_freq = rope_scaling.inverse_frequencies(scaling, rotary_dim, theta, seq_len)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None]  # [b, t, half]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    if scaling is not None and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    y = x.astype(jnp.float32)
    x1, x2, rest = y[..., :half], y[..., half:rotary_dim], y[..., rotary_dim:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return rotated.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("b", "t"))
def token_positions(
    b: int,
    t: int,
    *,
    key_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    start: jax.Array | None = None,
) -> jax.Array:
    """Each token's position ``[b, t]`` int32: the real tokens before it in its segment,
    plus ``start [b]`` (the real tokens a KV cache holds already; 0 when None).

    A left-padded row's first real token is at 0, as alone; a packed row's segments each
    starts at 0 (``segment_ids``). A padded token gets the position of the next real one
    (it is masked anyway).
    """
    real = jnp.ones((b, t), jnp.int32) if key_mask is None else key_mask.astype(jnp.int32)
    before = jnp.cumsum(real, axis=1) - real  # real tokens before each token in the row
    if segment_ids is not None:
        change = jnp.concatenate(
            [jnp.zeros((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
        )
        # ``before`` is non-decreasing: its running max at segment starts is the count at
        # the start of each token's segment.
        before = before - jax.lax.cummax(jnp.where(change, before, 0), axis=1)
    return before if start is None else before + start[:, None]
