"""``layers.MambaMixer``'s norms on dt, B and C with weights (Jamba's) against the weightless
ones (Falcon-Mamba's, which ``tests/test_hf_mamba.py`` checks against ``transformers``)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from linattn_jax import layers
from tests import helpers


def test_weighted_mixer_norms_equal_the_weightless_ones_folded_into_the_projections():
    """dt's weights ``w`` are dt_proj's rows times ``w``; B's weights ``s`` with C's ``1 / s``
    cancel in ``h . C`` (h is linear in B): the outputs equal the weightless layer's."""
    make = lambda **kw: layers.MambaMixer(
        16, state_dim=4, dt_rank=3, mixer_rms_eps=1e-5, rngs=nnx.Rngs(0), **kw
    )
    plain, weighted = make(), make(mixer_rms_weights=True)
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    w = jax.random.uniform(ks[0], (3,), minval=0.5, maxval=2.0)
    s = jax.random.uniform(ks[1], (4,), minval=0.5, maxval=2.0)
    weighted.dt_layernorm.scale[...] = w
    weighted.b_layernorm.scale[...] = s
    weighted.c_layernorm.scale[...] = 1.0 / s
    plain.dt_proj.kernel[...] = plain.dt_proj.kernel[...] * w[:, None]
    x = jax.random.normal(ks[2], (2, 7, 16))
    call = helpers.call
    helpers.assert_close_normwise(call(weighted, x), call(plain, x), 1e-5)
    weighted.c_layernorm.scale[...] = s  # no longer cancelling: a different output
    assert float(jnp.linalg.norm(call(weighted, x) - call(plain, x))) > 1e-3
    with pytest.raises(ValueError, match="mixer_rms_weights needs mixer_rms_eps"):
        layers.MambaMixer(16, mixer_rms_weights=True, rngs=nnx.Rngs(0))
