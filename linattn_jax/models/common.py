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


def check_state(state, depth: int, batch: int, batch_axis: int = 0) -> None:
    """A model's decoding ``state``: None, or ``model.init_state(batch)``'s list of one
    state per block, each for this batch (every array in it has the batch on ``batch_axis``:
    1 for scanned layers, whose states are stacked); else a ValueError naming what it got."""
    if state is None:
        return
    expected = f"state must be model.init_state({batch})'s"
    sequence = isinstance(state, list | tuple) and not hasattr(state, "_fields")  # not a NamedTuple
    if not sequence or len(state) != depth:
        got = f"a {type(state).__name__}" + (f" of {len(state)}" if sequence else "")
        raise ValueError(f"{expected} (one state per block: {depth}), got {got}")
    for i, block_state in enumerate(state):
        for leaf in jax.tree.leaves(block_state):
            if getattr(leaf, "ndim", 0) > batch_axis and leaf.shape[batch_axis] != batch:
                raise ValueError(
                    f"{expected} (one state per block for a batch of {batch}), got state[{i}] "
                    f"for a batch of {leaf.shape[batch_axis]}"
                )
