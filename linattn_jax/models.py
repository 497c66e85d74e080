"""Complete models to start from: a causal language model and a sequence classifier."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers import TransformerBlock


def _blocks(depth: int, width: int, num_heads: int, **kwargs) -> nnx.List:
    """``depth`` independently initialised ``TransformerBlock``s."""
    return nnx.List([TransformerBlock(width, num_heads, **kwargs) for _ in range(depth)])


class LanguageModel(nnx.Module):
    """Token embedding, causal blocks, final RMSNorm and a tied or untied output.

    Args:
      vocab_size: number of tokens.
      width, depth, num_heads: model width, number of blocks, heads per block.
      attention: ``"linear"`` or ``"softmax"``.
      tie_embeddings: share the embedding with the output projection.
      short_conv: kernel of a causal depthwise convolution before each attention (0: none).
      **block_kwargs: passed to every ``TransformerBlock`` (``feature_map``, ...).
    """

    def __init__(
        self,
        vocab_size: int,
        width: int,
        depth: int,
        num_heads: int,
        *,
        attention: str = "linear",
        tie_embeddings: bool = True,
        mlp_ratio: int = 4,
        short_conv: int = 0,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **block_kwargs,
    ):
        self.vocab_size = vocab_size
        self.embed = nnx.Embed(vocab_size, width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.blocks = _blocks(
            depth,
            width,
            num_heads,
            attention=attention,
            causal=True,
            mlp_ratio=mlp_ratio,
            short_conv=short_conv,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            **block_kwargs,
        )
        self.norm = nnx.RMSNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.data(
            None
            if tie_embeddings
            else nnx.Linear(
                width, vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )
        )

    def init_state(self, batch: int, max_length: int | None = None) -> list:
        """One decoding state per block (``max_length``: softmax's KV cache length)."""
        return [block.init_state(batch, max_length) for block in self.blocks]

    def __call__(
        self,
        tokens: jax.Array,
        *,
        segment_ids=None,
        key_mask=None,
        state=None,
        return_state: bool = False,
    ):
        """``tokens [b, t] int -> logits [b, t, vocab]`` (and the new states)."""
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be int [batch, length], got {tokens.dtype} {tokens.shape}"
            )
        x = self.embed(tokens)
        states = [None] * len(self.blocks) if state is None else state
        new_states = []
        for block, s in zip(self.blocks, states, strict=True):
            x = block(
                x, segment_ids=segment_ids, key_mask=key_mask, state=s, return_state=return_state
            )
            if return_state:
                x, s = x
                new_states.append(s)
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        logits = logits.astype(jnp.float32)
        return (logits, new_states) if return_state else logits

    def generate(
        self, prompt: jax.Array, steps: int, rng: jax.Array, temperature: float = 1.0
    ) -> jax.Array:
        """Samples ``steps`` tokens after ``prompt [b, t]``; returns ``[b, t + steps]``.

        The prompt is prefilled once; each new token then costs one O(1) step of
        every linear-attention layer, whatever the length so far.
        ``temperature=0`` decodes greedily.
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        b, t = prompt.shape
        logits, state = _prefill(self, prompt, self.init_state(b, t + steps))
        tokens = [prompt]
        for i in range(steps):
            token = _sample(logits[:, -1], jax.random.fold_in(rng, i), temperature)
            tokens.append(token[:, None])
            if i + 1 < steps:
                logits, state = _decode(self, token[:, None], state)
        return jnp.concatenate(tokens, axis=1)


@nnx.jit
def _prefill(model: LanguageModel, tokens, state):
    return model(tokens, state=state, return_state=True)


@nnx.jit
def _decode(model: LanguageModel, token, state):
    return model(token, state=state, return_state=True)


def _sample(logits: jax.Array, rng: jax.Array, temperature: float) -> jax.Array:
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, logits / temperature, axis=-1).astype(jnp.int32)


class SequenceClassifier(nnx.Module):
    """A non-causal encoder, masked mean pooling and a linear classifier.

    Args:
      vocab_size, width, depth, num_heads: as in ``LanguageModel``.
      num_classes: output classes.
      attention: ``"linear"`` or ``"softmax"``.
      **block_kwargs: passed to every ``TransformerBlock``.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        width: int,
        depth: int,
        num_heads: int,
        *,
        attention: str = "linear",
        mlp_ratio: int = 4,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **block_kwargs,
    ):
        self.embed = nnx.Embed(vocab_size, width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.blocks = _blocks(
            depth,
            width,
            num_heads,
            attention=attention,
            causal=False,
            mlp_ratio=mlp_ratio,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            **block_kwargs,
        )
        self.norm = nnx.RMSNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.head = nnx.Linear(width, num_classes, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, key_mask: jax.Array | None = None) -> jax.Array:
        """``tokens [b, t] int`` (``key_mask [b, t]``, True = real) ``-> logits [b, classes]``."""
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be int [batch, length], got {tokens.dtype} {tokens.shape}"
            )
        mask = jnp.ones(tokens.shape, bool) if key_mask is None else key_mask
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, key_mask=mask)
        x = self.norm(x)
        weights = mask.astype(x.dtype)[..., None]
        pooled = jnp.sum(x * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
        return self.head(pooled).astype(jnp.float32)
