"""Multi-head softmax attention with a KV cache: the like-for-like baseline."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers.common import (
    check_decoding,
    check_dropout_rate,
    check_width,
    positions,
    project_qkv,
)
from linattn_jax.ops import checks

LINEAR_ONLY_OPTIONS = frozenset(
    (
        "feature_map", "method", "chunk_size", "decay", "gate", "normalize", "num_features",
        "hedgehog_form", "feature_dim", "sequence_axis", "batch_axis", "mesh", "eps",
    )
)  # fmt: skip


class KVCache(NamedTuple):
    """A ``SoftmaxAttention`` layer's decoding state: keys and values seen so far.

    Attributes:
      k: ``[b, max_length, h, d]``.
      v: ``[b, max_length, h, d]``.
      position: ``[b]`` int32, the number of tokens written (the next slot).
      mask: ``[b, max_length]`` bool, True at slots holding a real key (written,
        and not masked out by the ``key_mask`` of the call that wrote it).
    """

    k: jax.Array
    v: jax.Array
    position: jax.Array
    mask: jax.Array


class SoftmaxAttention(nnx.Module):
    """Multi-head softmax attention (``jax.nn.dot_product_attention``), same call as
    ``LinearAttention``, with a KV cache for decoding; for like-for-like comparisons.

    Args:
      width: model width (input and output features).
      num_heads: heads; must divide ``width``.
      causal: causal (decoder) or non-causal (encoder) attention.
      max_length: the KV cache's length (decoding only).
      dropout_rate: dropout on the attention's output, as in ``LinearAttention``.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
      **linear_options: ``LinearAttention``'s own options (``LINEAR_ONLY_OPTIONS``),
        accepted and ignored so that one set of options builds either kind; any
        other keyword raises ``TypeError``.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        causal: bool = True,
        max_length: int = 4096,
        dropout_rate: float = 0.0,
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
        check_width(width, num_heads)
        check_dropout_rate(dropout_rate)
        self.width, self.num_heads, self.head_dim = width, num_heads, width // num_heads
        self.causal, self.max_length = causal, max_length
        linear = lambda: nnx.Linear(
            width, width, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (linear() for _ in range(4))
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    def init_state(self, batch: int, max_length: int | None = None) -> KVCache:
        """An empty KV cache of ``max_length`` (the layer's by default) tokens."""
        if not self.causal:
            raise ValueError("decoding needs a causal layer (causal=True)")
        n = max_length or self.max_length
        shape = (batch, n, self.num_heads, self.head_dim)
        zeros = jnp.zeros(shape)
        return KVCache(
            zeros, zeros, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, n), jnp.bool_)
        )

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
        in ``LinearAttention`` (cross-attention for non-causal layers).

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
        if segment_ids is not None and k.shape[1] != t:
            raise ValueError("segment_ids needs self-attention (no inputs_k / inputs_v)")
        allowed = jnp.ones((b, t, k.shape[1]), bool)
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, :]
        if segment_ids is not None:
            allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
        if self.causal:
            allowed = allowed & jnp.tril(jnp.ones((1, t, t), bool))
        new_state = None
        if state is not None or return_state:
            if segment_ids is not None:
                raise ValueError("SoftmaxAttention takes no segment_ids with a KV cache")
            if state is None:
                state = self.init_state(b, max(t, self.max_length))
            n = state.k.shape[1]
            overflow = check_cache_room(state.position, t, n)
            write = jax.vmap(
                lambda cache, new, i: jax.lax.dynamic_update_slice_in_dim(
                    cache, new.astype(cache.dtype), i, axis=0
                )
            )
            k_all, v_all = write(state.k, k, state.position), write(state.v, v, state.position)
            real = jnp.ones((b, t), bool) if key_mask is None else key_mask
            mask = write(state.mask, real, state.position)  # padding stays masked from now on
            query_pos = positions(state.position, b, t)  # [b, t]
            allowed = jnp.arange(n)[None, None, :] <= query_pos[:, :, None]
            allowed = allowed & mask[:, None, :]
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
            new_state = KVCache(k_all, v_all, state.position + t, mask)
        # Scores and softmax in float32, like linear attention's sums.
        f32 = lambda a: a.astype(jnp.float32)
        out = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), mask=allowed[:, None])
        if new_state is not None:  # a write past the cache's end overwrote its last slots
            out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
        out = checks.where_token(query_mask, out)  # a padded query's output is 0
        out = self.dropout(out.astype(q.dtype), deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.width))
        return (y, new_state) if return_state else y


def check_cache_room(position: jax.Array, t: int, n: int) -> jax.Array:
    """``[b]`` bool, True for rows whose ``t`` new tokens would not fit in ``n`` slots.

    Raises where that is known before running: ``t > n``, or a concrete ``position``.
    """
    if t > n:
        raise ValueError(f"the KV cache holds {n} tokens, got {t} at once (x's length)")
    if not isinstance(position, jax.core.Tracer) and int(jnp.max(position)) + t > n:
        raise ValueError(
            f"the KV cache holds {n} tokens: {int(jnp.max(position))} written, "
            f"{t} more do not fit (make the cache longer: init_state(batch, max_length))"
        )
    return position + t > n
