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
    check_can_decode,
    check_decoding,
    check_dropout_rate,
    check_head_dim,
    check_state,
    positions,
    project_qkv,
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
      head_gate: each head's output times ``sigmoid(g_proj(x))``, one gate per head from
        its own projection ``g_proj`` ``[width, num_heads]`` (LFM3's ``use_attention_gate``).
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
        head_gate: bool = False,
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
        check_flags(qk_norm_over_heads=qk_norm_over_heads, head_gate=head_gate)
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
        self.g_proj = nnx.data(linear(width, h, False, embed, heads) if head_gate else None)
        norm = lambda heads: RMSNorm(
            hd * (heads if qk_norm_over_heads else 1), zero_centred=zero_centred_qk_norm,
            dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.q_norm, self.k_norm = (nnx.data(norm(n) if qk_norm else None) for n in (h, kv))
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    def init_state(self, batch: int, max_length: int | None = None) -> KVCache:
        """An empty KV cache of ``max_length`` (the layer's by default) tokens; with a
        ``sliding_window``, a ring of at most that many, which decodes any length."""
        check_can_decode(self)
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
        select: jax.Array | None = None,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new KV cache if ``return_state``);
        ``select [b, t, keys or slots]``: what each query may see besides (bool).

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
        check_state(state, KVCache)
        x, (q, k, v), key_mask, query_mask = project_qkv(
            self, x, inputs_k, inputs_v, key_mask, query_mask
        )
        b, t, _ = x.shape
        if segment_ids is not None:
            if k.shape[1] != t:
                raise ValueError("segment_ids needs self-attention (no inputs_k / inputs_v)")
            checks.check_segment_ids(segment_ids, b, t)
        dtype = q.dtype
        q, gate = jnp.split(q, 2, axis=-1) if self.output_gate else (q, None)
        # Scores and softmax in float32, like linear attention's sums.
        q, k, v = (y.astype(jnp.float32) for y in (q, k, v))
        q, k = _qk_norms(self, q, k)
        cross = inputs_k is not None or inputs_v is not None
        out, new_state = _attend(
            self, q, k, v, key_mask, segment_ids, state, return_state, cross, select
        )
        out = checks.where_token(query_mask, out)  # a padded query's output is 0
        out = _gated(self, out, gate, x)
        out = self.dropout(out.astype(dtype), deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.num_heads * self.head_dim))
        return (y, new_state) if return_state else y


def _attend(layer, q, k, v, key_mask, segment_ids, state, return_state: bool, cross: bool, select):
    """``(out [b, t, h, hd] float32, the new KVCache or None)``: over the cache (``state``,
    or a new one for ``return_state``; overflowing rows NaN), else over this call's keys."""
    if state is None and not return_state:
        return attend_full(layer, q, k, v, key_mask, segment_ids, cross, select), None
    if segment_ids is not None:
        raise ValueError("SoftmaxAttention takes no segment_ids with a KV cache")
    out, new_state, overflow = attend_cached(layer, q, k, v, key_mask, state, select)
    return jnp.where(overflow[:, None, None, None], jnp.nan, out), new_state


def _gated(layer, out: jax.Array, gate: jax.Array | None, x: jax.Array) -> jax.Array:
    """``out [b, t, h, hd]`` times ``sigmoid(gate [b, t, h, hd])`` (``output_gate``) and
    ``sigmoid(g_proj(x))`` per head (``head_gate``), where the layer has them."""
    if gate is not None:
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32))
    if layer.g_proj is not None:
        out = out * jax.nn.sigmoid(layer.g_proj(x).astype(jnp.float32))[..., None]
    return out


def _qk_norms(layer, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``q [b, t, h, hd]`` and ``k [b, s, kv, hd]`` through the layer's QK-norms (each head's,
    or one over all heads with ``qk_norm_over_heads``), or as they are without."""
    if layer.q_norm is None:
        return q, k
    if layer.qk_norm_over_heads:
        flat = lambda y: y.reshape(*y.shape[:2], y.shape[2] * y.shape[3])  # no -1: t may be 0
        over = lambda norm, y: norm(flat(y)).reshape(y.shape)
        return over(layer.q_norm, q), over(layer.k_norm, k)
    return layer.q_norm(q), layer.k_norm(k)


def _rope(layer, x: jax.Array, positions: jax.Array) -> jax.Array:
    if layer.rotary_dim is None:
        return x
    return rope_lib.apply_rope(x, positions, layer.rotary_dim, layer.rope_theta, layer.rope_scaling)


def attend_full(layer, q, k, v, key_mask, segment_ids, cross: bool, select=None):
    """``SoftmaxAttention`` over this call's keys only (no cache): ``[b, t, h, hd]`` float32
    (each query over the keys ``select [b, t, s]`` allows, where given)."""
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
    if select is not None:
        mask = select[:, None] if mask is None else mask & select[:, None]
    window = None
    if layer.sliding_window is not None:
        window = (layer.sliding_window - 1, 0 if layer.causal else layer.sliding_window - 1)
    return soft_cap.dot_product_attention(
        q, k, v, mask=mask, is_causal=layer.causal, local_window_size=window, scale=layer.scale,
        soft_cap=layer.logit_soft_cap,
    )  # fmt: skip


def attend_cached(layer, q, k, v, key_mask, state, select=None):
    """``SoftmaxAttention`` over a KV cache after writing this call's keys to it:
    ``(out [b, t, h, hd] float32, the new KVCache, [b] rows that overflowed)``; ``select
    [b, t, slots]``: the slots each query may see besides (not with a window)."""
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
    k_all, v_all = write_slots(state.k, k, state.position), write_slots(state.v, v, state.position)
    mask = write_slots(state.mask, real, state.position)  # padding stays masked from now on
    query_slot = positions(state.position, b, t)[:, :, None]  # [b, t, 1]
    allowed = (jnp.arange(n)[None, None, :] <= query_slot) & mask[:, None, :]
    allowed = allowed if select is None else allowed & select
    f32 = lambda a: a.astype(jnp.float32)
    out = soft_cap.dot_product_attention(
        q, f32(k_all), f32(v_all), mask=allowed[:, None], scale=layer.scale,
        soft_cap=layer.logit_soft_cap,
    )  # fmt: skip
    return out, KVCache(k_all, v_all, state.position + t, mask, count), overflow


def write_slots(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """``cache [b, n, ...]`` with each row's ``new [b, t, ...]`` written at its slot
    ``start [b]`` on (in the cache's dtype): a KV cache's write."""
    write = lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), i, axis=0)
    return jax.vmap(write)(cache, new, start)


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
