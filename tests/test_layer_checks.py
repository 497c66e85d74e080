"""Layer construction checks, Hedgehog's two forms against their equations, Based's feature_dim."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

import linattn_jax as la
from linattn_jax import feature_maps as fm
from linattn_jax import layers
from tests import helpers

B, T, H, D, DV, W = 2, 11, 2, 4, 3, 16  # T = 11 does not divide the chunk size 4


def _hedgehog(form: str, seed: int = 0) -> layers.HedgehogFeatureMap:
    """A Hedgehog map moved off its identity initialisation (W = I + noise, b != 0)."""
    phi = layers.HedgehogFeatureMap(H, D, form=form, rngs=nnx.Rngs(0))
    kw, kb = jax.random.split(jax.random.PRNGKey(seed))
    phi.kernel[...] = jnp.eye(D)[None] + 0.3 * jax.random.normal(kw, (H, D, D))
    phi.bias[...] = 0.2 * jax.random.normal(kb, (H, D))
    return phi


def _y(phi: layers.HedgehogFeatureMap, x) -> np.ndarray:
    """``x W_h + b_h`` in float64 (numpy), from the float32 inputs and parameters."""
    kernel, bias = (np.asarray(p[...], np.float64) for p in (phi.kernel, phi.bias))
    return np.einsum("bthd,hde->bthe", np.asarray(x, np.float64), kernel) + bias


def _direct(phi, q, k, v, *, causal: bool, key_weight: bool = False) -> np.ndarray:
    """The paper's attention in float64: weights ``K(q_i, k_j) = sum_e 2 cosh(yq + yk)``.

    ``key_weight``: divide each key's weight by ``c(k) = sum_e 2 cosh(yk)`` (what the
    softmax form computes under normalisation).
    """
    yq, yk = _y(phi, q), _y(phi, k)
    s = yq[:, :, None] + yk[:, None, :]  # [b, t, s, h, e]
    weights = np.sum(np.exp(s) + np.exp(-s), axis=-1)  # [b, t, s, h]
    if key_weight:
        weights = weights / np.sum(2 * np.cosh(yk), axis=-1)[:, None]
    if causal:
        weights = weights * np.tril(np.ones((q.shape[1], k.shape[1])))[None, :, :, None]
    num = np.einsum("btsh,bshv->bthv", weights, np.asarray(v, np.float64))
    return num / np.sum(weights, axis=2)[..., None]


class HedgehogFormTest(chex.TestCase):
    def test_paper_kernel_is_the_papers_equation(self):
        phi = _hedgehog("paper")
        q, k, _ = helpers.qkv(0, B, T, H, D, DV)
        kernel = jnp.sum(phi(q) * phi(k), axis=-1)  # both unshifted (key role)
        yq, yk = _y(phi, q), _y(phi, k)
        expected = np.sum(2 * np.cosh(yq + yk), axis=-1)
        np.testing.assert_allclose(np.asarray(kernel), expected, rtol=1e-5)
        # A query's features are the same vector scaled by exp(-max |y|): in (0, 1].
        shifted = jnp.sum(phi(q, is_query=True) * phi(k), axis=-1)
        scale = np.exp(-np.max(np.abs(yq), axis=-1))
        np.testing.assert_allclose(np.asarray(shifted), expected * scale, rtol=1e-5)
        assert float(jnp.max(phi(q, is_query=True))) == 1.0

    @parameterized.parameters("chunked", "scan", "quadratic")
    def test_paper_attention_matches_float64_direct(self, method):
        phi = _hedgehog("paper")
        q, k, v = helpers.qkv(1, B, T, H, D, DV)
        q, k = 2.0 * q, 2.0 * k
        tol = helpers.tol(jnp.float32)
        run = lambda **kw: la.causal_linear_attention(q, k, v, feature_map=phi, eps=0.0, **kw)
        out = run(method=method, chunk_size=4)
        chex.assert_trees_all_close(out, _direct(phi, q, k, v, causal=True), **tol)
        out = la.linear_attention(q, k, v, feature_map=phi, eps=0.0)
        chex.assert_trees_all_close(out, _direct(phi, q, k, v, causal=False), **tol)

    def test_paper_decoding_steps_match_float64_direct(self):
        phi = _hedgehog("paper", seed=1)
        q, k, v = helpers.qkv(2, B, T, H, D, DV)
        expected = _direct(phi, q, k, v, causal=True)
        state = la.init_state(B, H, 2 * D, DV)
        for i in range(T):
            out, state = la.causal_linear_attention_step(
                q[:, i], k[:, i], v[:, i], state, feature_map=phi, eps=0.0
            )
            chex.assert_trees_all_close(out, expected[:, i], **helpers.tol(jnp.float32))

    def test_paper_form_takes_queries_past_float32s_exp_range(self):
        """|y_q| ~ 150 overflows exp in float32 (past 88.7): the per-query shift keeps
        the output finite and equal to the float64 direct computation."""
        phi = _hedgehog("paper", seed=2)
        q, k, v = helpers.qkv(3, B, T, H, D, DV)
        q = 60.0 * q / jnp.max(jnp.abs(q))
        assert np.max(np.abs(_y(phi, q))) > 100.0
        out = la.causal_linear_attention(q, k, v, feature_map=phi, eps=0.0, chunk_size=4)
        assert bool(jnp.all(jnp.isfinite(out)))
        chex.assert_trees_all_close(
            out, _direct(phi, q, k, v, causal=True), **helpers.tol(jnp.float32)
        )

    def test_softmax_form_is_the_papers_kernel_reweighted_by_each_key(self):
        """The documented difference: under normalisation the softmax form weighs key j
        by K(q, k_j) / c(k_j), which is not the paper's attention."""
        softmax_form, paper = _hedgehog("softmax"), _hedgehog("paper")
        q, k, v = helpers.qkv(4, B, T, H, D, DV)
        out = la.causal_linear_attention(q, k, v, feature_map=softmax_form, eps=0.0)
        direct = _direct(paper, q, k, v, causal=True, key_weight=True)
        chex.assert_trees_all_close(out, direct, **helpers.tol(jnp.float32))
        assert not np.allclose(np.asarray(out), _direct(paper, q, k, v, causal=True), atol=1e-2)

    def test_layer_builds_the_paper_form(self):
        layer = layers.LinearAttention(
            W, H, feature_map="hedgehog", hedgehog_form="paper", rngs=nnx.Rngs(0)
        )
        assert layer.hedgehog.form == "paper" and layer.phi.requires_normalize
        default = layers.LinearAttention(W, H, feature_map="hedgehog", rngs=nnx.Rngs(0))
        assert default.hedgehog.form == "softmax" and not default.phi.requires_normalize
        q, k, v = helpers.qkv(5, B, T, H, D, DV)
        with pytest.raises(ValueError, match=FAVOR_NORMALIZE):  # the maths refuse it too
            la.causal_linear_attention(q, k, v, feature_map=layer.phi, normalize=False)


