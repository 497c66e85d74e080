"""No silent wrong answers: padding holding NaN/inf, full resets, dtypes, ranges, empty inputs."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

import linattn_jax as la
from linattn_jax import feature_maps, layers, models
from tests import helpers

B, T, H, D, DV = 2, 11, 3, 8, 5


def _poison(x, mask, value):
    """``x [b, t, ...]`` with ``value`` at the masked (padding) tokens."""
    pad = ~mask.reshape(mask.shape + (1,) * (x.ndim - 2))
    return jnp.where(pad, value, x)


class PaddingTest(parameterized.TestCase):
    """Padding never changes real tokens' outputs or gradients, whatever it holds."""

    def _check(self, fn, mask, q, k, v):
        # Jitted: one compile serves the clean and the poisoned inputs (eager, the forms
        # and their gradients ran op by op, twice).
        forward = jax.jit(fn)
        clean = forward(q, k, v)
        bad = [
            _poison(x, mask, val)
            for x, val in zip((q, k, v), (jnp.nan, jnp.inf, jnp.nan), strict=True)
        ]
        dirty = forward(*bad)
        real = mask[:, :, None, None]
        chex.assert_trees_all_close(jnp.where(real, dirty, 0), jnp.where(real, clean, 0))
        assert bool(jnp.all(jnp.where(real, 0.0, dirty) == 0)), "padded outputs must be 0"
        w = jax.random.normal(jax.random.PRNGKey(9), clean.shape)
        loss = lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v), 0) * w)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        g_clean = grad(q, k, v)
        g_dirty = grad(*bad)
        for gc, gd in zip(g_clean, g_dirty, strict=True):
            assert bool(jnp.all(jnp.isfinite(gd)))
            helpers.assert_close_normwise(gd, gc)

    @parameterized.product(method=la.METHODS, gated=[False, True])
    def test_causal(self, method, gated):
        q, k, v = helpers.qkv(0, B, T, H, D, DV)
        mask = helpers.key_mask(1, B, T)
        gate = helpers.gate(2, B, T, H) if gated else None
        gate = None if gate is None else _poison(gate, mask, jnp.nan)
        fn = lambda q, k, v: la.causal_linear_attention(
            q, k, v, method=method, chunk_size=4, key_mask=mask, gate=gate
        )
        self._check(fn, mask, q, k, v)

    @parameterized.parameters(*la.METHODS)
    def test_zero_eps(self, method):
        """With ``eps=0`` a padded query's denominator is exactly 0: its output is 0, not
        0/0, in every form (the chunked forms divide inside their chunks, where the last
        chunk's own padding meets the same 0), and no NaN reaches a gradient."""
        q, k, v = helpers.qkv(13, B, T, H, D, DV)
        mask = helpers.key_mask(14, B, T)
        fn = lambda q, k, v: la.causal_linear_attention(
            q, k, v, method=method, chunk_size=4, key_mask=mask, eps=0.0
        )
        self._check(fn, mask, q, k, v)
        fn = lambda q, k, v: la.linear_attention(q, k, v, key_mask=mask, eps=0.0)
        self._check(fn, mask, q, k, v)

    def test_non_causal(self):
        q, k, v = helpers.qkv(3, B, T, H, D, DV)
        mask = helpers.key_mask(4, B, T)
        self._check(lambda q, k, v: la.linear_attention(q, k, v, key_mask=mask), mask, q, k, v)

    def test_non_causal_cross_attention_query_mask(self):
        q, _, _ = helpers.qkv(5, B, 7, H, D, DV)
        _, k, v = helpers.qkv(6, B, T, H, D, DV)
        key_mask, query_mask = helpers.key_mask(7, B, T), helpers.key_mask(8, B, 7)
        fn = lambda q, k, v: la.linear_attention(q, k, v, key_mask=key_mask, query_mask=query_mask)
        out = fn(_poison(q, query_mask, jnp.nan), _poison(k, key_mask, jnp.inf), v)
        ref = fn(q, k, v)
        chex.assert_trees_all_close(out, ref)
        assert bool(jnp.all(jnp.where(query_mask[:, :, None, None], 0.0, out) == 0))

    def test_layer_and_classifier(self):
        layer = layers.LinearAttention(16, 2, causal=False, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.PRNGKey(10), (B, T, 16))
        mask = helpers.key_mask(11, B, T)
        real = mask[:, :, None]
        loss = lambda layer, x: jnp.sum(jnp.where(real, layer(x, key_mask=mask), 0) ** 2)
        forward = nnx.jit(lambda layer, x: layer(x, key_mask=mask))  # one compile for both
        clean_out, dirty_out = forward(layer, x), forward(layer, _poison(x, mask, jnp.nan))
        chex.assert_trees_all_close(jnp.where(real, dirty_out, 0), jnp.where(real, clean_out, 0))
        grad = nnx.jit(nnx.grad(loss))
        g_clean = grad(layer, x)
        g_dirty = grad(layer, _poison(x, mask, jnp.nan))
        helpers.assert_close_normwise(g_dirty, g_clean)
        model = models.SequenceClassifier(
            vocab_size=10, num_classes=3, width=16, depth=1, num_heads=2, rngs=nnx.Rngs(0)
        )
        tokens = jax.random.randint(jax.random.PRNGKey(12), (B, T), 0, 10)
        other = jnp.where(mask, tokens, 9)  # different padding tokens, same real ones
        classify = nnx.jit(lambda model, tokens: model(tokens, key_mask=mask))
        chex.assert_trees_all_close(classify(model, tokens), classify(model, other))


