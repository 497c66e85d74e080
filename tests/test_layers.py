"""Flax NNX layers and models: shapes, decoding equivalence, generation, gradients."""

import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized
from flax import linen, nnx
from flax.nnx import bridge

from linattn_jax import layers, models
from tests import helpers

B, T, W, H = 2, 11, 16, 4  # T = 11 is not a multiple of the chunk size 4
LINEAR_OPTIONS = {
    "elu": dict(feature_map="elu"),
    "relu": dict(feature_map="relu"),
    "softmax_map": dict(feature_map="softmax"),
    "two_sided_relu": dict(feature_map="two_sided_relu"),
    "dpfp": dict(feature_map="dpfp"),
    "taylor": dict(feature_map="taylor"),
    "favor_plus": dict(feature_map="favor_plus", num_features=8),
    "random_fourier": dict(feature_map="random_fourier", num_features=8, normalize=False),
    "hedgehog": dict(feature_map="hedgehog"),
    "hedgehog_paper": dict(feature_map="hedgehog", hedgehog_form="paper"),
    "taylor_feature_dim": dict(feature_map="taylor", feature_dim=3),
    "cosformer": dict(feature_map="cosformer", max_length=64),
    "identity_unnormalised": dict(feature_map="identity", normalize=False),
    "decay_gate": dict(feature_map="elu", decay="retnet", gate=True, normalize=False),
    "scan": dict(method="scan"),
}


def _x(seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, W), jnp.float32).astype(dtype)


def _layer(name, **kw):
    if name == "softmax_attention":
        return layers.SoftmaxAttention(W, H, max_length=32, rngs=nnx.Rngs(0), **kw)
    return layers.LinearAttention(
        W, H, chunk_size=4, rngs=nnx.Rngs(0), **LINEAR_OPTIONS[name], **kw
    )


class LayerTest(chex.TestCase):
    @parameterized.parameters(*LINEAR_OPTIONS, "softmax_attention")
    def test_prefill_then_steps_equals_full_forward(self, name):
        layer, x = _layer(name), _x()
        # Jitted (eager, each layer ran op by op); one compile serves every step.
        full = nnx.jit(lambda layer, x: layer(x))(layer, x)
        chex.assert_shape(full, (B, T, W))
        run = nnx.jit(lambda layer, x, state: layer(x, state=state, return_state=True))
        y, state = run(layer, x[:, :6], layer.init_state(B))
        outs = [y]
        for i in range(6, T):
            y, state = run(layer, x[:, i : i + 1], state)
            outs.append(y)
        chex.assert_trees_all_close(jnp.concatenate(outs, 1), full, atol=1e-5, rtol=1e-5)
        chex.assert_trees_all_equal(state.position, jnp.full((B,), T, jnp.int32))

    @parameterized.parameters("elu", "hedgehog", "softmax_attention")
    def test_bfloat16_compute_with_float32_params(self, name):
        layer = _layer(name, dtype=jnp.bfloat16)
        y = layer(_x(dtype=jnp.bfloat16))
        chex.assert_shape(y, (B, T, W))
        chex.assert_type(y, jnp.bfloat16)
        params = nnx.state(layer, nnx.Param)
        chex.assert_trees_all_equal_dtypes(
            params, jax.tree.map(lambda p: jnp.zeros((), jnp.float32), params)
        )

    @parameterized.parameters(*LINEAR_OPTIONS, "softmax_attention")
    def test_every_parameter_gets_a_gradient(self, name):
        layer = _layer(name)
        x = _x(1)
        grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(layer)
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            assert bool(jnp.any(g != 0)), f"all-zero gradient at {jax.tree_util.keystr(path)}"

    @parameterized.product(name=["elu", "hedgehog", "softmax_attention"], causal=[True, False])
    def test_padding_does_not_change_real_tokens(self, name, causal):
        layer = _layer(name, causal=causal)
        x = _x(2)
        real = layer(x[:, :7])
        mask = jnp.arange(T)[None, :] < 7
        padded = layer(x, key_mask=jnp.broadcast_to(mask, (B, T)))
        chex.assert_trees_all_close(padded[:, :7], real, atol=1e-5, rtol=1e-5)

    def test_hedgehog_starts_as_identity_softmax(self):
        phi = layers.HedgehogFeatureMap(H, 3, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.PRNGKey(3), (B, T, H, 3))
        expected = jax.nn.softmax(jnp.concatenate([x, -x], -1), axis=-1)
        chex.assert_trees_all_close(phi(x), expected, atol=1e-6)

    def test_random_features_redraw(self):
        layer = _layer("favor_plus")
        before = layer.projection[...]
        layer.redraw_features(jax.random.PRNGKey(5))
        assert layer.projection[...].shape == before.shape
        assert not bool(jnp.allclose(layer.projection[...], before))
        params = jax.tree_util.tree_leaves_with_path(nnx.state(layer, nnx.Param))
        assert not any("projection" in jax.tree_util.keystr(p) for p, _ in params)

    def test_linen_bridge(self):
        class Net(linen.Module):
            @linen.compact
            def __call__(self, x):
                x = bridge.to_linen(layers.LinearAttention, W, H, chunk_size=4)(x)
                return linen.Dense(3)(x)

        net = Net()
        variables = net.init(jax.random.PRNGKey(0), _x())
        assert "q_proj" in variables["params"]["ToLinen_0"]
        chex.assert_shape(net.apply(variables, _x()), (B, T, 3))


