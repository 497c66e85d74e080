"""Lightning attention (linattn_jax.layers.lightning) against a per-token float64 loop
written here: SiLU'd q/k/v, ``S = gamma S + k v^T``, ``o = q S``, an RMSNorm over all heads,
a sigmoid gate, with MiniMax-01's slopes computed from the layer's index."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax.layers import make_attention
from linattn_jax.layers.lightning import LightningAttention, lightning_decays
from linattn_jax.models import LanguageModel
from tests.helpers import assert_close_normwise

WIDTH, HEADS, HEAD_DIM = 16, 4, 6


def silu(x):
    return x / (1.0 + np.exp(-x))


def reference(layer: LightningAttention, x, key_mask=None):
    """The layer's output by a loop over tokens in float64 (a masked token skipped)."""
    w = {
        name: np.asarray(getattr(layer, name).kernel[...], np.float64)
        for name in ("q_proj", "k_proj", "v_proj", "output_gate", "out_proj")
    }
    scale = np.asarray(layer.norm.scale[...], np.float64)
    h, d = layer.num_heads, layer.head_dim
    # ALiBi's slopes 2^(-8 i / h), i = 1..h, shrunk with depth (MiniMax-01).
    shrink = 1 - layer.layer_index / (layer.num_layers - 1 + 1e-5) + 1e-5
    gamma = np.exp(-(2.0 ** (-8.0 * np.arange(1, h + 1) / h)) * shrink)
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    y = np.zeros((b, t, layer.width))
    for row in range(b):
        s = np.zeros((h, d, d))
        for i in range(t):
            if key_mask is not None and not key_mask[row, i]:
                continue
            xi = x[row, i]
            q, k, v = (silu(xi @ w[n]).reshape(h, d) for n in ("q_proj", "k_proj", "v_proj"))
            s = gamma[:, None, None] * s + k[:, :, None] * v[:, None, :]
            o = np.einsum("hd,hdv->hv", q, s).reshape(-1)
            o = o / np.sqrt(np.mean(o * o) + layer.norm.epsilon) * scale
            gate = 1.0 / (1.0 + np.exp(-(xi @ w["output_gate"])))
            y[row, i] = (gate * o) @ w["out_proj"]
    return y


def make(layer_index=2, num_layers=5, method="chunked", seed=0):
    layer = LightningAttention(
        WIDTH, HEADS, head_dim=HEAD_DIM, layer_index=layer_index, num_layers=num_layers,
        method=method, chunk_size=4, rngs=nnx.Rngs(seed),
    )  # fmt: skip
    scale = jax.random.uniform(jax.random.key(seed + 1), layer.norm.scale.shape) + 0.5
    layer.norm.scale[...] = scale  # a random norm, not the ones it starts from
    return layer


@pytest.fixture(scope="module")
def inputs():
    x = jax.random.normal(jax.random.key(3), (2, 11, WIDTH), jnp.float32)
    mask = np.ones((2, 11), bool)
    mask[1, :3] = False  # left padding
    return x, mask


@pytest.mark.parametrize("method", ["chunked", "scan", "pallas"])  # pallas: interpreted
def test_matches_the_float64_loop(inputs, method):
    x, mask = inputs
    layer = make(method=method)
    assert_close_normwise(layer(x), reference(layer, x), 1e-5)
    got = layer(x, key_mask=mask)
    assert_close_normwise(got, reference(layer, x, mask), 1e-5)
    np.testing.assert_array_equal(np.asarray(got)[1, :3], 0.0)  # padding gives zeros


def test_prefill_then_steps_equal_the_full_pass(inputs):
    x, _ = inputs
    layer = make(layer_index=0, num_layers=3)
    full = layer(x)
    state = layer.init_state(x.shape[0])
    y, state = layer(x[:, :7], state=state, return_state=True)
    outs = [y]
    step = nnx.jit(lambda m, xt, s: m(xt, state=s, return_state=True))
    for i in range(7, x.shape[1]):
        y, state = step(layer, x[:, i : i + 1], state)
        outs.append(y)
    assert_close_normwise(jnp.concatenate(outs, 1), full, 1e-5)
    np.testing.assert_array_equal(np.asarray(state.position), [11, 11])


def test_decays_depend_on_the_layer_and_bad_options_raise():
    first, last = lightning_decays(8, 0, 4), lightning_decays(8, 3, 4)
    np.testing.assert_allclose(first, np.exp(-(2.0 ** -np.arange(1, 9)) * (1 + 1e-5)))
    assert np.all(last > 0.99999) and np.all(first < last)
    with pytest.raises(ValueError, match="layer_index must be < num_layers=4"):
        lightning_decays(8, 4, 4)
    with pytest.raises(ValueError, match="causal must be True"):
        LightningAttention(WIDTH, HEADS, causal=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="method must be one of"):
        make_attention("lightning", WIDTH, HEADS, method="fast", rngs=nnx.Rngs(0))


def test_a_hybrid_model_gives_each_layer_its_depth():
    # (generate over a lightning hybrid: tests/test_minimax_hf.py)
    model = nnx.eval_shape(
        lambda: LanguageModel(
            32, WIDTH, 4, HEADS, attention="3 lightning : 1 softmax", mlp="swiglu",
            rngs=nnx.Rngs(0),
        )
    )  # fmt: skip
    assert [b.attention.layer_index for b in model.blocks[:3]] == [0, 1, 2]
    assert {b.attention.num_layers for b in model.blocks[:3]} == {4}
    with pytest.raises(ValueError, match="scan_layers"):
        LanguageModel(32, WIDTH, 2, HEADS, attention="lightning", scan_layers=True,
                      rngs=nnx.Rngs(0))  # fmt: skip
