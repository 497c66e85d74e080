"""A causal language model: token embedding, causal blocks, final RMSNorm, tied or untied
output; ``generate`` samples from it (``linattn_jax.models.sampling``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.models import sampling
from linattn_jax.models.common import check_state, check_tokens, make_blocks


class LanguageModel(nnx.Module):
    """Token embedding, causal blocks, final RMSNorm and a tied or untied output.

    Args:
      vocab_size: number of tokens.
      width: model width.
      depth: number of blocks.
      num_heads: heads per block; must divide ``width``.
      attention: any registered kind, one of ``layers.ATTENTION_KINDS``
        (``layers.registry.KINDS``: ``"linear"``, ``"softmax"``, ``"gla"``,
        ``"deltanet"``, ``"gated_deltanet"``, ``"kda"``).
      tie_embeddings: share the embedding with the output projection.
      mlp_ratio: each block's MLP hidden width over ``width``.
      short_conv: kernel of a causal depthwise convolution before each attention (0: none).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
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
        self.blocks = make_blocks(
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
        """``tokens [b, t] int -> logits [b, t, vocab]`` (and the new states).

        ``key_mask [b, t]`` (True = real): masked tokens add nothing to any layer's
        state, cache or convolution window (left-padded prompts).

        Raises:
          ValueError: ``tokens`` not int ``[b, t]``, or (when concrete, not traced)
            holding ids outside ``[0, vocab_size)``.
        """
        check_tokens(tokens, self.vocab_size)
        check_state(state, len(self.blocks), tokens.shape[0])
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
        self,
        prompt: jax.Array,
        steps: int,
        rng: jax.Array | None = None,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        prompt_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Samples up to ``steps`` tokens after ``prompt``, compiled end to end.

        One jitted call prefills the prompt (chunked form) and runs every decoding
        step in a ``lax.while_loop`` (one O(1) step of each linear-attention layer
        per token; softmax layers read a KV cache sized ``t + steps``), so a call
        costs one dispatch. Calls with the same shapes and the same static options
        (``steps``, greedy or not, ``top_k``, whether ``top_p`` / ``eos_id`` /
        ``prompt_mask`` are given, the model's structure) reuse the compiled program.

        Args:
          prompt: int ``[b, t]``, ``t >= 1``, ids in ``[0, vocab_size)``. Rows of
            different lengths are left-padded (any valid id as padding) and marked
            by ``prompt_mask``.
          steps: the most new tokens per row (``>= 0``).
          rng: a PRNG key, needed unless sampling is greedy; step ``i`` draws with
            ``fold_in(rng, i)``.
          temperature: ``> 0`` divides the logits before sampling; ``0`` (or anything
            below ``sampling.GREEDY_BELOW``, 1e-6, where the division would overflow) is
            greedy.
          top_k: sample among the ``top_k`` most likely tokens only (``>= 1``).
          top_p: nucleus sampling: among the fewest most likely tokens whose
            probability (after ``temperature`` and ``top_k``) reaches ``top_p``, in (0, 1].
          eos_id: a row stops after sampling this id; its later tokens are ``pad_id``.
            The loop ends early once every row has stopped.
          pad_id: written after a row's ``eos_id`` (default: ``eos_id`` itself); any int.
          prompt_mask: bool ``[b, t]``, True for real tokens; left padding only (each
            row: padding, then real tokens to its end; a hole raises). Padded tokens
            reach nothing: each row's tokens equal those of generating that row alone.

        Returns:
          int32 ``[b, t + steps]``: the prompt, then the new tokens.

        Raises:
          ValueError: an empty prompt (``t == 0``: there is no logit to sample the
            first token from), ids outside ``[0, vocab_size)`` or a badly shaped
            prompt or mask, ``steps < 0``, ``temperature`` < 0, NaN or inf, ``top_k < 1``,
            ``top_p`` outside (0, 1], ``eos_id`` outside the vocabulary, or no
            ``rng`` for sampling.
        """
        return sampling.generate(
            self,
            prompt,
            steps,
            rng,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=eos_id,
            pad_id=pad_id,
            prompt_mask=prompt_mask,
        )