class ModelTest(chex.TestCase):
    def test_language_model_untied_and_sampling(self):
        model = models.LanguageModel(37, W, 1, H, tie_embeddings=False, rngs=nnx.Rngs(0))
        prompt = jnp.zeros((B, 3), jnp.int32)
        out = model.generate(prompt, steps=4, rng=jax.random.PRNGKey(0), temperature=1.0)
        chex.assert_shape(out, (B, 7))
        assert bool(jnp.all((out >= 0) & (out < 37)))
        grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(out))))(model)  # one program
        assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))

    @parameterized.parameters("linear", "softmax")
    def test_classifier_padding_and_shapes(self, attention):
        model = models.SequenceClassifier(37, 5, W, 2, H, attention=attention, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, 37)
        logits = helpers.call(model, tokens[:, :7])
        chex.assert_shape(logits, (B, 5))
        padded = tokens.at[:, 7:].set(0)
        mask = jnp.broadcast_to(jnp.arange(T)[None] < 7, (B, T))
        chex.assert_trees_all_close(helpers.call(model, padded, key_mask=mask), logits, atol=1e-5)


class BadConfigTest(parameterized.TestCase):
    def test_errors(self):
        rngs = nnx.Rngs(0)
        with pytest.raises(ValueError, match=r"feature_map must be one of"):
            layers.LinearAttention(W, H, feature_map="nope", rngs=rngs)
        with pytest.raises(ValueError, match=r"num_heads=3 must divide the width 16"):
            layers.LinearAttention(W, 3, rngs=rngs)
        with pytest.raises(ValueError, match=r"num_heads=5 must divide the width 16"):
            layers.SoftmaxAttention(W, 5, rngs=rngs)
        with pytest.raises(ValueError, match=r"method must be one of"):
            layers.LinearAttention(W, H, method="fft", rngs=rngs)
        with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\]"):
            layers.LinearAttention(W, H, decay=1.5, rngs=rngs)
        with pytest.raises(ValueError, match=r"attention must be one of"):
            layers.TransformerBlock(W, H, attention="sparse", rngs=rngs)
        softmax = layers.SoftmaxAttention(W, H, rngs=rngs)
        with pytest.raises(ValueError, match=r"no segment_ids with a KV cache"):
            softmax(_x(), segment_ids=jnp.zeros((B, T), jnp.int32), return_state=True)
        encoder = layers.LinearAttention(W, H, causal=False, rngs=rngs)
        with pytest.raises(ValueError, match=r"decoding needs a causal layer"):
            encoder.init_state(B)
        with pytest.raises(ValueError, match=r"decoding .* needs a causal layer"):
            encoder(_x(), return_state=True)
        with pytest.raises(ValueError, match=r"x must have shape \[batch, length, 16\]"):
            encoder(jnp.ones((B, T, 8)))
        with pytest.raises(ValueError, match=r"has no random features"):
            encoder.redraw_features(jax.random.PRNGKey(0))