class GateAndDecayRangeTest(parameterized.TestCase):
    @parameterized.parameters(*la.METHODS)
    def test_minus_inf_gate_is_a_full_reset(self, method):
        q, k, v = helpers.qkv(13, B, T, H, D, DV)
        gate = helpers.gate(14, B, T, H).at[:, 5].set(-jnp.inf)
        out, state = la.causal_linear_attention(
            q, k, v, gate=gate, method=method, chunk_size=4, return_state=True
        )
        # The reset at token 5 equals starting a new segment there.
        seg = jnp.broadcast_to((jnp.arange(T) >= 5).astype(jnp.int32), (B, T))
        ref, ref_state = la.causal_linear_attention(
            q, k, v, gate=gate.at[:, 5].set(0.0), segment_ids=seg, method="scan", return_state=True
        )
        chex.assert_trees_all_close(out, ref, **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state, ref_state, **helpers.tol(jnp.float32))
        grads = jax.grad(
            lambda q, k, v, g: jnp.sum(
                la.causal_linear_attention(q, k, v, gate=g, method=method, chunk_size=4)
            ),
            argnums=(0, 1, 2, 3),
        )(q, k, v, gate)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)

    def test_traced_out_of_range_values_are_clamped_alike_in_every_form(self):
        q, k, v = helpers.qkv(15, B, T, H, D, DV)
        gate = helpers.gate(16, B, T, H).at[:, 3].set(50.0)  # a positive gate counts as 0
        clamped = gate.at[:, 3].set(0.0)
        for method in la.METHODS:
            fn = jax.jit(
                lambda g, d, m=method: la.causal_linear_attention(
                    q, k, v, gate=g, decay=d, method=m, chunk_size=4
                )
            )
            out = fn(gate, jnp.array([1.5, 0.9, -0.2]))  # decay > 1 -> 1, < 0 -> 0
            ref = fn(clamped, jnp.array([1.0, 0.9, 0.0]))
            assert bool(jnp.all(jnp.isfinite(out)))
            chex.assert_trees_all_close(out, ref, **helpers.tol(jnp.float32))

    def test_concrete_positive_gate_raises(self):
        q, k, v = helpers.qkv(17, B, T, H, D, DV)
        with pytest.raises(ValueError, match=r"gate must be log-decays <= 0, got a maximum of 50"):
            la.causal_linear_attention(q, k, v, gate=jnp.full((B, T, H), 50.0))


