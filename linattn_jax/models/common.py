"""What the models share: the check of their token ids (their stack of blocks: ``stack``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.models.sampling import check_ids


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
