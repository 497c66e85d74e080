"""Multi-head softmax attention with a KV cache: the like-for-like baseline, and the
attention layer of today's hybrids (GQA, RoPE, QK-norm, gated output, sliding window)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers import kv_window, soft_cap
from linattn_jax.layers import rope as rope_lib
from linattn_jax.layers.common import (
    check_decoding,
    check_dropout_rate,
    check_head_dim,
    check_tokens,
    positions,
    project_qkv,
    split_heads,
)
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.layers.rope_scaling import parse_rope_scaling
from linattn_jax.ops import checks

LINEAR_ONLY_OPTIONS = frozenset(
    (
        "feature_map", "method", "chunk_size", "decay", "gate", "normalize", "num_features",
        "hedgehog_form", "feature_dim", "sequence_axis", "batch_axis", "mesh", "eps",
    )
)  # fmt: skip


class KVCache(NamedTuple):
    """A ``SoftmaxAttention`` layer's decoding state: keys and values seen so far (a
    windowed layer's: the last ``sliding_window`` only, a ring buffer: ``layers.kv_window``).

    Attributes:
      k: ``[b, n, num_kv_heads, head_dim]`` (after RoPE, when the layer has it); ``n`` the
        cache's length, ``max_length`` (a windowed layer's: at most ``sliding_window``).
      v: ``[b, n, num_kv_heads, head_dim]``.
      position: ``[b]`` int32, the number of tokens written (padding too; the next slot,
        or a ring's next slot modulo ``n``).
      mask: ``[b, n]`` bool, True at slots holding a real key (written, and not masked
        out by the ``key_mask`` of the call that wrote it).
      real: ``[b]`` int32, the real tokens written: the RoPE position of the next one.
    """

    k: jax.Array
    v: jax.Array
    position: jax.Array
    mask: jax.Array
    real: jax.Array


class SoftmaxAttention(nnx.Module):
    """Multi-head softmax attention (``jax.nn.dot_product_attention``), same call as
    ``LinearAttention``, with a KV cache for decoding; and the options of today's models
    (Qwen3-Next's and Qwen3.5's gated attention: GQA, RoPE 0.25, QK-norm, output gate).

    The defaults are the plain baseline: as many KV heads as heads, ``head_dim = width /
    num_heads``, no position encoding, no norms, no gate, no window.

    Args:
      width: model width (input and output features).
      num_heads: heads; must divide ``width``.
      causal: causal (decoder) or non-causal (encoder) attention.
      max_length: the KV cache's length (decoding only).
      num_kv_heads: key and value heads (GQA; 1: MQA), dividing ``num_heads``; each serves
        ``num_heads / num_kv_heads`` query heads. The KV cache holds these only.
      head_dim: channels per head (default ``width / num_heads``; any int otherwise).
      rope: rotary position embeddings on q and k (``layers.rope``): positions count the
        real tokens of each row (``key_mask``), restart at each segment (``segment_ids``)
        and continue from a KV cache's real tokens.
      rope_theta: RoPE's base (default 10000; Qwen3-Next: 1e7).
      partial_rotary_factor: rotate only the first ``int(head_dim * factor)`` channels of
        each head; default all.
      rotary_dim: rotate only the first ``rotary_dim`` channels (instead of a factor).
      rope_scaling: RoPE's frequencies scaled as long-context checkpoints do, e.g.
        ``{"rope_type": "yarn", "factor": 4.0, ...}`` (``layers.rope_scaling``); None: none.
      qkv_bias: biases on the q, k and v projections (Qwen2; Llama's ``attention_bias``).
      out_bias: a bias on the output projection (Llama's and Qwen3's ``attention_bias``).
      qk_norm: an RMSNorm over each head's q and k, before RoPE (Qwen3, Qwen3-Next).
      zero_centred_qk_norm: those RMSNorms in the ``x * (1 + w)`` form (``layers.norms``).
      qk_norm_over_heads: with ``qk_norm``, one RMSNorm over all of q's heads
        (``[num_heads * head_dim]``) and one over all of k's (``[num_kv_heads * head_dim]``)
        instead of one per head (OLMo 2, OLMo 3, OLMo-Hybrid).
      output_gate: gated attention (Qiu et al. 2025; Qwen3-Next): ``q_proj`` also makes a
        gate per head and channel (laid out ``[q_h | gate_h]`` per head) and the output is
        ``attention * sigmoid(gate)`` before ``out_proj``.
      sliding_window: each query sees itself and the ``sliding_window - 1`` tokens (slots)
        before it (and, non-causal, after it); None: all.
      scale: the scores' factor, ``softmax(scale q . k)``; None: ``head_dim ** -0.5``
        (Granite's ``attention_multiplier`` sets its own).
      logit_soft_cap: the scores ``cap * tanh(scores / cap)`` before the softmax (Gemma
        2's ``attn_logit_softcapping``; ``layers.soft_cap``); None: uncapped.
      dropout_rate: dropout on the attention's output, as in ``LinearAttention``.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
      **linear_options: ``LinearAttention``'s own options (``LINEAR_ONLY_OPTIONS``),
        accepted and ignored so that one set of options builds either kind; any
        other keyword raises ``TypeError``.

    Raises:
      ValueError: a head count, ``head_dim``, ``sliding_window`` or RoPE size that is not a
        positive int (or does not divide), a RoPE option without ``rope=True``, a flag that
        is not a bool.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        causal: bool = True,
        max_length: int = 4096,
        dropout_rate: float = 0.0,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope: bool = False,
        rope_theta: float | None = None,
        partial_rotary_factor: float | None = None,
        rotary_dim: int | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        zero_centred_qk_norm: bool = False,
        qk_norm_over_heads: bool = False,
        output_gate: bool = False,
        sliding_window: int | None = None,
        scale: float | None = None,
        logit_soft_cap: float | None = None,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **linear_options: Any,
    ):
        # One set of options builds any kind (make_attention): linear attention's
        # are accepted and ignored here, anything else is a mistake.
        unknown = sorted(set(linear_options) - LINEAR_ONLY_OPTIONS)
        if unknown:
            raise TypeError(f"SoftmaxAttention got unexpected keyword arguments {unknown}")
        h, kv, hd = check_heads(width, num_heads, num_kv_heads, head_dim)
        check_dropout_rate(dropout_rate)
        check_flags(rope=rope, qk_norm=qk_norm, output_gate=output_gate, causal=causal)
        check_flags(zero_centred_qk_norm=zero_centred_qk_norm, qkv_bias=qkv_bias, out_bias=out_bias)
        check_flags(qk_norm_over_heads=qk_norm_over_heads)
        if qk_norm_over_heads and not qk_norm:
            raise ValueError("qk_norm_over_heads=True needs qk_norm=True")
        self.qk_norm_over_heads = qk_norm_over_heads
        if sliding_window is not None:
            checks.check_int("sliding_window", sliding_window, 1)
        if scale is not None and not (isinstance(scale, int | float) and 0 < scale < math.inf):
            raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")
        self.scale = None if scale is None else float(scale)
        self.logit_soft_cap = soft_cap.check_soft_cap("logit_soft_cap", logit_soft_cap)
        self.width, self.num_heads, self.num_kv_heads, self.head_dim = width, h, kv, hd
        self.causal, self.max_length, self.sliding_window = causal, max_length, sliding_window
        self.rotary_dim, self.rope_theta, self.rope_scaling = check_rope(
            rope, hd, rope_theta, partial_rotary_factor, rotary_dim, rope_scaling
        )
        self.output_gate = output_gate
        linear = lambda n_in, n_out, bias, *axes: nnx.Linear(
            n_in, n_out, use_bias=bias, kernel_init=sharding.kernel(*axes),
            bias_init=sharding.with_axes(nnx.initializers.zeros_init(), axes[1]), dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        embed, heads, kv_heads = sharding.EMBED, sharding.HEADS, sharding.KV_HEADS
        self.q_proj = linear(width, h * hd * (2 if output_gate else 1), qkv_bias, embed, heads)
        self.k_proj = linear(width, kv * hd, qkv_bias, embed, kv_heads)
        self.v_proj = linear(width, kv * hd, qkv_bias, embed, kv_heads)
        self.out_proj = linear(h * hd, width, out_bias, heads, embed)
        norm = lambda heads: RMSNorm(
            hd * (heads if qk_norm_over_heads else 1), zero_centred=zero_centred_qk_norm,
            dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.q_norm, self.k_norm = (
            nnx.data(norm(h) if qk_norm else None),
            nnx.data(norm(kv) if qk_norm else None),
        )
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    def init_state(self, batch: int, max_length: int | None = None) -> KVCache:
        """An empty KV cache of ``max_length`` (the layer's by default) tokens; with a
        ``sliding_window``, a ring of at most that many, which decodes any length."""
        if not self.causal:
            raise ValueError("decoding needs a causal layer (causal=True)")
        n = max_length or self.max_length
        n = n if self.sliding_window is None else min(n, self.sliding_window)
        zeros = jnp.zeros((batch, n, self.num_kv_heads, self.head_dim))
        none = jnp.zeros((batch,), jnp.int32)
        return KVCache(zeros, zeros, none, jnp.zeros((batch, n), jnp.bool_), none)

    def __call__(
        self,
        x: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        key_mask: jax.Array | None = None,
        query_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: KVCache | None = None,
        return_state: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new KV cache if ``return_state``).

        With a ``state``, ``x`` is written to the cache after the tokens already
        there; keys masked out by ``key_mask`` stay masked for every later call.
        ``inputs_k``, ``inputs_v``, ``query_mask``, ``deterministic`` and ``rngs`` as
        in ``LinearAttention`` (cross-attention for non-causal layers). Without a cache
        no ``[t, t]`` mask is built unless ``segment_ids`` need one (causality and the
        window are ``dot_product_attention``'s own, a ``key_mask`` broadcasts from
        ``[b, 1, 1, s]``); with one, the mask is ``[b, 1, t, max_length]``.

        ``segment_ids [b, t]`` (int, self-attention without a cache) packs several
        sequences in a row: a token attends within its run of equal ids only, and a
        segment starts wherever the id changes (ids ``[0, 0, 1, 0]`` are three segments,
        the library's one rule: ``checks.segment_runs``).

        Raises:
          ValueError: the tokens would not fit in the cache (``t`` longer than it,
            or, when ``state.position`` is concrete, ``position + t`` past its end).
            Under ``jit`` the position is not known: rows that overflow get NaN outputs.
        """
        check_decoding(self, state, return_state)
        x, (q, k, v), key_mask, query_mask = project_qkv(
            self, x, inputs_k, inputs_v, key_mask, query_mask
        )
        b, t, _ = x.shape
        if segment_ids is not None:
            if k.shape[1] != t:
                raise ValueError("segment_ids needs self-attention (no inputs_k / inputs_v)")
            checks.segment_resets(segment_ids, b, t, jnp.float32)  # validates
        dtype = q.dtype
        gate = None
        if self.output_gate:
            q, gate = jnp.split(q, 2, axis=-1)
        # Scores and softmax in float32, like linear attention's sums.
        q, k, v = (y.astype(jnp.float32) for y in (q, k, v))
        if self.q_norm is not None and self.qk_norm_over_heads:
            over = lambda norm, y: norm(y.reshape(*y.shape[:2], -1)).reshape(y.shape)
            q, k = over(self.q_norm, q), over(self.k_norm, k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        new_state = None
        if state is not None or return_state:
            if segment_ids is not None:
                raise ValueError("SoftmaxAttention takes no segment_ids with a KV cache")
            out, new_state, overflow = attend_cached(self, q, k, v, key_mask, state)
            out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
        else:
            cross = inputs_k is not None or inputs_v is not None
            out = attend_full(self, q, k, v, key_mask, segment_ids, cross)
        out = checks.where_token(query_mask, out)  # a padded query's output is 0
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
        out = self.dropout(out.astype(dtype), deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.num_heads * self.head_dim))
        return (y, new_state) if return_state else y


def _rope(layer, x: jax.Array, positions: jax.Array) -> jax.Array:
    if layer.rotary_dim is None:
        return x
    return rope_lib.apply_rope(x, positions, layer.rotary_dim, layer.rope_theta, layer.rope_scaling)


def attend_full(layer, q, k, v, key_mask, segment_ids, cross: bool):
    """``SoftmaxAttention`` over this call's keys only (no cache): ``[b, t, h, hd]`` float32."""
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    if not cross:  # q and k share the positions
        pos = rope_lib.token_positions(b, t, key_mask=key_mask, segment_ids=segment_ids)
        q, k = _rope(layer, q, pos), _rope(layer, k, pos)
    else:
        q = _rope(layer, q, rope_lib.token_positions(b, t))
        k = _rope(layer, k, rope_lib.token_positions(b, s, key_mask=key_mask))
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if segment_ids is not None:
        run = checks.segment_runs(segment_ids)  # runs, not ids: a repeated id is a new segment
        same = run[:, None, :, None] == run[:, None, None, :]
        mask = same if mask is None else mask & same
    window = None
    if layer.sliding_window is not None:
        window = (layer.sliding_window - 1, 0 if layer.causal else layer.sliding_window - 1)
    return soft_cap.dot_product_attention(
        q, k, v, mask=mask, is_causal=layer.causal, local_window_size=window, scale=layer.scale,
        soft_cap=layer.logit_soft_cap,
    )  # fmt: skip


def attend_cached(layer, q, k, v, key_mask, state):
    """``SoftmaxAttention`` over a KV cache after writing this call's keys to it:
    ``(out [b, t, h, hd] float32, the new KVCache, [b] rows that overflowed)``."""
    b, t = q.shape[:2]
    if state is None:
        state = layer.init_state(b, max(t, layer.max_length))
    n = state.k.shape[1]
    checks.check_shape(
        "state.k", state.k, (b, n, layer.num_kv_heads, layer.head_dim),
        "[batch, max_length, num_kv_heads, head_dim]",
    )  # fmt: skip
    window = layer.sliding_window
    ring = window is not None and n >= window  # a ring never overflows
    overflow = jnp.zeros((b,), bool) if ring else check_cache_room(state.position, t, n)
    pos = rope_lib.token_positions(b, t, key_mask=key_mask, start=state.real)
    q, k = _rope(layer, q, pos), _rope(layer, k, pos)
    real = jnp.ones((b, t), bool) if key_mask is None else key_mask
    count = state.real + jnp.sum(real, axis=1, dtype=jnp.int32)
    if window is not None:  # a ring, or a cache too short to wrap (overflow says so)
        cache = (state.k, state.v, state.mask)
        out, (k_all, v_all, mask) = kv_window.attend_window(
            q, k, v, real, cache, state.position, window, layer.scale, layer.logit_soft_cap
        )
        return out, KVCache(k_all, v_all, state.position + t, mask, count), overflow
    write = jax.vmap(
        lambda cache, new, i: jax.lax.dynamic_update_slice_in_dim(
            cache, new.astype(cache.dtype), i, axis=0
        )
    )
    k_all, v_all = write(state.k, k, state.position), write(state.v, v, state.position)
    mask = write(state.mask, real, state.position)  # padding stays masked from now on
    query_slot = positions(state.position, b, t)[:, :, None]  # [b, t, 1]
    allowed = (jnp.arange(n)[None, None, :] <= query_slot) & mask[:, None, :]
    f32 = lambda a: a.astype(jnp.float32)
    out = soft_cap.dot_product_attention(
        q, f32(k_all), f32(v_all), mask=allowed[:, None], scale=layer.scale,
        soft_cap=layer.logit_soft_cap,
    )  # fmt: skip
    return out, KVCache(k_all, v_all, state.position + t, mask, count), overflow


def check_heads(width, num_heads, num_kv_heads, head_dim) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` checked (``head_dim`` by default
    ``width / num_heads``, which must then divide)."""
    head_dim = check_head_dim(width, num_heads, head_dim)
    if num_kv_heads is None:
        num_kv_heads = num_heads
    checks.check_int("num_kv_heads", num_kv_heads, 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    return num_heads, num_kv_heads, head_dim


def check_flags(**flags) -> None:
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")


def check_rope(rope, head_dim, theta, factor, rotary_dim, scaling=None) -> tuple:
    """``(rotary_dim or None without RoPE, theta, the checked scaling or None)``; RoPE's
    options need ``rope=True``."""
    if not rope:
        given = dict(
            rope_theta=theta, partial_rotary_factor=factor, rotary_dim=rotary_dim,
            rope_scaling=scaling,
        )  # fmt: skip
        given = {name: value for name, value in given.items() if value is not None}
        if given:
            raise ValueError(f"{sorted(given)} need rope=True, got rope=False with {given}")
        return None, 10000.0, None
    if theta is None:
        theta = 10000.0
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ValueError(f"rope_theta must be a number > 0, got {theta!r}")
    dim = rope_lib.rotary_dim(head_dim, factor, rotary_dim)
    return dim, float(theta), parse_rope_scaling(scaling, dim)


def check_cache_room(position: jax.Array, t: int, n: int) -> jax.Array:
    """``[b]`` bool, True for rows whose ``t`` new tokens would not fit in ``n`` slots.

    Raises where that is known before running: ``t > n``, or a concrete ``position``.
    """
    if t > n:
        raise ValueError(f"the KV cache holds {n} tokens, got {t} at once (x's length)")
    span = checks.concrete_range(position)  # eager even under a jit closing over the cache
    if span is not None and span[1] + t > n:
        raise ValueError(
            f"the KV cache holds {n} tokens: {span[1]} written, "
            f"{t} more do not fit (make the cache longer: init_state(batch, max_length))"
        )
    return position + t > n


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
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's); scores and softmax in float32.
      param_dtype: the parameters' dtype, as in Flax.
      **linear_options: ``LINEAR_ONLY_OPTIONS``, accepted and ignored (as by
        ``SoftmaxAttention``); any other keyword raises ``TypeError``.

    Parameters: ``q_proj`` or ``q_a_proj``, ``q_a_norm``, ``q_b_proj``; ``kv_a_proj``
    ``[width, r + p]``, ``kv_norm``, ``kv_b_proj`` ``[r, h (n + dv)]``, ``out_proj``.
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
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **linear_options: Any,
    ):
        unknown = sorted(set(linear_options) - LINEAR_ONLY_OPTIONS)
        if unknown:
            raise TypeError(f"LatentAttention got unexpected keyword arguments {unknown}")
        nope = check_head_dim(width, num_heads, qk_nope_head_dim)
        rope_dim = max(nope // 2, 1) if qk_rope_head_dim is None else qk_rope_head_dim
        dv = nope if v_head_dim is None else v_head_dim
        rank = 4 * nope if kv_lora_rank is None else kv_lora_rank
        checks.check_sizes(qk_rope_head_dim=rope_dim, v_head_dim=dv, kv_lora_rank=rank)
        if q_lora_rank is not None:
            checks.check_int("q_lora_rank", q_lora_rank, 1)
        check_dropout_rate(dropout_rate)
        check_flags(rope=rope, causal=causal)
        if rope and rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even with rope=True, got {rope_dim}")
        self.rotary_dim, self.rope_theta, self.rope_scaling = check_rope(
            rope, rope_dim, rope_theta, None, None, rope_scaling
        )
        if scale is None:
            scale = (nope + rope_dim) ** -0.5
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ValueError(f"scale must be a number > 0, got {scale!r}")
        self.width, self.num_heads, self.causal, self.max_length = (
            width,
            num_heads,
            causal,
            max_length,
        )
        self.kv_lora_rank, self.q_lora_rank = rank, q_lora_rank
        self.nope_dim, self.rope_dim, self.v_head_dim = nope, rope_dim, dv
        self.scale = float(scale)
        linear = lambda n_in, n_out, *axes: nnx.Linear(
            n_in, n_out, use_bias=False, kernel_init=sharding.kernel(*axes), dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
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
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    def init_state(self, batch: int, max_length: int | None = None) -> LatentKVCache:
        """An empty cache of ``max_length`` (the layer's by default) tokens."""
        if not self.causal:
            raise ValueError("decoding needs a causal layer (causal=True)")
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
        if state is not None and not isinstance(state, LatentKVCache):
            raise ValueError(f"state must be a LatentKVCache, got {type(state).__name__}")
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        if segment_ids is not None:
            checks.segment_resets(segment_ids, b, t, jnp.float32)  # validates
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
            out, new_state, overflow = self._attend_cached(
                q_nope, q_rope, latent, k_rope, key_mask, state
            )
            out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
        else:
            out = self._attend_full(q_nope, q_rope, latent, k_rope, key_mask, segment_ids)
        out = checks.where_token(key_mask, out)  # a padded query's output is 0
        out = self.dropout(out.astype(dtype), deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.num_heads * self.v_head_dim))
        return (y, new_state) if return_state else y

    def _rope(self, x, pos):
        if self.rotary_dim is None:
            return x
        return rope_lib.apply_rope(x, pos, self.rotary_dim, self.rope_theta, self.rope_scaling)

    def _softmax(self, scores, allowed):
        """``softmax(scores * scale)`` over the last axis where ``allowed``; rows with no
        key allowed (padding) get finite weights, their outputs replaced later."""
        scores = jnp.where(allowed, scores * self.scale, jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(scores, axis=-1)

    def _attend_full(self, q_nope, q_rope, latent, k_rope, key_mask, segment_ids):
        """Decompressed, ordinary attention over this call's tokens: ``[b, t, h, dv]``."""
        b, t = latent.shape[:2]
        pos = rope_lib.token_positions(b, t, key_mask=key_mask, segment_ids=segment_ids)
        q_rope, k_rope = self._rope(q_rope, pos), self._rope(k_rope[:, :, None], pos)[:, :, 0]
        kv = split_heads(self.kv_b_proj(latent), self.num_heads)
        kv = kv.astype(jnp.float32)
        k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
        scores = jnp.einsum("bthd,bshd->bhts", q_nope, k_nope)
        scores = scores + jnp.einsum("bthd,bsd->bhts", q_rope, k_rope)
        slots = jnp.arange(t)
        allowed = jnp.ones((b, 1, t, t), bool)
        if self.causal:
            allowed = allowed & (slots[None, None, :, None] >= slots[None, None, None, :])
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, None, :]
        if segment_ids is not None:
            run = checks.segment_runs(segment_ids)
            allowed = allowed & (run[:, None, :, None] == run[:, None, None, :])
        return jnp.einsum("bhts,bshd->bthd", self._softmax(scores, allowed), v)

    def _attend_cached(self, q_nope, q_rope, latent, k_rope, key_mask, state):
        """Attention over the cache after writing this call's latents to it, the query
        absorbed into ``kv_b_proj``: ``(out [b, t, h, dv], the new cache, [b] overflow)``."""
        b, t = latent.shape[:2]
        if state is None:
            state = self.init_state(b, max(t, self.max_length))
        n = state.latent.shape[1]
        checks.check_shape(
            "state.latent", state.latent, (b, n, self.kv_lora_rank),
            "[batch, max_length, kv_lora_rank]",
        )  # fmt: skip
        checks.check_shape(
            "state.k_rope", state.k_rope, (b, n, self.rope_dim),
            "[batch, max_length, qk_rope_head_dim]",
        )  # fmt: skip
        overflow = check_cache_room(state.position, t, n)
        held = jnp.sum(state.mask, axis=1, dtype=jnp.int32)
        pos = rope_lib.token_positions(b, t, key_mask=key_mask, start=held)
        q_rope, k_rope = self._rope(q_rope, pos), self._rope(k_rope[:, :, None], pos)[:, :, 0]
        write = jax.vmap(
            lambda cache, new, i: jax.lax.dynamic_update_slice_in_dim(
                cache, new.astype(cache.dtype), i, axis=0
            )
        )
        latents = write(state.latent, latent, state.position)
        rope_keys = write(state.k_rope, k_rope, state.position)
        real = jnp.ones((b, t), bool) if key_mask is None else key_mask
        mask = write(state.mask, real, state.position)
        query_slot = positions(state.position, b, t)[:, None, :, None]  # [b, 1, t, 1]
        allowed = (jnp.arange(n)[None, None, None, :] <= query_slot) & mask[:, None, None, :]
        w = self.kv_b_proj.kernel[...].astype(jnp.float32)
        w = w.reshape(self.kv_lora_rank, self.num_heads, self.nope_dim + self.v_head_dim)
        w_k, w_v = w[..., : self.nope_dim], w[..., self.nope_dim :]
        f32 = lambda a: a.astype(jnp.float32)
        q_latent = jnp.einsum("bthd,rhd->bthr", q_nope, w_k)  # the query in latent space
        scores = jnp.einsum("bthr,bsr->bhts", q_latent, f32(latents))
        scores = scores + jnp.einsum("bthd,bsd->bhts", q_rope, f32(rope_keys))
        out_latent = jnp.einsum("bhts,bsr->bthr", self._softmax(scores, allowed), f32(latents))
        out = jnp.einsum("bthr,rhd->bthd", out_latent, w_v)
        return out, LatentKVCache(latents, rope_keys, state.position + t, mask), overflow