class FeatureDimTest(chex.TestCase):
    """Shapes here; a gradient reaching the reduced q/k projections, and prefill plus
    decoding steps equal to the full forward: test_layers.py's ``taylor_feature_dim``."""

    def test_shapes_and_state_size(self):
        d_prime = 3
        layer = layers.LinearAttention(
            W, H, feature_map="taylor", feature_dim=d_prime, chunk_size=4, rngs=nnx.Rngs(0)
        )
        chex.assert_shape((layer.q_proj.kernel[...], layer.k_proj.kernel[...]), (W, H * d_prime))
        chex.assert_shape(layer.v_proj.kernel[...], (W, W))
        assert layer.qk_dim == d_prime and layer.feature_dim == 1 + d_prime + d_prime**2
        state = layer.init_state(B)
        chex.assert_shape(state.state.s, (B, H, 1 + d_prime + d_prime**2, W // H))
        x = jax.random.normal(jax.random.PRNGKey(0), (B, T, W))
        chex.assert_shape(layer(x), (B, T, W))

    def test_based_state_at_head_dim_64(self):
        """1 + d' + d'^2 = 273 features per head at d' = 16, not 4,161 at d = 64."""
        build = lambda **kw: layers.LinearAttention(
            128, 2, feature_map="taylor", rngs=nnx.Rngs(0), **kw
        )
        assert build().feature_dim == 4161
        assert build(feature_dim=16).feature_dim == 273


def _linear(**kw):
    return layers.LinearAttention(W, H, rngs=nnx.Rngs(0), **kw)


def _block(**kw):
    return layers.TransformerBlock(W, H, rngs=nnx.Rngs(0), **kw)


FAVOR_NORMALIZE = r"only normalize=True cancels: use normalize=True"
BAD_CONSTRUCTIONS = {
    "width_0": (lambda: layers.LinearAttention(0, H, rngs=nnx.Rngs(0)), r"width must be an int"),
    "heads_0": (lambda: layers.LinearAttention(W, 0, rngs=nnx.Rngs(0)), r"num_heads must be an"),
    "softmax_width_0": (
        lambda: layers.SoftmaxAttention(0, H, rngs=nnx.Rngs(0)),
        r"width must be an int >= 1, got 0",
    ),
    "softmax_heads_0": (
        lambda: layers.SoftmaxAttention(W, 0, rngs=nnx.Rngs(0)),
        r"num_heads must be an int >= 1, got 0",
    ),
    "num_features_0": (
        lambda: _linear(feature_map="favor_plus", num_features=0),
        r"num_features must be an int >= 1, got 0",
    ),
    "decay_too_short": (
        lambda: _linear(decay=[0.9, 0.8, 0.7]),
        r"decay must be .* one per head \[num_heads=2\], got \[0.9, 0.8, 0.7\]",
    ),
    "decay_one_for_two_heads": (
        lambda: _linear(decay=[0.9]),
        r"decay must be .* one per head \[num_heads=2\]",
    ),
    "chunk_size_0": (lambda: _linear(chunk_size=0), r"chunk_size must be an int >= 1, got 0"),
    "feature_dim_0": (lambda: _linear(feature_dim=0), r"feature_dim must be an int >= 1, got 0"),
    "batch_0": (lambda: _linear().init_state(0), r"batch must be an int >= 1, got 0"),
    "identity_normalized": (
        lambda: _linear(feature_map="identity"),
        r"feature_map='identity' has a signed kernel.*use normalize=False",
    ),
    "identity_callable_normalized": (
        lambda: _linear(feature_map=fm.identity),
        r"has a signed kernel",
    ),
    "random_fourier_normalized": (
        lambda: _linear(feature_map="random_fourier"),
        r"feature_map='random_fourier' has a signed kernel",
    ),
    "favor_plus_unnormalized": (
        lambda: _linear(feature_map="favor_plus", normalize=False),
        FAVOR_NORMALIZE,
    ),
    "hedgehog_paper_unnormalized": (
        lambda: _linear(feature_map="hedgehog", hedgehog_form="paper", normalize=False),
        FAVOR_NORMALIZE,
    ),
    "hedgehog_form_unknown": (
        lambda: _linear(feature_map="hedgehog", hedgehog_form="fla"),
        r"hedgehog_form must be one of \('softmax', 'paper'\), got 'fla'",
    ),
    "hedgehog_form_unknown_other_map": (
        lambda: _linear(feature_map="elu", hedgehog_form="fla"),
        r"hedgehog_form must be one of",
    ),
    "hedgehog_map_form_unknown": (
        lambda: layers.HedgehogFeatureMap(H, D, form="exp", rngs=nnx.Rngs(0)),
        r"form must be one of",
    ),
    "block_width_0": (lambda: layers.TransformerBlock(0, H, rngs=nnx.Rngs(0)), r"width must be"),
    "block_heads_0": (
        lambda: layers.TransformerBlock(W, 0, rngs=nnx.Rngs(0)),
        r"num_heads must be an int >= 1, got 0",
    ),
    "block_mlp_ratio_0": (lambda: _block(mlp_ratio=0), r"mlp_ratio must be an int >= 1, got 0"),
    "block_short_conv_negative": (
        lambda: _block(short_conv=-1),
        r"short_conv must be an int >= 0, got -1",
    ),
    "block_chunk_size_0": (lambda: _block(chunk_size=0), r"chunk_size must be an int >= 1"),
    "block_attention_unknown": (
        lambda: _block(attention="sparse"),
        re.escape(f"attention must be one of {layers.ATTENTION_KINDS}, got 'sparse'"),
    ),
    "short_conv_size_0": (
        lambda: layers.CausalConv1D(W, 0, rngs=nnx.Rngs(0)),
        r"conv_size must be an int >= 1, got 0",
    ),
}


class ConstructionTest(parameterized.TestCase):
    @parameterized.parameters(*BAD_CONSTRUCTIONS)
    def test_bad_arguments_raise_at_construction(self, name):
        build, message = BAD_CONSTRUCTIONS[name]
        with pytest.raises(ValueError, match=message):
            build()

    def test_accepted_combinations_still_build(self):
        _linear(feature_map="identity", normalize=False)
        _linear(feature_map="random_fourier", num_features=4, normalize=False)
        _linear(feature_map="favor_plus", num_features=4)
        _linear(decay=[0.9, 0.8])
        _linear(decay=0.9)
        _linear(feature_map="hedgehog", hedgehog_form="softmax", normalize=False)
        # Options of other maps are ignored, so one config can sweep over maps.
        _linear(feature_map="elu", num_features=8, hedgehog_form="paper", max_length=64)


# #53 item 6: every layer kind (and the block) names the state type it expects.
@pytest.mark.parametrize("kind", [k for k in layers.ATTENTION_KINDS if k != "mlp"] + ["block"])
def test_a_state_of_another_layer_is_refused_by_name(kind):
    options = {"mamba2": dict(state_dim=4)}.get(kind, {})
    if kind == "block":
        layer = layers.TransformerBlock(8, 2, rngs=nnx.Rngs(0))
    else:
        layer = layers.make_attention(kind, 8, 2, rngs=nnx.Rngs(0), **options)
    other = layers.MLSTMLayer(8, 2, rngs=nnx.Rngs(0)) if kind == "mamba2" else None
    other = other or layers.Mamba2Mixer(8, 2, state_dim=4, rngs=nnx.Rngs(0))
    expected = type(layer.init_state(1)).__name__
    with pytest.raises(ValueError, match=rf"state must be an? {expected}, got "):
        layer(jnp.zeros((1, 1, 8)), state=other.init_state(1), return_state=True)
