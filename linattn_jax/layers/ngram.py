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

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers.blocks import TransformerBlock
from linattn_jax.layers.norms import RMSNorm

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


def bits(value: Sequence[jax.Array], low: int, width: int) -> jax.Array:
    """Bits ``[low, low + width)`` (``width <= 16``) of the 64-bit ``value`` (four 16-bit
    limbs)."""
    i, shift = divmod(low, LIMB)
    out = value[i] >> shift
    if shift + width > LIMB:
        out = out | (value[i + 1] << (LIMB - shift))
    return out & ((1 << width) - 1)


def remainder(value: Sequence[jax.Array], moduli: Sequence[int]) -> jax.Array:
    """The 64-bit ``value`` (four 16-bit limbs ``[...]``) mod each of ``moduli`` (``k``
    Python ints in ``[1, 2**31]``): ``[..., k]``, by chunks of bits small enough that no
    step overflows 32 bits."""
    step = 32 - (max(moduli) - 1).bit_length()  # (p - 1) * 2**step + rest < 2**32
    step = max(1, min(step, LIMB))
    moduli = jnp.asarray(moduli, jnp.uint32).reshape((1,) * value[0].ndim + (-1,))
    r = jnp.zeros(value[0].shape + moduli.shape[-1:], jnp.uint32)
    top = 4 * LIMB
    while top > 0:
        width = min(step, top)
        r = ((r << width) | bits(value, top - width, width)[..., None]) % moduli
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


class NGramState(NamedTuple):
    """``PerLayerNGrams``' decoding state: the last ``N - 1`` token ids ``[b, N - 1]``
    (``eos`` at first) and the convolution's last ``(K - 1) N`` inputs ``[b, (K-1) N, n d]``
    (float32)."""

    context: jax.Array
    conv: jax.Array


