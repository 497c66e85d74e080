"""Shared transformer blocks (Zamba2, Glorioso et al. 2024): one parameter set used at
several depths of a stack of mixer blocks.

At each use ``k`` (the layer ``layers[k]``) the block ``k % num_blocks`` reads ``[x,
embeddings]`` (the hidden stream beside the model's input embeddings, ``2 * width``
features), runs RMSNorm, softmax attention (out to ``width``), RMSNorm and a gated MLP,
each projection plus the use's own low-rank adapter (``Adapter``: a LoRA without a base;
on q, k and v with ``attention_adapters``, always on the MLP's fused gate and up); the
use's ``out_proj`` then maps the result into the hidden stream, where it is added to the
input of that layer's mixer, not to its residual: ``x + mixer(norm(x + out))``. Each use
has its own KV cache (``SharedBlocks.init_state``), whatever block it shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.blocks import BlockState
from linattn_jax.layers.common import split_heads
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.layers.softmax import KVCache, attend_cached, attend_full, check_heads
from linattn_jax.ops import checks

# The MLP's activation of its gate: exact GELU (Zamba2's "gelu"), GELU's tanh form, SiLU.
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def _linear(n_in: int, n_out: int, bias: bool, axes, options) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, kernel_init=sharding.kernel(*axes), **options)


class Adapter(nnx.Module):
    """``up(down(x))``: a rank-``rank`` adapter added to a shared projection's output (LoRA's
    product, without a base). ``down`` ``[n_in, rank]``, ``up`` ``[rank, n_out]``, no biases."""

    def __init__(self, n_in: int, rank: int, n_out: int, **options: Any):
        self.down = _linear(n_in, rank, False, (sharding.EMBED, None), options)
        self.up = _linear(rank, n_out, False, (None, sharding.MLP), options)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.up(self.down(x))


class SharedUse(nnx.Module):
    """One use's own parameters: its adapters (``q_adapter``, ``k_adapter``, ``v_adapter``
    ``[2 width -> heads]``, or None; ``mlp_adapter`` ``[width -> 2 mlp_hidden]``, or None
    without a rank: Zamba's) and
    ``out_proj`` ``[width, width]``, its output into the hidden stream."""

    def __init__(
        self, width: int, q_width: int, kv_width: int, mlp_hidden: int, rank: int | None,
        attention_adapters: bool, **options: Any,
    ):  # fmt: skip
        adapter = lambda n_out: Adapter(2 * width, rank, n_out, **options)
        self.q_adapter = nnx.data(adapter(q_width) if attention_adapters else None)
        self.k_adapter = nnx.data(adapter(kv_width) if attention_adapters else None)
        self.v_adapter = nnx.data(adapter(kv_width) if attention_adapters else None)
        mlp = None if rank is None else Adapter(width, rank, 2 * mlp_hidden, **options)
        self.mlp_adapter = nnx.data(mlp)
        self.out_proj = _linear(width, width, False, (sharding.EMBED, None), options)


class SharedBlock(nnx.Module):
    """The shared parameters: ``input_norm`` over ``2 width``, attention's ``q_proj``,
    ``k_proj``, ``v_proj`` (from ``2 width``) and ``out_proj`` (to ``width``), ``mlp_norm``,
    the MLP's fused ``gate_up_proj`` (rows ``[gate | up]``) and ``down_proj``.

    The attention is ``SoftmaxAttention``'s (its ``attend_full``, ``attend_cached`` and
    ``KVCache``): causal, GQA, RoPE on whole heads when ``rope_theta`` is set, scores times
    ``scale``; the MLP is ``down(act(gate) * up)``.
    """

    causal, sliding_window, logit_soft_cap, rope_scaling = True, None, None, None

    def __init__(
        self, width: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
        mlp_hidden: int, activation: str, mlp_bias: bool, rope_theta: float | None,
        scale: float | None, max_length: int, **options: Any,
    ):  # fmt: skip
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim = None if rope_theta is None else head_dim
        self.rope_theta, self.scale, self.max_length = rope_theta, scale, max_length
        self.activation = activation
        norm = lambda n: RMSNorm(n, rngs=options["rngs"], dtype=options["dtype"],
                                 param_dtype=options["param_dtype"])  # fmt: skip
        embed, heads, kv, mlp = sharding.EMBED, sharding.HEADS, sharding.KV_HEADS, sharding.MLP
        self.input_norm = norm(2 * width)
        self.q_proj = _linear(2 * width, num_heads * head_dim, False, (embed, heads), options)
        self.k_proj = _linear(2 * width, num_kv_heads * head_dim, False, (embed, kv), options)
        self.v_proj = _linear(2 * width, num_kv_heads * head_dim, False, (embed, kv), options)
        self.out_proj = _linear(num_heads * head_dim, width, False, (heads, embed), options)
        self.mlp_norm = norm(width)
        self.gate_up_proj = _linear(width, 2 * mlp_hidden, mlp_bias, (embed, mlp), options)
        self.down_proj = _linear(mlp_hidden, width, mlp_bias, (mlp, embed), options)

    def init_state(self, batch: int, max_length: int | None = None) -> KVCache:
        """An empty KV cache of ``max_length`` (the block's by default) tokens."""
        n = max_length or self.max_length
        zeros = jnp.zeros((batch, n, self.num_kv_heads, self.head_dim))
        none = jnp.zeros((batch,), jnp.int32)
        return KVCache(zeros, zeros, none, jnp.zeros((batch, n), jnp.bool_), none)

    def __call__(self, x, embeddings, use: SharedUse, *, key_mask, segment_ids, state, cached):
        """``(out [b, t, width], the new KVCache or None)`` of ``[x, embeddings]`` (each
        ``[b, t, width]``) with ``use``'s adapters (``cached``: over ``state``'s cache)."""
        h = self.input_norm(checks.where_token(key_mask, jnp.concatenate([x, embeddings], -1)))
        project = lambda proj, adapter: proj(h) if adapter is None else proj(h) + adapter(h)
        q = split_heads(project(self.q_proj, use.q_adapter), self.num_heads)
        k = split_heads(project(self.k_proj, use.k_adapter), self.num_kv_heads)
        v = split_heads(project(self.v_proj, use.v_adapter), self.num_kv_heads)
        dtype, (q, k, v) = q.dtype, (y.astype(jnp.float32) for y in (q, k, v))
        new_state = None
        if cached:
            if segment_ids is not None:
                raise ValueError("shared blocks take no segment_ids with a KV cache")
            out, new_state, overflow = attend_cached(self, q, k, v, key_mask, state)
            out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
        else:
            out = attend_full(self, q, k, v, key_mask, segment_ids, False)
        b, t = x.shape[:2]
        out = checks.where_token(key_mask, out).astype(dtype)
        h = self.mlp_norm(self.out_proj(out.reshape(b, t, self.num_heads * self.head_dim)))
        gate_up = self.gate_up_proj(h)
        if use.mlp_adapter is not None:
            gate_up = gate_up + use.mlp_adapter(h)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up), new_state


