"""What the models share: their stack of blocks and the check of their token ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers import TransformerBlock
from linattn_jax.models.sampling import check_ids


def make_blocks(depth: int, width: int, num_heads: int, **kwargs) -> nnx.List:
    """``depth`` independently initialised ``TransformerBlock``s."""
    return nnx.List([TransformerBlock(width, num_heads, **kwargs) for _ in range(depth)])


def check_tokens(tokens: jax.Array, vocab_size: int) -> None:
    """Int ``[b, t]`` tokens with ids in ``[0, vocab_size)`` (when concrete), or a ValueError."""
    if (
        not hasattr(tokens, "ndim")
        or tokens.ndim != 2
        or not jnp.issubdtype(tokens.dtype, jnp.integer)
    ):
        got = (
            f"{tokens.dtype} {tokens.shape}" if hasattr(tokens, "shape") else type(tokens).__name__
        )
        raise ValueError(f"tokens must be int [batch, length], got {got}")
    check_ids(tokens, vocab_size, "tokens")