class PerLayerNGrams(nnx.Module):
    """Qwen4-Exp's per-layer n-gram embeddings (``Qwen4ExpTextPLELayer``): hashed n-gram
    rows (``ngram_ids``) gate a value into each of the ``n`` residual streams, and a
    dilated causal convolution adds their local context; the output is added to the
    streams.

    With ``e [b, t, E]`` the rows' features (``E = heads * head_dim``), ``x [b, t, n, d]``
    the streams and every norm zero-centred, per stream (``layers.RMSNorm(group_size=d)``):
    ``gate_i = sgn(a_i) sqrt(max(|a_i|, 1e-6))``, ``a_i = <norm_key(key_proj e)_i,
    norm_query(x)_i> / sqrt(d)``; ``v_i = sigmoid(gate_i) value_proj(e)``; the output is
    ``v + silu(conv(norm_conv(v)))``, the depthwise convolution of ``K`` taps ``N`` tokens
    apart (``N = ngram_size``) over the ``n d`` channels. Padded tokens read as ``eos`` and
    add nothing to the convolution.

    Args:
      width: ``d``.
      streams: ``n``.
      multipliers: the layer's ``N`` hash multipliers (Python ints).
      sizes: each head's prime table size; ``offsets``: its first row.
      heads_per_ngram: heads of each order ``2..N``.
      head_dim: each head's row width.
      rows: the table's rows (``sum(sizes)`` or more, padded).
      eos: the token closing segments (and filling the context).
      conv_size: ``K``.
      rngs: as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
    """

    def __init__(
        self, width: int, streams: int, *, multipliers: Sequence[int], sizes: Sequence[int],
        offsets: Sequence[int], heads_per_ngram: int, head_dim: int, rows: int, eos: int,
        conv_size: int, rngs: nnx.Rngs, param_dtype: Any = jnp.float32,
    ):  # fmt: skip
        self.width, self.streams, self.eos = width, streams, eos
        self.multipliers, self.sizes, self.offsets = (
            tuple(multipliers),
            tuple(sizes),
            tuple(offsets),
        )
        self.heads_per_ngram, self.conv_size = heads_per_ngram, conv_size
        features, full = len(sizes) * head_dim, streams * width
        options = dict(use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.table = nnx.Embed(rows, head_dim, param_dtype=param_dtype, rngs=rngs)
        self.key_proj = nnx.Linear(features, full, **options)
        self.value_proj = nnx.Linear(features, width, **options)
        norm = lambda: RMSNorm(full, group_size=width, zero_centred=True, rngs=rngs)
        self.norm_key, self.norm_query, self.norm_conv = norm(), norm(), norm()
        self.conv = nnx.Param(jnp.zeros((conv_size, full), param_dtype))

    @property
    def past(self) -> int:
        """The convolution's window before the current token, ``(K - 1) N``."""
        return (self.conv_size - 1) * len(self.multipliers)

    def init_state(self, batch: int) -> NGramState:
        context = jnp.full((batch, len(self.multipliers) - 1), self.eos, jnp.int32)
        return NGramState(context, jnp.zeros((batch, self.past, self.streams * self.width)))

    def __call__(self, x, tokens, *, key_mask=None, state=None):
        """``(out [b, t, n, d], the new state)`` of the streams ``x [b, t, n, d]`` and
        ``tokens [b, t]`` (from ``state``, or a fresh one)."""
        b, t = tokens.shape
        state = self.init_state(b) if state is None else state
        tokens = tokens.astype(jnp.int32)
        if key_mask is not None:
            tokens = jnp.where(key_mask, tokens, self.eos)
        history = jnp.concatenate([state.context, tokens], axis=1)
        rows = ngram_ids(
            history, self.multipliers, self.sizes, self.offsets, self.heads_per_ngram, self.eos
        )[:, -t:]
        e = self.table(rows).reshape(b, t, -1).astype(jnp.float32)
        key = self.norm_key(self.key_proj(e)).reshape(b, t, self.streams, self.width)
        query = self.norm_query(x.reshape(b, t, -1)).reshape(key.shape)
        a = jnp.sum(key * query, axis=-1, keepdims=True) / jnp.sqrt(self.width)
        gate = jnp.sign(a) * jnp.sqrt(jnp.maximum(jnp.abs(a), 1e-6))
        v = (jax.nn.sigmoid(gate) * self.value_proj(e)[:, :, None, :]).reshape(b, t, -1)
        normed = self.norm_conv(v)
        if key_mask is not None:
            keep = key_mask[..., None]
            v, normed = jnp.where(keep, v, 0.0), jnp.where(keep, normed, 0.0)
        window = jnp.concatenate([state.conv, normed.astype(jnp.float32)], axis=1)
        step = len(self.multipliers)
        w = self.conv[...].astype(jnp.float32)
        conv = sum(
            window[:, k * step : k * step + t] * w[k][None, None] for k in range(self.conv_size)
        )
        out = (v + jax.nn.silu(conv)).reshape(x.shape).astype(x.dtype)
        return out, NGramState(history[:, -(step - 1) :], window[:, -self.past :])


class NGramBlock(TransformerBlock):
    """A ``TransformerBlock`` on hyper-connections' streams that first adds its layer's
    n-gram embeddings (``PerLayerNGrams`` of the ``ngrams`` options) to the streams
    (Qwen4-Exp's PLE layers). Its state is ``(the block's, the n-grams')``; it reads the
    tokens (``tokens [b, t]``), so the models pass them on. Options: ``TransformerBlock``'s,
    ``hyper_connections`` given, and ``ngrams``."""

    def __init__(self, width: int, num_heads: int, *, ngrams: Mapping[str, Any], **options):
        if options.get("hyper_connections") is None:
            raise ValueError("ngrams need hyper_connections (the streams they are added to)")
        super().__init__(width, num_heads, **options)
        streams = options["hyper_connections"]["streams"]
        self.ngrams = PerLayerNGrams(
            width, streams, **ngrams, rngs=options["rngs"],
            param_dtype=options.get("param_dtype", jnp.float32),
        )  # fmt: skip

    def init_state(self, batch: int, max_length: int | None = None):
        return super().init_state(batch, max_length), self.ngrams.init_state(batch)

    def __call__(self, x, *, tokens, key_mask=None, segment_ids=None, state=None, **options):
        """``TransformerBlock``'s call after ``x + ngrams(x, tokens)``; no ``segment_ids``."""
        if segment_ids is not None:
            raise ValueError("an n-gram block takes no segment_ids (its n-grams would cross)")
        block, own = (None, None) if state is None else state
        h, own = self.ngrams(x, tokens, key_mask=key_mask, state=own)
        out = super().__call__(x + h, key_mask=key_mask, state=block, **options)
        if options.get("return_state"):
            return out[0], (out[1], own)
        return out