class InputTest(parameterized.TestCase):
    def test_integer_or_bool_inputs_raise(self):
        q, k, v = helpers.qkv(18, 1, 3, 1, 2, 1)
        for name, bad in [("v", jnp.ones((1, 3, 1, 1), jnp.int32)), ("q", q > 0)]:
            args = dict(q=q, k=k, v=v) | {name: bad}
            for fn in (la.linear_attention, la.causal_linear_attention):
                with pytest.raises(ValueError, match=rf"{name} must be a floating-point array"):
                    fn(**args)

    def test_signed_map_with_normalisation_is_refused(self):
        q, k, v = helpers.qkv(19, 1, 3, 1, 2, 1)
        with pytest.raises(ValueError, match=r"feature_map='identity' has a signed kernel"):
            la.causal_linear_attention(q, k, v, feature_map="identity")
        with pytest.raises(ValueError, match=r"has a signed kernel"):
            la.linear_attention(q, k, v, feature_map=feature_maps.identity)

    def test_cosformer_longer_than_max_length_raises(self):
        q, k, v = helpers.qkv(20, 1, 9, 1, 2, 1)
        phi = feature_maps.cosformer(max_length=8)
        la.causal_linear_attention(q, k, v, feature_map=phi)  # distances up to 8: fine
        with pytest.raises(ValueError, match=r"max_length=4, got positions spanning 8"):
            la.causal_linear_attention(q, k, v, feature_map=feature_maps.cosformer(4))
        with pytest.raises(ValueError, match=r"spanning 8"):
            la.linear_attention(q, k, v, feature_map=feature_maps.cosformer(4))

    @parameterized.parameters(*la.METHODS)
    def test_empty_sequence_returns_empty_output_and_the_same_state(self, method):
        q, k, v = helpers.qkv(21, B, 0, H, D, DV)
        s0 = helpers.random_state(22, B, H, D, DV)
        out, state = la.causal_linear_attention(
            q, k, v, method=method, initial_state=s0, return_state=True, decay=0.9
        )
        chex.assert_shape(out, (B, 0, H, DV))
        chex.assert_trees_all_equal(state, s0)
        chex.assert_shape(la.linear_attention(q, k, v), (B, 0, H, DV))
        grads = jax.grad(lambda q: jnp.sum(la.causal_linear_attention(q, k, v, method=method)))(q)
        chex.assert_shape(grads, q.shape)

    def test_empty_sequence_through_the_layer(self):
        layer = layers.LinearAttention(16, 2, rngs=nnx.Rngs(0))
        out = layer(jnp.zeros((B, 0, 16)))
        chex.assert_shape(out, (B, 0, 16))
        np.testing.assert_array_equal(out, np.zeros((B, 0, 16)))


# #53 item 5: the newer families' layers (ZeroDivisionError before) and a model over each.
EMPTY_KINDS = {
    "mamba2": dict(state_dim=4),
    "mlstm": {},
    "lightning": {},
    "rglru": {},
    "mamba": {},
}


@pytest.mark.parametrize("kind", sorted(EMPTY_KINDS))
def test_an_empty_sequence_through_the_newer_layers_and_their_models(kind):
    layer = layers.make_attention(kind, 16, 2, rngs=nnx.Rngs(0), **EMPTY_KINDS[kind])
    out, state = layer(jnp.zeros((B, 0, 16)), state=layer.init_state(B), return_state=True)
    chex.assert_shape(out, (B, 0, 16))
    chex.assert_trees_all_equal(state, layer.init_state(B))
    model = models.LanguageModel(
        7, 16, 1, 2, attention=kind, kind_options={kind: EMPTY_KINDS[kind]}, rngs=nnx.Rngs(0)
    )
    chex.assert_shape(model(jnp.zeros((B, 0), jnp.int32)), (B, 0, 7))


def test_an_empty_sequence_through_a_mixture_and_qk_norms_over_heads():
    moe = layers.MoE(16, 4, 2, 8, rngs=nnx.Rngs(0))
    chex.assert_shape(moe(jnp.zeros((B, 0, 16))), (B, 0, 16))
    assert bool(jnp.all(jnp.isfinite(moe.losses[...]))), "no token: no NaN loss recorded"
    softmax = layers.SoftmaxAttention(
        16, 2, qk_norm=True, qk_norm_over_heads=True, rngs=nnx.Rngs(0)
    )
    chex.assert_shape(softmax(jnp.zeros((B, 0, 16))), (B, 0, 16))
