"""Hyper-connections (``layers.hyper``): the read and write-back against the maths in
float64 NumPy, the streams through a hybrid model (decoding == the full pass) and the
options named when bad. The checkpoint test (Qwen4-Exp against ``transformers``, and
scanned layers) is ``tests/test_hf_qwen4_exp.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax.layers import TransformerBlock
from linattn_jax.layers.hyper import HyperConnection
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.models import LanguageModel
from tests import helpers

HC = dict(streams=3, rank=4)


def _numpy_read_write(x, h, hc):
    """The module docstring's maths in float64 for ``x [t, n, d]``, ``h [t, d]``."""
    n, d = x.shape[-2:]
    p = lambda m: np.asarray(m[...], np.float64)
    y = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + hc.norm.epsilon)
    y = (y * (1 + p(hc.norm.scale).reshape(n, d))).reshape(-1, n * d)
    a = y @ p(hc.down.kernel) / n
    mix = 1 / (1 + np.exp(-((a / (1 + np.exp(-a))) @ p(hc.up.kernel))))
    u = (mix * y).reshape(-1, n, d).mean(-2)
    g = 2 / (1 + np.exp(-(y @ p(hc.inject.kernel)) / n))
    return u, x + g[..., None] * h[:, None, :]


def test_read_and_write_back_match_the_maths():
    hc = HyperConnection(5, 3, 4, rngs=nnx.Rngs(0))
    hc.norm.scale[...] = jax.random.normal(jax.random.PRNGKey(1), (15,))
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (7, 3, 5)), np.float64)
    h = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (7, 5)), np.float64)
    u, written = _numpy_read_write(x, h, hc)
    helpers.assert_close_normwise(hc(jnp.asarray(x, jnp.float32)), u, 1e-5)
    helpers.assert_close_normwise(
        hc.write(jnp.asarray(x, jnp.float32), jnp.asarray(h)), written, 1e-5
    )


def test_a_hybrid_with_streams_decodes_as_its_full_pass():
    options = dict(attention=["gated_deltanet", "softmax"], mlp="swiglu", hyper_connections=HC)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 9), 0, 31)
    model = LanguageModel(31, 16, 2, 2, **options, rngs=nnx.Rngs(0))
    full = helpers.unmasked(model, tokens)
    steps = helpers.prefill_then_steps(model, tokens, 5, model.init_state(2, 9))
    helpers.assert_close_normwise(steps, full, 1e-5)


def test_scanned_streams_run_as_unrolled():
    """The streams ``[b, t, n, d]`` are the scan's carry: the scanned model with the
    unrolled one's parameters (layer ``i`` at index ``i`` of the stack) gives its logits."""
    options = dict(attention="gated_deltanet", mlp="swiglu", hyper_connections=HC)
    unrolled = LanguageModel(31, 16, 2, 2, **options, rngs=nnx.Rngs(0))
    scanned = LanguageModel(31, 16, 2, 2, **options, scan_layers=True, rngs=nnx.Rngs(1))
    ours = dict(nnx.to_flat_state(nnx.state(unrolled, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(scanned, nnx.Param)):
        if path[0] == "blocks":
            value = jnp.stack([ours[("blocks", i, *path[2:])][...] for i in range(2)])
        else:
            value = ours[path][...]
        variable.set_value(value)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 9), 0, 31)
    helpers.assert_close_normwise(
        helpers.unmasked(scanned, tokens), helpers.unmasked(unrolled, tokens), 1e-6
    )


def test_bad_options_are_named():
    block = lambda **o: TransformerBlock(8, 2, attention="softmax", rngs=nnx.Rngs(0), **o)
    for options, message in [
        (dict(hyper_connections=dict(streams=1, rank=2)), r"hyper_connections\['streams'\] must"),
        (dict(hyper_connections=dict(streams=2)), r"exactly \('streams', 'rank'\)"),
        (dict(hyper_connections=HC, post_norm=True), r"no post_norm"),
        (dict(hyper_connections=HC, mlp_residual=(0.5, 1.0)), r"no residual alpha"),
    ]:
        with pytest.raises(ValueError, match=message):
            block(**options)
    with pytest.raises(ValueError, match=r"hyper_connections take no shared_blocks"):
        LanguageModel(11, 8, 1, 2, hyper_connections=HC, shared_blocks={}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"group_size must be None or an int >= 1 dividing"):
        RMSNorm(10, group_size=3, rngs=nnx.Rngs(0))
