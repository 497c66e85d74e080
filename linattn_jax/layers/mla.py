"""Multi-head Latent Attention (MLA; DeepSeek-V2, DeepSeek-V3, Kimi Linear): softmax
attention whose keys and values are decompressed from one low-rank latent per token, the
latent (and a small rope key the heads share) being all its KV cache keeps.

Reference: DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model" (https://arxiv.org/abs/2405.04434).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers import rope as rope_lib
from linattn_jax.layers.common import (
    check_can_decode,
    check_decoding,
    check_dropout_rate,
    check_head_dim,
    check_state,
    check_tokens,
    positions,
    projection,
    split_heads,
)
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.layers.softmax import (
    LINEAR_ONLY_OPTIONS,
    check_cache_room,
    check_flags,
    check_rope,
    write_slots,
)
from linattn_jax.ops import checks


class LatentKVCache(NamedTuple):
    """A ``LatentAttention`` layer's decoding state: per token, the compressed latent and
    the one rope key its heads share, ``kv_lora_rank + qk_rope_head_dim`` floats (not
    ``2 * num_heads * head_dim``: the point of MLA).

    Attributes:
      latent: ``[b, max_length, kv_lora_rank]``, after its RMSNorm.
      k_rope: ``[b, max_length, qk_rope_head_dim]``, after RoPE (when the layer has it).
      position: ``[b]`` int32, the number of tokens written (the next slot).
      mask: ``[b, max_length]`` bool, True at slots holding a real key (as ``KVCache``'s).
    """

    latent: jax.Array
    k_rope: jax.Array
    position: jax.Array
    mask: jax.Array


class LatentAttention(nnx.Module):
    """Multi-head Latent Attention (MLA; DeepSeek-V2, 2024; DeepSeek-V3, Kimi Linear): keys
    and values decompressed from one low-rank latent per token, which is all the KV cache
    keeps (with a small rope key shared by the heads).

    Per token ``x`` (``r = kv_lora_rank``, ``n, p, dv`` the nope, rope and value head dims)::

        q            = W_qb RMSNorm(W_qa x)   (q_lora_rank; else W_q x)   # [h, n + p]
        [c | k_rope] = W_kva x                                          # [r + p]
        c            = RMSNorm(c)                                       # the latent
        [k_nope | v] = W_kvb c                                          # [h, n + dv]
        k            = [k_nope | k_rope]   (k_rope the same for every head)
        y            = W_o softmax(q k^T * (n + p)^-0.5) v

    With ``rope=True`` the last ``p`` channels of q and ``k_rope`` are rotated
    (``layers.rope``'s rotate-half form; positions as ``SoftmaxAttention``'s: real tokens
    only, per segment, continuing from a cache). Kimi Linear's MLA has no RoPE
    (``rope=False``, the default). DeepSeek-V3 checkpoints rotate interleaved pairs
    (``rope_interleave``): ``hf.deepseek_v3`` permutes their rope rows as it loads them.

    Without a cache the latent is decompressed and attention is ordinary. With one
    (``init_state``: ``LatentKVCache``) the query is absorbed into ``W_kvb``'s key half and
    the scores are taken against the cached latents directly, the output decompressed by
    its value half after the softmax: the same function, never ``[h, n + dv]`` per cached
    token.

    Args:
      width: model width (input and output features).
      num_heads: heads h.
      kv_lora_rank: r, the latent's size (default ``4 * qk_nope_head_dim``).
      q_lora_rank: the query's low rank (``W_qa``, RMSNorm, ``W_qb``); None: one ``W_q``.
      qk_nope_head_dim: n, the channels of each q and k head without RoPE (default
        ``width / num_heads``).
      qk_rope_head_dim: p, the channels of each q head (and of the shared key) that RoPE
        rotates (default ``n / 2``).
      v_head_dim: dv, each value head's channels (default n).
      rope: rotary embeddings on the rope channels.
      rope_theta: RoPE's base (default 10000).
      rope_scaling: RoPE's frequencies scaled (``layers.rope_scaling``: DeepSeek-V3's
        ``yarn``); None: none.
      scale: the scores' factor (default ``(n + p)^-0.5``).
      causal: causal (decoder) or non-causal (encoder) attention.
      max_length: the KV cache's length (decoding only).
      dropout_rate: dropout on the attention's output, as in ``SoftmaxAttention``.
      head_gate: each head's output times ``sigmoid(W_g x)``, ``W_g [width, h]``
        (``g_proj``; Ling 3's MLA), before ``out_proj``.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's); scores and softmax in float32.
      param_dtype: the parameters' dtype, as in Flax.
      **linear_options: ``LINEAR_ONLY_OPTIONS``, accepted and ignored (as by
        ``SoftmaxAttention``); any other keyword raises ``TypeError``.

    Parameters: ``q_proj`` or ``q_a_proj``, ``q_a_norm``, ``q_b_proj``; ``kv_a_proj``
    ``[width, r + p]``, ``kv_norm``, ``kv_b_proj`` ``[r, h (n + dv)]``, ``out_proj``;
    ``g_proj`` ``[width, h]`` with ``head_gate``.
    The norms' epsilon is 1e-6 (``transformers``' DeepSeek-V3 and Kimi Linear latents).

    Raises:
      ValueError: a size that is not a positive int, a rope size that is odd with
        ``rope=True``, a RoPE option without ``rope=True``, a flag that is not a bool, a
        ``scale`` that is not a number > 0.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        kv_lora_rank: int | None = None,
        q_lora_rank: int | None = None,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
        rope: bool = False,
        rope_theta: float | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
        scale: float | None = None,
        causal: bool = True,
        max_length: int = 4096,
        dropout_rate: float = 0.0,
        head_gate: bool = False,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **linear_options: Any,
    ):
        unknown = sorted(set(linear_options) - LINEAR_ONLY_OPTIONS)
        if unknown:
            raise TypeError(f"LatentAttention got unexpected keyword arguments {unknown}")
        nope, rope_dim, dv, rank, rotary, scale = _check_options(
            width, num_heads, kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
            v_head_dim, rope, rope_theta, rope_scaling, scale, causal, dropout_rate,
        )  # fmt: skip
        self.rotary_dim, self.rope_theta, self.rope_scaling = rotary
        self.width, self.num_heads, self.scale = width, num_heads, scale
        self.causal, self.max_length = causal, max_length
        self.kv_lora_rank, self.q_lora_rank = rank, q_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = nope, rope_dim, dv
        linear = functools.partial(projection, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = lambda n: RMSNorm(n, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        embed, heads, h = sharding.EMBED, sharding.HEADS, num_heads
        qk = nope + rope_dim
        if q_lora_rank is None:
            self.q_proj = nnx.data(linear(width, h * qk, embed, heads))
            self.q_a_proj = self.q_a_norm = self.q_b_proj = nnx.data(None)
        else:
            self.q_proj = nnx.data(None)
            self.q_a_proj = nnx.data(linear(width, q_lora_rank, embed, None))
            self.q_a_norm = nnx.data(norm(q_lora_rank))
            self.q_b_proj = nnx.data(linear(q_lora_rank, h * qk, None, heads))
        self.kv_a_proj = linear(width, rank + rope_dim, embed, None)
        self.kv_norm = norm(rank)
        self.kv_b_proj = linear(rank, h * (nope + dv), None, heads)
        self.out_proj = linear(h * dv, width, heads, embed)
        if not isinstance(head_gate, bool):
            raise ValueError(f"head_gate must be True or False, got {head_gate!r}")
        self.g_proj = nnx.data(linear(width, h, embed, heads) if head_gate else None)
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    def init_state(self, batch: int, max_length: int | None = None) -> LatentKVCache:
        """An empty cache of ``max_length`` (the layer's by default) tokens."""
        check_can_decode(self)
        n = max_length or self.max_length
        return LatentKVCache(
            jnp.zeros((batch, n, self.kv_lora_rank)),
            jnp.zeros((batch, n, self.rope_dim)),
            jnp.zeros((batch,), jnp.int32),
            jnp.zeros((batch, n), jnp.bool_),
        )

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: LatentKVCache | None = None,
        return_state: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new cache if ``return_state``).

        ``key_mask [b, t]`` (True = real): padding is replaced by zeros before the
        projections, is no key for any query (nor, written to a cache, for any later one)
        and outputs 0 (then ``out_proj``). ``segment_ids [b, t]`` (no cache): a token
        attends within its run of equal ids only (``checks.segment_runs``), RoPE restarting
        there. ``state``, ``deterministic``, ``rngs`` as in ``SoftmaxAttention``.

        Raises:
          ValueError: as ``SoftmaxAttention``'s (a bad mask, ids with a cache, tokens that
            do not fit in the cache); rows that overflow under ``jit`` get NaN outputs.
        """
        check_decoding(self, state, return_state)
        check_tokens(x, self.width)
        check_state(state, LatentKVCache)
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        if segment_ids is not None:
            checks.check_segment_ids(segment_ids, b, t)
        x = checks.where_token(key_mask, x)
        dtype = x.dtype if self.kv_a_proj.dtype is None else self.kv_a_proj.dtype
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)).astype(dtype))
        q = split_heads(q, self.num_heads).astype(jnp.float32)  # [b, t, h, n + p]
        q_nope, q_rope = q[..., : self.nope_dim], q[..., self.nope_dim :]
        compressed = self.kv_a_proj(x).astype(jnp.float32)
        latent = self.kv_norm(compressed[..., : self.kv_lora_rank])  # [b, t, r]
        k_rope = compressed[..., self.kv_lora_rank :]  # [b, t, p]
        new_state = None
        if state is not None or return_state:
            if segment_ids is not None:
                raise ValueError("LatentAttention takes no segment_ids with a KV cache")
            out, new_state, overflow = attend_cached(
                self, q_nope, q_rope, latent, k_rope, key_mask, state
            )
            out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
        else:
            out = attend_full(self, q_nope, q_rope, latent, k_rope, key_mask, segment_ids)
        out = checks.where_token(key_mask, out)  # a padded query's output is 0
        if self.g_proj is not None:
            out = out * jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32))[..., None]
        out = self.dropout(out.astype(dtype), deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.num_heads * self.v_head_dim))
        return (y, new_state) if return_state else y


def _rope(layer, x, pos):
    if layer.rotary_dim is None:
        return x
    return rope_lib.apply_rope(x, pos, layer.rotary_dim, layer.rope_theta, layer.rope_scaling)


def _softmax(layer, scores, allowed):
    """``softmax(scores * scale)`` over the last axis where ``allowed``; rows with no
    key allowed (padding) get finite weights, their outputs replaced later."""
    scores = jnp.where(allowed, scores * layer.scale, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def attend_full(layer: LatentAttention, q_nope, q_rope, latent, k_rope, key_mask, segment_ids):
    """Decompressed, ordinary attention over this call's tokens: ``[b, t, h, dv]``."""
    b, t = latent.shape[:2]
    pos = rope_lib.token_positions(b, t, key_mask=key_mask, segment_ids=segment_ids)
    q_rope, k_rope = _rope(layer, q_rope, pos), _rope(layer, k_rope[:, :, None], pos)[:, :, 0]
    kv = split_heads(layer.kv_b_proj(latent), layer.num_heads)
    kv = kv.astype(jnp.float32)
    k_nope, v = kv[..., : layer.nope_dim], kv[..., layer.nope_dim :]
    scores = jnp.einsum("bthd,bshd->bhts", q_nope, k_nope)
    scores = scores + jnp.einsum("bthd,bsd->bhts", q_rope, k_rope)
    slots = jnp.arange(t)
    allowed = jnp.ones((b, 1, t, t), bool)
    if layer.causal:
        allowed = allowed & (slots[None, None, :, None] >= slots[None, None, None, :])
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    if segment_ids is not None:
        run = checks.segment_runs(segment_ids)
        allowed = allowed & (run[:, None, :, None] == run[:, None, None, :])
    return jnp.einsum("bhts,bshd->bthd", _softmax(layer, scores, allowed), v)