def mixer_step(block, x, extra, *, key_mask, segment_ids, state, cached):
    """``(x + mixer(norm(x + extra)), the new BlockState or None)`` of a mixer-only
    pre-norm ``block`` (a ``TransformerBlock``): ``extra`` joins the mixer's input, not the
    residual (Zamba2's hybrid layers)."""
    if block.mlp is not None or block.conv is not None or block.parallel is not None:
        raise ValueError("a shared block's output goes to a mixer-only block (mlp='none')")
    out = block.attention(
        block.attention_norm(x + extra), key_mask=key_mask, segment_ids=segment_ids,
        state=None if state is None else state.attention, return_state=cached,
    )  # fmt: skip
    if not cached:
        return x + out, None
    out, s = out
    return x + out, BlockState(s, None)


class SharedBlocks(nnx.Module):
    """``num_blocks`` shared blocks used at the layers ``layers`` of a stack, use ``k`` by
    block ``k % num_blocks`` (``LanguageModel``'s ``shared_blocks=`` option).

    Args:
      width: model width.
      depth: the stack's layers (``layers`` index them).
      layers: the layers with a use, increasing (Zamba2's ``hybrid_layer_ids``).
      num_blocks: the parameter sets (``num_mem_blocks``).
      num_heads: the attention's heads.
      num_kv_heads: its key and value heads (GQA; default ``num_heads``).
      head_dim: each head's width (default ``2 width / num_heads``: the input is ``2
        width`` wide).
      rope_theta: RoPE's base on whole heads (``use_mem_rope``), or None: no RoPE.
      scale: the scores' factor (None: ``head_dim ** -0.5``; Zamba2: ``(head_dim / 2) **
        -0.5``).
      mlp_hidden: the MLP's hidden width; ``activation`` its gate's (``ACTIVATIONS``);
        ``mlp_bias``: biases on its projections (``add_bias_linear``).
      adapter_rank: the adapters' rank, or None: no adapters (Zamba's one shared block);
        ``attention_adapters``: adapters on q, k and v too (``use_shared_attention_adapter``).
      max_length: the KV caches' length (decoding).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.

    Raises:
      ValueError: a bad size, ``layers`` not increasing within ``[0, depth)``, an unknown
        ``activation``.
    """

    def __init__(
        self, width: int, depth: int, *, layers: Sequence[int], num_blocks: int = 1,
        num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
        rope_theta: float | None = None, scale: float | None = None, mlp_hidden: int,
        activation: str = "gelu", mlp_bias: bool = False, adapter_rank: int | None,
        attention_adapters: bool = False, max_length: int = 4096, rngs: nnx.Rngs,
        dtype: Any = None, param_dtype: Any = jnp.float32,
    ):  # fmt: skip
        layers = tuple(layers)
        if (
            not layers
            or list(layers) != sorted(set(layers))
            or layers[0] < 0
            or layers[-1] >= depth
        ):
            raise ValueError(f"layers must increase within [0, depth={depth}), got {layers}")
        checks.check_sizes(num_blocks=num_blocks, mlp_hidden=mlp_hidden)
        if adapter_rank is not None or attention_adapters:
            checks.check_sizes(adapter_rank=adapter_rank)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        checks.check_bool("mlp_bias", mlp_bias)
        checks.check_bool("attention_adapters", attention_adapters)
        h, kv, hd = check_heads(2 * width, num_heads, num_kv_heads, head_dim)
        options = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.layers = layers
        self.blocks = nnx.List([
            SharedBlock(
                width, h, kv, hd, mlp_hidden=mlp_hidden, activation=activation,
                mlp_bias=mlp_bias, rope_theta=rope_theta, scale=scale, max_length=max_length,
                **options,
            )
            for _ in range(num_blocks)
        ])  # fmt: skip
        use = lambda: SharedUse(
            width, h * hd, kv * hd, mlp_hidden, adapter_rank, attention_adapters, **options
        )
        self.uses = nnx.List([use() for _ in layers])

    def init_state(self, batch: int, max_length: int | None = None) -> list[KVCache]:
        """One KV cache per use."""
        return [
            self.blocks[k % len(self.blocks)].init_state(batch, max_length)
            for k in range(len(self.layers))
        ]

    def run(
        self, blocks, x, *, key_mask, segment_ids, state, return_state: bool, period=None,
        remat: str = "none",
    ):  # fmt: skip
        """``x [b, t, width]`` (the input embeddings) through the stack ``blocks``
        (mixer-only ``TransformerBlock``s), each use's output added to its layer's mixer
        input: ``x`` (and ``[*each block's state, each use's]`` when ``return_state``).
        ``state``: that list, or None. ``models.stack.run_blocks``' call: unrolled
        (``period`` None), no ``remat``."""
        if period is not None or remat != "none":
            raise ValueError("shared blocks run unrolled layers without remat")
        cached = state is not None or return_state
        if state is None:
            states, uses = [None] * len(blocks), [None] * len(self.layers)
        else:
            states, uses = list(state[:-1]), list(state[-1])
        embeddings, new, new_uses = x, [], []
        for i, block in enumerate(blocks):
            extra = None
            if i in self.layers:
                k = self.layers.index(i)
                extra, s = self.blocks[k % len(self.blocks)](
                    x, embeddings, self.uses[k], key_mask=key_mask, segment_ids=segment_ids,
                    state=uses[k], cached=cached,
                )  # fmt: skip
                extra = self.uses[k].out_proj(extra)
                new_uses.append(s)
            call = dict(key_mask=key_mask, segment_ids=segment_ids)
            if extra is None and cached:
                x, s = block(x, state=states[i], return_state=True, **call)
            elif extra is None:
                x = block(x, **call)
            else:
                x, s = mixer_step(block, x, extra, state=states[i], cached=cached, **call)
            new.append(s if cached else None)
        return (x, [*new, new_uses]) if return_state else x
