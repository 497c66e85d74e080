"""Packed rows (issue 40, item 4): ``segment_ids`` means one rule everywhere, a segment is
a run of equal ids (a reset wherever the id changes), so a repeated id later in a row is a
new sequence. Each layer's packed row is compared with each run computed alone."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import layers
from linattn_jax.ops import checks
from tests import helpers

# The third run repeats the first's id; the second is shorter than the convolution's window.
IDS = np.array([0] * 5 + [1] * 2 + [0] * 5)
RUNS = [(0, 5), (5, 7), (7, 12)]


def test_segment_runs():
    ids = jnp.asarray(np.stack([IDS, np.arange(12) // 6]), jnp.int32)
    expected = np.stack([[0] * 5 + [1] * 2 + [2] * 5, np.arange(12) // 6])
    np.testing.assert_array_equal(checks.segment_runs(ids), expected)


@pytest.mark.parametrize(
    "make",
    [
        lambda: layers.SoftmaxAttention(8, 2, rope=True, rngs=nnx.Rngs(0)),
        lambda: layers.SoftmaxAttention(8, 2, causal=False, rngs=nnx.Rngs(0)),
        lambda: layers.LinearAttention(8, 2, chunk_size=4, rngs=nnx.Rngs(0)),
        lambda: layers.CausalConv1D(8, 4, rngs=nnx.Rngs(0)),
    ],
    ids=["softmax_rope", "softmax_noncausal", "linear", "conv"],
)
def test_repeated_id_is_a_new_segment(make):
    layer = make()

    def call(x, **kw):
        out = helpers.call(layer, x, **kw)
        return out[0] if isinstance(layer, layers.CausalConv1D) else out

    x = jax.random.normal(jax.random.key(0), (1, 12, 8))
    packed = call(x, segment_ids=jnp.asarray(IDS[None], jnp.int32))
    alone = jnp.concatenate([call(x[:, a:b]) for a, b in RUNS], axis=1)
    scale = float(jnp.max(jnp.abs(alone)))
    chex.assert_trees_all_close(packed, alone, atol=1e-5 * scale, rtol=0)
