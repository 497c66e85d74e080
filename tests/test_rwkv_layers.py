"""RWKV-4's block (``layers.RWKVTimeMix`` with ``layers.RWKVChannelMix`` as its MLP): the
token shifts across padding and segments, against the rows run without them (one compiled
shape: a causal block's outputs do not depend on trailing padding). Its numerics and
decoding against ``transformers`` are in ``tests/test_hf_rwkv.py``."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax import layers
from tests import helpers


def test_padding_and_segments_equal_the_rows_without_them():
    """Padding in the middle (holding NaN) is skipped by both token shifts and the WKV: the
    row equals its real tokens alone; two segments equal two separate runs."""
    block = layers.TransformerBlock(
        8, 2, attention="rwkv", mlp="rwkv", mlp_hidden=12, norm="layer", rngs=nnx.Rngs(0)
    )
    # Mixes away from one half, so that a wrong previous token shows.
    for mix in (block.attention.time_mix_key, block.mlp.time_mix_receptance):
        mix[...] = jax.random.uniform(jax.random.PRNGKey(3), mix.shape)
    run = nnx.jit(lambda b, x, m, s: b(x, key_mask=m, segment_ids=s))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, 8))
    ones, zeros = jnp.ones((2, 9), bool), jnp.zeros((2, 9), jnp.int32)
    first = lambda y, n: jnp.pad(y[:, :n], ((0, 0), (0, 9 - n), (0, 0)))  # n tokens, then 0
    upto = lambda n: jnp.broadcast_to(jnp.arange(9) < n, (2, 9))

    mask = ones.at[:, jnp.array([2, 3, 6])].set(False)
    out = run(block, jnp.where(mask[..., None], x, jnp.nan), mask, zeros)
    real = np.flatnonzero(np.asarray(mask[0]))
    alone = run(block, first(x[:, real], 6), upto(6), zeros)
    helpers.assert_close_normwise(out[:, real], alone[:, :6])

    packed = run(block, x, ones, zeros.at[:, 4:].set(1))
    second = run(block, first(x[:, 4:], 5), upto(5), zeros)
    expected = jnp.concatenate([run(block, x, ones, zeros)[:, :4], second[:, :5]], axis=1)
    helpers.assert_close_normwise(packed, expected)
    state = block.init_state(2)
    assert state.mlp.shape == (2, 8) and state.attention.shift.dtype == jnp.float32