def attend_cached(layer: LatentAttention, q_nope, q_rope, latent, k_rope, key_mask, state):
    """Attention over the cache after writing this call's latents to it, the query
    absorbed into ``kv_b_proj``: ``(out [b, t, h, dv], the new cache, [b] overflow)``."""
    b, t = latent.shape[:2]
    if state is None:
        state = layer.init_state(b, max(t, layer.max_length))
    n = state.latent.shape[1]
    checks.check_shape(
        "state.latent", state.latent, (b, n, layer.kv_lora_rank),
        "[batch, max_length, kv_lora_rank]",
    )  # fmt: skip
    checks.check_shape(
        "state.k_rope", state.k_rope, (b, n, layer.rope_dim),
        "[batch, max_length, qk_rope_head_dim]",
    )  # fmt: skip
    overflow = check_cache_room(state.position, t, n)
    held = jnp.sum(state.mask, axis=1, dtype=jnp.int32)
    pos = rope_lib.token_positions(b, t, key_mask=key_mask, start=held)
    q_rope, k_rope = _rope(layer, q_rope, pos), _rope(layer, k_rope[:, :, None], pos)[:, :, 0]
    latents = write_slots(state.latent, latent, state.position)
    rope_keys = write_slots(state.k_rope, k_rope, state.position)
    real = jnp.ones((b, t), bool) if key_mask is None else key_mask
    mask = write_slots(state.mask, real, state.position)
    query_slot = positions(state.position, b, t)[:, None, :, None]  # [b, 1, t, 1]
    allowed = (jnp.arange(n)[None, None, None, :] <= query_slot) & mask[:, None, None, :]
    w = layer.kv_b_proj.kernel[...].astype(jnp.float32)
    w = w.reshape(layer.kv_lora_rank, layer.num_heads, layer.nope_dim + layer.v_head_dim)
    w_k, w_v = w[..., : layer.nope_dim], w[..., layer.nope_dim :]
    f32 = lambda a: a.astype(jnp.float32)
    q_latent = jnp.einsum("bthd,rhd->bthr", q_nope, w_k)  # the query in latent space
    scores = jnp.einsum("bthr,bsr->bhts", q_latent, f32(latents))
    scores = scores + jnp.einsum("bthd,bsd->bhts", q_rope, f32(rope_keys))
    out_latent = jnp.einsum("bhts,bsr->bthr", _softmax(layer, scores, allowed), f32(latents))
    out = jnp.einsum("bthr,rhd->bthd", out_latent, w_v)
    return out, LatentKVCache(latents, rope_keys, state.position + t, mask), overflow


