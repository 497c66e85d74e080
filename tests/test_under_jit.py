"""Every public entry point under ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``nnx.jit`` with
closed-over concrete inputs (issue 40, items 2 and 5).

A closed-over array is concrete while jit traces, but whatever ``jnp`` computes from it
is staged: a check written as ``int(jnp.min(tokens))`` raised ``ConcretizationTypeError``
there. Each case compares the transformed call with the eager one, and checks that a bad
concrete input closed over still raises its ``ValueError``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linattn_jax as la
from linattn_jax import layers, models

V = 16
TOKENS = jnp.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], jnp.int32)
MASK = jnp.array([[False, False, True, True, True, True], [True] * 6])  # left padding
BAD = TOKENS.at[0, 0].set(V)  # an id outside the vocabulary


def _loss(logits):
    return jnp.sum(jnp.square(logits))


def _close(a, b):
    chex.assert_trees_all_close(a, b, atol=1e-5, rtol=1e-5)


def test_language_model_under_transforms():
    model = models.LanguageModel(V, 8, 1, 2, rngs=nnx.Rngs(0))
    expected = model(TOKENS, key_mask=MASK)
    _close(nnx.jit(lambda m: m(TOKENS, key_mask=MASK))(model), expected)
    grads = nnx.grad(lambda m: _loss(m(TOKENS, key_mask=MASK)))(model)
    _close(nnx.jit(nnx.grad(lambda m: _loss(m(TOKENS, key_mask=MASK))))(model), grads)
    _close(jax.jit(lambda t, k: model(t, key_mask=k))(TOKENS, MASK), expected)
    rows = jax.vmap(lambda t, k: model(t[None], key_mask=k[None])[0])(TOKENS, MASK)
    _close(rows, expected)
    with pytest.raises(ValueError, match="token ids must lie in"):
        nnx.jit(lambda m: m(BAD))(model)


def test_sequence_classifier_under_transforms():
    model = models.SequenceClassifier(V, 3, 8, 1, 2, rngs=nnx.Rngs(0))
    expected = model(TOKENS, key_mask=MASK)
    _close(nnx.jit(lambda m: m(TOKENS, key_mask=MASK))(model), expected)
    grads = nnx.grad(lambda m: _loss(m(TOKENS, key_mask=MASK)))(model)
    _close(nnx.jit(nnx.grad(lambda m: _loss(m(TOKENS, key_mask=MASK))))(model), grads)
    rows = jax.vmap(lambda t, k: model(t[None], key_mask=k[None])[0])(TOKENS, MASK)
    _close(rows, expected)
    with pytest.raises(ValueError, match="token ids must lie in"):
        nnx.jit(lambda m: m(BAD))(model)


def test_generate_under_jit():
    model = models.LanguageModel(V, 8, 1, 2, rngs=nnx.Rngs(0))
    expected = model.generate(TOKENS, 3, temperature=0.0, prompt_mask=MASK)
    closed = jax.jit(lambda: model.generate(TOKENS, 3, temperature=0.0, prompt_mask=MASK))()
    np.testing.assert_array_equal(closed, expected)
    traced = jax.jit(lambda p, k: model.generate(p, 3, temperature=0.0, prompt_mask=k))
    np.testing.assert_array_equal(traced(TOKENS, MASK), expected)
    hole = MASK.at[0, 3].set(False)
    with pytest.raises(ValueError, match="left padding only"):
        jax.jit(lambda: model.generate(TOKENS, 3, temperature=0.0, prompt_mask=hole))()


def test_positions_closed_over():
    """A position-aware feature map's ``positions`` closed over: their span is checked
    with numpy, not with the array's own (staged) ``max``."""
    q = jax.random.normal(jax.random.key(0), (1, 6, 2, 4))
    positions = jnp.broadcast_to(jnp.arange(6), (1, 6))
    phi = la.feature_maps.cosformer(8)
    expected = la.causal_linear_attention(q, q, q, feature_map=phi, positions=positions)
    out = jax.jit(
        lambda q: la.causal_linear_attention(q, q, q, feature_map=phi, positions=positions)
    )
    _close(out(q), expected)
    far = positions * 4  # a span of 20 > max_length 8
    with pytest.raises(ValueError, match="max_length"):
        jax.jit(lambda q: la.causal_linear_attention(q, q, q, feature_map=phi, positions=far))(q)


def test_softmax_cache_closed_over():
    """Item 5: a softmax layer's KV cache closed over by a jitted function."""
    layer = layers.SoftmaxAttention(8, 2, rope=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    cache = layer.init_state(2, 8)
    expected = layer(x, key_mask=MASK, state=cache, return_state=True)
    _close(nnx.jit(lambda m: m(x, key_mask=MASK, state=cache, return_state=True))(layer), expected)
    grads = nnx.grad(lambda m: _loss(m(x, state=cache, return_state=True)[0]))(layer)
    _close(
        nnx.jit(nnx.grad(lambda m: _loss(m(x, state=cache, return_state=True)[0])))(layer), grads
    )
    full = expected[1]  # 6 of 8 slots written: 6 more do not fit
    with pytest.raises(ValueError, match="KV cache holds 8 tokens: 6 written"):
        nnx.jit(lambda m: m(x, state=full, return_state=True))(layer)


def test_language_model_state_closed_over():
    """Item 5: a LanguageModel state with a softmax layer, closed over, then decoding."""
    model = models.LanguageModel(V, 8, 1, 2, attention="softmax", rngs=nnx.Rngs(0))
    state = model.init_state(2, 8)
    logits, state = model(TOKENS, key_mask=MASK, state=state, return_state=True)
    expected = model(TOKENS[:, :1], state=state, return_state=True)
    _close(nnx.jit(lambda m: m(TOKENS[:, :1], state=state, return_state=True))(model), expected)


@pytest.mark.parametrize("kind", ["linear", "kda"])
def test_layers_closed_over_masks(kind):
    """The recurrent layers with a closed-over ``key_mask`` and ``segment_ids`` (these
    passed before the fix too: a guard that their checks stay tracing-safe)."""
    layer = layers.make_attention(kind, 8, 2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    ids = jnp.array([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]], jnp.int32)
    call = lambda m: _loss(m(x, key_mask=MASK, segment_ids=ids))  # noqa: E731
    _close(nnx.jit(call)(layer), call(layer))
    _close(nnx.jit(nnx.grad(call))(layer), nnx.grad(call)(layer))
