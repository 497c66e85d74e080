"""A causal language model: token embedding, causal blocks, final RMSNorm, tied or untied
output; ``generate`` samples from it (``linattn_jax.models.sampling``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers import hyper
from linattn_jax.layers.blocks import make_norm
from linattn_jax.layers.mlp import check_multiplier
from linattn_jax.layers.shared import SharedBlocks
from linattn_jax.models import sampling, stack
from linattn_jax.models.common import check_state, check_tokens
from linattn_jax.models.options import freeze
from linattn_jax.ops import checks


def check_options(
    embedding_multiplier, logits_scaling, logit_soft_cap, embedding_norm, shared_blocks,
    scan_layers, remat, hyper_connections,
) -> int | None:  # fmt: skip
    """``LanguageModel``'s model-level options checked (a ValueError naming the first bad
    one); returns the number of residual streams (None: one, no hyper-connections)."""
    check_multiplier("embedding_multiplier", embedding_multiplier)
    check_multiplier("logits_scaling", logits_scaling)
    if shared_blocks is not None and (scan_layers or remat != "none"):
        raise ValueError("shared_blocks needs scan_layers=False and remat='none'")
    if logit_soft_cap is not None:
        checks.check_number("logit_soft_cap", logit_soft_cap, minimum=0.0)
        if not logit_soft_cap > 0:
            raise ValueError(f"logit_soft_cap must be > 0 (or None), got {logit_soft_cap!r}")
    checks.check_bool("embedding_norm", embedding_norm)
    if hyper_connections is None:
        return None
    if shared_blocks is not None:
        raise ValueError("hyper_connections take no shared_blocks")
    return hyper.check_options(hyper_connections)[0]


class LanguageModel(nnx.Module):
    """Token embedding, causal blocks, final RMSNorm and a tied or untied output.

    Args:
      vocab_size: number of tokens.
      width: model width.
      depth: number of blocks.
      num_heads: heads per block; must divide ``width``.
      attention: a kind of ``layers.ATTENTION_KINDS`` (``layers.registry.KINDS``) for every
        layer, or a layout: a list of ``depth`` kinds, or a pattern repeated over the depth
        such as ``"3 gated_deltanet : 1 softmax"`` (``registry.parse_layout``).
      kind_options: options per kind, ``{"softmax": {"rope": True, ...}, ...}``, given to
        that kind's blocks over ``block_kwargs`` (``num_heads`` there overrides the model's).
      tie_embeddings: share the embedding with the output projection.
      mlp_ratio: each block's MLP hidden width over ``width``.
      short_conv: kernel of a causal depthwise convolution before each attention (0: none).
      zero_centred_norm: every RMSNorm of the blocks and the final one in the ``x * (1 + w)``
        form (``layers.norms.RMSNorm``; Qwen3-Next, Qwen3.5).
      norm: the blocks' and the final norm: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm
        with a bias: RWKV's).
      embedding_norm: a norm (of ``norm``'s kind) on the embeddings before the first block
        (RWKV's ``pre_ln``).
      scan_layers: run the depth as a scan over the layout's period (``models.stack``): one
        compiled period whatever the depth; the parameters are stacked.
      remat: ``"none"``, ``"full"`` (recompute each block in the backward pass) or
        ``"dots_saveable"`` (keep the matmuls' outputs, recompute the rest).
      embedding_multiplier: the embeddings times this before the first block (Granite's
        ``embedding_multiplier``; 1: none).
      logits_scaling: the logits divided by this (Granite's ``logits_scaling``; 1: none).
      logit_soft_cap: None, or the logits are ``cap * tanh(logits / cap)`` (xLSTM-7B: 30).
      shared_blocks: None, or ``layers.shared.SharedBlocks``' options (``layers``,
        ``num_blocks``, ...): transformer blocks shared by several layers over ``[hidden,
        embeddings]``, each use with its own adapters and KV cache (Zamba2); unrolled
        layers only (no ``scan_layers``, no ``remat``).
      hyper_connections: None, or ``{"streams": n, "rank": r}``: ``n`` residual streams
        (``layers.hyper``; the final norm a read-out); ``norm="rms"``, no ``shared_blocks``.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
      **block_kwargs: passed to every ``TransformerBlock`` (``feature_map``, ``mlp``, ...);
        ``mlp`` may list each layer's kind (``"moe"`` layers read ``moe=``, a dict of
        ``layers.MoE``'s options; ``docs/guide/moe.md``).

    Attributes:
      options: what the model was built from: every argument above but ``rngs``, a
        read-only mapping (``models.options.Frozen``; dtypes as ``numpy.dtype``);
        ``LanguageModel(**models.options.thaw(model.options), rngs=...)`` builds it again.
      hf_config: the normalised ``config.json`` of the checkpoint the model was loaded
        from (a ``Frozen`` mapping; ``linattn_jax.hf`` sets it, ``hf.save_pretrained``
        writes it back), or None.
    """

    def __init__(
        self,
        vocab_size: int,
        width: int,
        depth: int,
        num_heads: int,
        *,
        attention: str | Sequence[str] = "linear",
        kind_options: Mapping[str, Mapping] | None = None,
        tie_embeddings: bool = True,
        mlp_ratio: int = 4,
        short_conv: int = 0,
        zero_centred_norm: bool = False,
        norm: str = "rms",
        embedding_norm: bool = False,
        scan_layers: bool = False,
        remat: str = "none",
        embedding_multiplier: float = 1.0,
        logits_scaling: float = 1.0,
        logit_soft_cap: float | None = None,
        shared_blocks: Mapping[str, Any] | None = None,
        hyper_connections: Mapping[str, int] | None = None,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **block_kwargs,
    ):
        self.options = freeze(
            dict(
                vocab_size=vocab_size, width=width, depth=depth, num_heads=num_heads,
                attention=attention, kind_options=kind_options, tie_embeddings=tie_embeddings,
                mlp_ratio=mlp_ratio, short_conv=short_conv, zero_centred_norm=zero_centred_norm,
                norm=norm, embedding_norm=embedding_norm, scan_layers=scan_layers, remat=remat,
                embedding_multiplier=embedding_multiplier, logits_scaling=logits_scaling,
                logit_soft_cap=logit_soft_cap, dtype=dtype, param_dtype=param_dtype,
                **block_kwargs,
                **({} if shared_blocks is None else dict(shared_blocks=shared_blocks)),
                **({} if hyper_connections is None else dict(hyper_connections=hyper_connections)),
            )
        )  # fmt: skip
        self.hf_config = None
        self.streams = check_options(
            embedding_multiplier, logits_scaling, logit_soft_cap, embedding_norm, shared_blocks,
            scan_layers, remat, hyper_connections,
        )  # fmt: skip
        self.embedding_multiplier = float(embedding_multiplier)
        self.logits_scaling = float(logits_scaling)
        self.vocab_size = vocab_size
        self.embed = nnx.Embed(
            vocab_size, width, embedding_init=sharding.embedding(sharding.VOCAB, sharding.EMBED),
            dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.blocks, self.layout, self.period = stack.make_blocks(
            depth, width, num_heads, attention=attention, kind_options=kind_options,
            scan_layers=scan_layers, remat=remat, causal=True, mlp_ratio=mlp_ratio,
            short_conv=short_conv, zero_centred_norm=zero_centred_norm, norm=norm, rngs=rngs,
            dtype=dtype, param_dtype=param_dtype, hyper_connections=hyper_connections,
            **block_kwargs,
        )  # fmt: skip
        self.depth, self.remat = depth, remat
        self.shared = nnx.data(
            None
            if shared_blocks is None
            else SharedBlocks(
                width, depth, **shared_blocks, rngs=rngs, dtype=dtype, param_dtype=param_dtype
            )
        )
        self.logit_soft_cap = None if logit_soft_cap is None else float(logit_soft_cap)
        norm_args = (norm, width, zero_centred_norm, rngs, dtype, param_dtype)
        new_norm = lambda hc=None: make_norm(*norm_args, hc, inject=False)
        self.embed_norm = nnx.data(new_norm() if embedding_norm else None)
        self.norm = new_norm(hyper_connections)
        self.head = nnx.data(
            None
            if tie_embeddings
            else nnx.Linear(
                width,
                vocab_size,
                use_bias=False,
                kernel_init=sharding.kernel(sharding.EMBED, sharding.VOCAB),
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )  # fmt: skip
        )

    def init_state(self, batch: int, max_length: int | None = None) -> list:
        """One decoding state per block, each its own kind's (``max_length``: softmax's KV
        cache length); with ``scan_layers``, one per block of the period, stacked; with
        ``shared_blocks``, then a list of one KV cache per use."""
        states = stack.init_states(self.blocks, self.depth, self.period, batch, max_length)
        return (
            states if self.shared is None else [*states, self.shared.init_state(batch, max_length)]
        )

    def __call__(
        self,
        tokens: jax.Array,
        *,
        segment_ids=None,
        key_mask=None,
        state=None,
        return_state: bool = False,
    ):
        """``tokens [b, t] int -> logits [b, t, vocab]`` (and the new states).

        ``key_mask [b, t]`` (True = real): masked tokens add nothing to any layer's
        state, cache or convolution window (left-padded prompts).

        Raises:
          ValueError: ``tokens`` not int ``[b, t]``, or (when concrete, not traced)
            holding ids outside ``[0, vocab_size)``.
        """
        check_tokens(tokens, self.vocab_size)
        states = len(self.blocks) + (self.shared is not None)
        check_state(state, states, tokens.shape[0], 0 if self.period is None else 1)
        x = self.embed(tokens)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = sharding.constrain(x, sharding.BATCH, sharding.LENGTH, None)
        if self.streams is not None:
            x = hyper.expand(x, self.streams)
        run = stack.run_blocks if self.shared is None else self.shared.run
        x = run(
            self.blocks,
            x,
            period=self.period,
            remat=self.remat,
            key_mask=key_mask,
            segment_ids=segment_ids,
            state=state,
            return_state=return_state,
            **(dict(tokens=tokens) if self.shared is None else {}),
        )
        if return_state:
            x, new_states = x
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        logits = logits.astype(jnp.float32)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.logit_soft_cap is not None:
            logits = self.logit_soft_cap * jnp.tanh(logits / self.logit_soft_cap)
        return (logits, new_states) if return_state else logits

    generate = sampling.generate