def _check_options(
    width, num_heads, kv_lora_rank, q_lora_rank, nope, rope_dim, v_head_dim, rope, rope_theta,
    rope_scaling, scale, causal, dropout_rate,
) -> tuple[int, int, int, int, tuple, float]:  # fmt: skip
    """``(qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank, (rotary_dim or
    None, rope_theta, the scaling or None), scale)`` of ``LatentAttention``'s options, the
    defaults filled in, or a ValueError naming the first bad one."""
    nope = check_head_dim(width, num_heads, nope)
    rope_dim = max(nope // 2, 1) if rope_dim is None else rope_dim
    dv = nope if v_head_dim is None else v_head_dim
    rank = 4 * nope if kv_lora_rank is None else kv_lora_rank
    checks.check_sizes(qk_rope_head_dim=rope_dim, v_head_dim=dv, kv_lora_rank=rank)
    if q_lora_rank is not None:
        checks.check_int("q_lora_rank", q_lora_rank, 1)
    check_dropout_rate(dropout_rate)
    check_flags(rope=rope, causal=causal)
    if rope and rope_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even with rope=True, got {rope_dim}")
    rotary = check_rope(rope, rope_dim, rope_theta, None, None, rope_scaling)
    if scale is None:
        scale = (nope + rope_dim) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    return nope, rope_dim, dv, rank, rotary, float(scale)
