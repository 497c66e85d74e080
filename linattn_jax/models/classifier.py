"""A sequence classifier: a non-causal encoder, masked mean pooling and a linear head."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.models import stack
from linattn_jax.models.common import check_tokens
from linattn_jax.models.options import freeze
from linattn_jax.ops import checks


class SequenceClassifier(nnx.Module):
    """A non-causal encoder, masked mean pooling and a linear classifier.

    Args:
      vocab_size: number of tokens.
      num_classes: output classes.
      width: model width.
      depth: number of blocks.
      num_heads: heads per block; must divide ``width``.
      attention: a kind of ``layers.ATTENTION_KINDS`` or a layout, as in ``LanguageModel``;
        the blocks are non-causal (``causal=False``).
      kind_options: as in ``LanguageModel``.
      zero_centred_norm: as in ``LanguageModel``.
      scan_layers: as in ``LanguageModel``.
      remat: as in ``LanguageModel``.
      mlp_ratio: each block's MLP hidden width over ``width``.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
      **block_kwargs: passed to every ``TransformerBlock``.

    Attributes:
      options: what the model was built from, as ``LanguageModel.options``.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        width: int,
        depth: int,
        num_heads: int,
        *,
        attention: str | Sequence[str] = "linear",
        kind_options: Mapping[str, Mapping] | None = None,
        mlp_ratio: int = 4,
        zero_centred_norm: bool = False,
        scan_layers: bool = False,
        remat: str = "none",
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **block_kwargs,
    ):
        self.options = freeze(
            dict(
                vocab_size=vocab_size, num_classes=num_classes, width=width, depth=depth,
                num_heads=num_heads, attention=attention, kind_options=kind_options,
                mlp_ratio=mlp_ratio, zero_centred_norm=zero_centred_norm,
                scan_layers=scan_layers, remat=remat, dtype=dtype, param_dtype=param_dtype,
                **block_kwargs,
            )
        )  # fmt: skip
        self.vocab_size = vocab_size
        self.embed = nnx.Embed(
            vocab_size, width, embedding_init=sharding.embedding(sharding.VOCAB, sharding.EMBED),
            dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.blocks, self.layout, self.period = stack.make_blocks(
            depth,
            width,
            num_heads,
            attention=attention,
            kind_options=kind_options,
            scan_layers=scan_layers,
            remat=remat,
            causal=False,
            mlp_ratio=mlp_ratio,
            zero_centred_norm=zero_centred_norm,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            **block_kwargs,
        )
        self.remat = remat
        self.norm = RMSNorm(
            width, zero_centred=zero_centred_norm, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.head = nnx.Linear(width, num_classes, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, key_mask: jax.Array | None = None) -> jax.Array:
        """``tokens [b, t] int`` (``key_mask [b, t]``, True = real) ``-> logits [b, classes]``."""
        check_tokens(tokens, self.vocab_size)
        key_mask = checks.token_mask("key_mask", key_mask, *tokens.shape)
        mask = jnp.ones(tokens.shape, bool) if key_mask is None else key_mask
        x = self.embed(tokens)
        x = stack.run_blocks(self.blocks, x, period=self.period, remat=self.remat, key_mask=mask)
        x = self.norm(x)
        # A select, not a product: whatever a padded row holds (NaN too) reaches nothing.
        total = jnp.sum(checks.where_token(mask, x), axis=1)
        pooled = total / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1).astype(x.dtype)
        return self.head(pooled).astype(jnp.float32)
