"""RWKV-4's block (``layers.RWKVTimeMix`` with ``layers.RWKVChannelMix`` as its MLP): the
token shift across padding and segments, against the rows run without them; the block's
decoding state. Its numerics against ``transformers`` are in ``tests/test_hf_rwkv.py``."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax import layers
from tests import helpers


def _block():
    block = layers.TransformerBlock(
        8, 2, attention="rwkv", mlp="rwkv", mlp_hidden=12, norm="layer", rngs=nnx.Rngs(0)
    )
    # Mixes away from one half, so that a wrong previous token shows.
    for mix in (block.attention.time_mix_key, block.mlp.time_mix_receptance):
        mix[...] = jax.random.uniform(jax.random.PRNGKey(3), mix.shape)
    return block


def test_padding_and_segments_equal_the_rows_without_them():
    """Padding in the middle (holding NaN) is skipped by both token shifts and the WKV: the
    row equals its real tokens alone; two segments equal two separate runs; a one-token
    step after a prefill equals the full pass."""
    block = _block()
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, 8))
    mask = jnp.ones((2, 9), bool).at[0, jnp.array([2, 3, 6])].set(False)
    dirty = jnp.where(mask[..., None], x, jnp.nan)
    run = nnx.jit(lambda b, x, m, s: b(x, key_mask=m, segment_ids=s))
    out = run(block, dirty, mask, None)
    real = np.flatnonzero(np.asarray(mask[0]))
    alone = run(block, x[:1, real], None, None)
    helpers.assert_close_normwise(out[0, real], alone[0])
    ids = jnp.asarray([[0] * 4 + [1] * 5] * 2)
    packed = run(block, x, None, ids)
    parts = [run(block, x[:, :4], None, None), run(block, x[:, 4:], None, None)]
    helpers.assert_close_normwise(packed, jnp.concatenate(parts, axis=1))
    prefill, state = block(x[:, :8], state=block.init_state(2), return_state=True)
    last, _ = block(x[:, 8:], state=state, return_state=True)
    full = run(block, x, None, None)
    helpers.assert_close_normwise(jnp.concatenate([prefill, last], 1), full)
    assert state.mlp.shape == (2, 8) and state.attention.shift.dtype == jnp.float32
