"""Hashed n-gram ids (Qwen4-Exp's per-layer n-gram embeddings, PLE), computed exactly in
32-bit integers.

For the token history ``x [b, T]`` (int, ``0 <= x < 2**31``) and ``N = ngram_size``,
``s_j = shift(x, j)`` is ``x`` shifted right by ``j`` within the segments that ``eos``
closes (a token of a segment that has fewer than ``j`` tokens before it reads ``eos``).
The ``n``-gram (``2 <= n <= N``) hash is the 64-bit ``h_n = xor_{j < n} (s_j * m_j)``
(``m_j`` the layer's odd multipliers, ``s_j * m_j < 2**63``), and head ``k`` of order ``n``
reads row ``h_n mod p_k + o_k`` of the layer's table (``p_k`` its prime size, ``o_k`` its
offset). ``transformers`` computes this in int64; here each 64-bit value is four 16-bit
limbs in ``uint32`` (products of 16-bit limbs fit, XOR is limb-wise) and the remainder is
Horner's rule over chunks small enough that ``r * 2**c + chunk`` fits 32 bits, so the ids
are the same without ``jax_enable_x64``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

LIMB = 16
MASK = (1 << LIMB) - 1


def shift_in_segments(x: jax.Array, shift: int, eos: int) -> jax.Array:
    """``x [b, T]`` shifted right by ``shift`` within the segments ``eos`` closes (an
    ``eos`` token ends its segment), ``eos`` where a token has fewer than ``shift`` tokens
    of its segment before it."""
    if shift == 0:
        return x
    positions = jnp.arange(x.shape[1])[None]
    closes = jnp.where(x == eos, positions, -1)
    last = jax.lax.cummax(closes, axis=1)  # the last eos at or before each position
    before = jnp.pad(last[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    in_segment = positions - (before + 1)
    shifted = jnp.pad(x, ((0, 0), (shift, 0)), constant_values=eos)[:, : x.shape[1]]
    return jnp.where(in_segment >= shift, shifted, eos)


def limbs(value: int) -> tuple[int, int, int, int]:
    """A 64-bit ``value``'s four 16-bit limbs, least significant first."""
    return tuple((value >> (LIMB * i)) & MASK for i in range(4))


def times(x: jax.Array, multiplier: int) -> list[jax.Array]:
    """``x * multiplier`` mod ``2**64`` as four ``uint32`` limbs of 16 bits (``x`` int in
    ``[0, 2**31)``)."""
    x = x.astype(jnp.uint32)
    parts = (x & MASK, x >> LIMB)
    columns = [jnp.zeros_like(x) for _ in range(5)]
    for i, part in enumerate(parts):
        for j, c in enumerate(limbs(multiplier)):
            if i + j < 4 and c:
                product = part * jnp.uint32(c)  # < 2**32: both factors < 2**16
                columns[i + j] = columns[i + j] + (product & MASK)
                columns[i + j + 1] = columns[i + j + 1] + (product >> LIMB)
    out, carry = [], jnp.zeros_like(x)
    for column in columns[:4]:
        total = column + carry  # a few 16-bit terms: far below 2**32
        out.append(total & MASK)
        carry = total >> LIMB
    return out


def remainder(value: Sequence[jax.Array], moduli: Sequence[int]) -> jax.Array:
    """The 64-bit ``value`` (four 16-bit limbs ``[...]``) mod each of ``moduli`` (``k``
    Python ints in ``[1, 2**31]``): ``[..., k]``, by chunks of bits small enough that no
    step overflows 32 bits."""
    step = 32 - (max(moduli) - 1).bit_length()  # (p - 1) * 2**step + rest < 2**32
    step = max(1, min(step, LIMB))
    moduli = jnp.asarray(moduli, jnp.uint32).reshape((1,) * value[0].ndim + (-1,))
    bits = [(limb[..., None] >> i) & 1 for limb in value for i in range(LIMB)]  # low first
    r = jnp.zeros(value[0].shape + moduli.shape[-1:], jnp.uint32)
    top = 4 * LIMB
    while top > 0:
        width = min(step, top)
        chunk = sum(bits[top - width + i] << i for i in range(width))
        r = ((r << width) | chunk) % moduli
        top -= width
    return r


def ngram_ids(
    x: jax.Array,
    multipliers: Sequence[int],
    sizes: Sequence[int],
    offsets: Sequence[int],
    heads_per_ngram: int,
    eos: int,
) -> jax.Array:
    """The table rows ``[b, T, (N - 1) * heads_per_ngram]`` (int32) of the token history
    ``x [b, T]``: for each order ``n = 2..N`` in turn, its ``heads_per_ngram`` heads (the
    module docstring's maths; ``N = len(multipliers)``, ``sizes`` and ``offsets`` per
    head)."""
    shifted = [shift_in_segments(x, j, eos) for j in range(len(multipliers))]
    products = [times(s, m) for s, m in zip(shifted, multipliers, strict=True)]
    out, mixed = [], products[0]
    for n in range(2, len(multipliers) + 1):
        mixed = [a ^ b for a, b in zip(mixed, products[n - 1], strict=True)]
        heads = slice((n - 2) * heads_per_ngram, (n - 1) * heads_per_ngram)
        rows = remainder(mixed, list(sizes[heads]))
        out.append(rows + jnp.asarray(offsets[heads], jnp.uint32)[None, None])
    return jnp.concatenate(out, axis=-1).astype(jnp.int32)
