"""Indexed sparse attention (Qwen4-Exp's QSA): softmax attention in which each query sees
the keys of the ``budget / block`` compressed blocks a learned indexer scores highest,
plus the keys after the last complete block.

A query's visible keys (real, causal) are cut, in order, into blocks of ``block`` tokens;
only complete blocks count. The indexer projects each token to ``H`` query heads and one
key (``index_proj``, ``[q_1 .. q_H | k]``); a block's key is its tokens' keys' mean,
``index_k_norm``-ed and rotated (RoPE) at its first token's position; a query's
``index_q_norm``-ed, rotated heads score block ``j`` as ``sum_h relu(<q_h, k_j>) /
sqrt(dh)``. The query attends to the tokens of its top-scoring blocks and to the tail of
visible tokens no complete block holds: with ``budget`` or fewer visible tokens in complete
blocks, that is every visible key (plain softmax attention). Positions are the real
tokens before a token (``rope.token_positions``), as everywhere here.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers import rope as rope_lib
from linattn_jax.layers.common import check_state
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.layers.softmax import KVCache, SoftmaxAttention, write_slots
from linattn_jax.ops import checks


class IndexedCache(NamedTuple):
    """``IndexedAttention``'s decoding state: the KV cache and each slot's indexer key
    ``[b, n, index_head_dim]`` (float32)."""

    kv: KVCache
    keys: jax.Array


class IndexedAttention(SoftmaxAttention):
    """``SoftmaxAttention`` whose queries see the keys an indexer selects (the module
    docstring's maths; causal, no window, no ``segment_ids``).

    Args:
      width: model width, as ``SoftmaxAttention``'s.
      num_heads: attention heads, as ``SoftmaxAttention``'s.
      index_heads: the indexer's query heads ``H`` (1).
      index_head_dim: their (and its key's) width ``dh`` (None: ``head_dim``); at least
        the RoPE's rotary width.
      index_budget: the tokens of complete blocks a query sees, a multiple of
        ``index_block`` (2048).
      index_block: the tokens a compressed block averages (4).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
      **options: ``SoftmaxAttention``'s.
    """

    def __init__(
        self, width: int, num_heads: int, *, index_heads: int = 1,
        index_head_dim: int | None = None, index_budget: int = 2048, index_block: int = 4,
        rngs: nnx.Rngs, dtype: Any = None,
        param_dtype: Any = jnp.float32, **options: Any,
    ):  # fmt: skip
        options = dict(options, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        super().__init__(width, num_heads, **options)
        index_head_dim = self.head_dim if index_head_dim is None else index_head_dim
        for name, value in dict(
            index_heads=index_heads, index_head_dim=index_head_dim, index_budget=index_budget,
            index_block=index_block,
        ).items():  # fmt: skip
            checks.check_int(name, value, 1)
        if index_budget % index_block:
            raise ValueError(f"index_budget={index_budget} must be a multiple of index_block")
        if not self.causal or self.sliding_window is not None:
            raise ValueError("IndexedAttention is causal, without a sliding_window")
        if (self.rotary_dim or 0) > index_head_dim:
            raise ValueError(f"index_head_dim={index_head_dim} must hold the rotary channels")
        self.index_heads, self.index_head_dim = index_heads, index_head_dim
        self.index_budget, self.index_block = index_budget, index_block
        self.index_proj = nnx.Linear(
            width, (index_heads + 1) * index_head_dim, use_bias=False, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        norm = lambda: RMSNorm(index_head_dim, zero_centred=True, dtype=jnp.float32, rngs=rngs)
        self.index_q_norm, self.index_k_norm = norm(), norm()

    def init_state(self, batch: int, max_length: int | None = None) -> IndexedCache:
        kv = super().init_state(batch, max_length)
        return IndexedCache(kv, jnp.zeros((*kv.k.shape[:2], self.index_head_dim)))

    def rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x [b, t, h, dh]`` rotated as the attention's RoPE rotates (or as it is)."""
        if self.rotary_dim is None:
            return x
        return rope_lib.apply_rope(
            x, positions, self.rotary_dim, self.rope_theta, self.rope_scaling
        )

    def __call__(self, x, *, key_mask=None, segment_ids=None, state=None, return_state=False):
        """``x [b, t, width] -> [b, t, width]`` (and the new ``IndexedCache``)."""
        check_state(state, IndexedCache)
        if segment_ids is not None:
            raise ValueError("IndexedAttention takes no segment_ids")
        b, t = x.shape[:2]
        index = self.index_proj(x).astype(jnp.float32)
        q = self.index_q_norm(
            index[..., : -self.index_head_dim].reshape(b, t, -1, self.index_head_dim)
        )
        k = index[..., -self.index_head_dim :]
        real = jnp.ones((b, t), bool) if key_mask is None else key_mask
        kv = None
        if state is None and not return_state:
            positions = rope_lib.token_positions(b, t, key_mask=key_mask)
            keys, visible, slots = k, real, jnp.broadcast_to(jnp.arange(t)[None], (b, t))
        else:
            state = self.init_state(b, max(t, self.max_length)) if state is None else state
            kv = state.kv
            positions = rope_lib.token_positions(b, t, key_mask=key_mask, start=kv.real)
            keys = write_slots(state.keys, k, kv.position)
            visible = write_slots(kv.mask, real, kv.position)
            slots = kv.position[:, None] + jnp.arange(t)[None]
        select = self.select(self.rotate(q, positions), keys, visible, slots)
        out = super().__call__(
            x, key_mask=key_mask, state=kv, return_state=return_state, select=select
        )
        return (out[0], IndexedCache(out[1], keys)) if return_state else out

    def select(self, q, keys, visible, slots) -> jax.Array:
        """The keys each query sees ``[b, t, s]`` (bool), of its rotated index heads ``q [b,
        t, H, dh]``, the index keys ``keys [b, s, dh]``, which are real ``visible [b, s]``
        and the queries' own slots ``slots [b, t]``."""
        c, s = self.index_block, keys.shape[1]
        blocks = s // c
        seen = jnp.cumsum(visible.astype(jnp.int32), axis=1)  # visible keys up to each slot
        rank = seen - 1
        complete = jnp.take_along_axis(seen, slots, axis=1) // c  # [b, t]
        causal = visible[:, None, :] & (jnp.arange(s)[None, None] <= slots[..., None])
        tail = rank[:, None, :] >= (complete * c)[..., None]
        if blocks == 0:
            return causal & tail
        block = jnp.where(visible, rank // c, blocks)
        sums = jax.vmap(lambda k, i: jax.ops.segment_sum(k, i, num_segments=blocks + 1))(
            keys, block
        )[:, :blocks]
        pooled = self.index_k_norm(sums / c)[:, :, None, :]
        starts = jnp.broadcast_to(jnp.arange(blocks)[None] * c, pooled.shape[:2])
        pooled = self.rotate(pooled, starts)[:, :, 0, :]
        scores = jnp.einsum("bthd,bjd->bthj", q, pooled)
        scores = jnp.sum(jax.nn.relu(scores), axis=2) / math.sqrt(self.index_head_dim)
        valid = jnp.arange(blocks)[None, None] < complete[..., None]
        scores = jnp.where(valid, scores, -jnp.inf)
        top = min(self.index_budget // c, blocks)
        # Ties (relu's zeros) to the lower block, as jax.lax.top_k and torch.topk break them.
        picked = jax.nn.one_hot(jax.lax.top_k(scores, top)[1], blocks, dtype=jnp.bool_)
        chosen = valid & jnp.any(picked, axis=-2)  # [b, t, blocks]
        of_slot = jnp.broadcast_to(jnp.clip(rank // c, 0, blocks - 1)[:, None, :], causal.shape)
        return causal & (tail | jnp.take_along_axis(chosen, of_slot, axis=2))
