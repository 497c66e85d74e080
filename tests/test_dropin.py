"""The layers as drop-ins for ``nnx.MultiHeadAttention``: cross-attention, dropout, keywords."""

import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized
from flax import nnx

import linattn_jax as la
from linattn_jax import layers
from tests import helpers

B, T, S, W, H = 2, 5, 7, 16, 2


def _heads(x):
    return x.reshape(x.shape[:-1] + (H, W // H))


def _reference(layer, x, kv, key_mask):
    """The layer's projections around the attention function itself."""
    q, k, v = _heads(layer.q_proj(x)), _heads(layer.k_proj(kv)), _heads(layer.v_proj(kv))
    if isinstance(layer, layers.LinearAttention):
        out = la.linear_attention(q, k, v, key_mask=key_mask, query_mask=jnp.ones((B, T), bool))
    else:
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = jax.nn.dot_product_attention(q, k, v, mask=mask)
    return layer.out_proj(out.reshape(B, T, W))


class DropInTest(parameterized.TestCase):
    @parameterized.parameters(layers.LinearAttention, layers.SoftmaxAttention)
    def test_cross_attention_with_padded_keys(self, cls):
        layer = cls(W, H, causal=False, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.PRNGKey(1), (B, T, W))
        kv = jax.random.normal(jax.random.PRNGKey(2), (B, S, W))
        key_mask = jnp.arange(S)[None, :] < jnp.array([[S], [4]])
        chex.assert_trees_all_close(
            helpers.call(layer, x, kv), _reference(layer, x, kv, None), atol=1e-5
        )
        poisoned = jnp.where(key_mask[..., None], kv, jnp.nan)
        out = helpers.call(layer, x, poisoned, key_mask=key_mask)
        chex.assert_trees_all_close(out, _reference(layer, x, kv, key_mask), atol=1e-5)
        grads = nnx.grad(lambda m: jnp.sum(m(x, poisoned, key_mask=key_mask) ** 2))(layer)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
        # Separate values: inputs_v replaces the values only.
        v_in = jax.random.normal(jax.random.PRNGKey(3), (B, S, W))
        out = helpers.call(layer, x, kv, v_in)
        q, k, v = _heads(layer.q_proj(x)), _heads(layer.k_proj(kv)), _heads(layer.v_proj(v_in))
        attend = la.linear_attention if cls is layers.LinearAttention else None
        if attend is not None:
            ref = layer.out_proj(
                attend(q, k, v, query_mask=jnp.ones((B, T), bool)).reshape(B, T, W)
            )
            chex.assert_trees_all_close(out, ref, atol=1e-5)

    @parameterized.parameters(layers.LinearAttention, layers.SoftmaxAttention)
    def test_dropout(self, cls):
        x = jax.random.normal(jax.random.PRNGKey(4), (B, T, W))
        plain = cls(W, H, rngs=nnx.Rngs(0))
        dropped = cls(W, H, dropout_rate=0.5, rngs=nnx.Rngs(0))
        chex.assert_trees_all_close(dropped(x, deterministic=True), plain(x))
        a, b = dropped(x), dropped(x)  # the layer's own stream advances
        assert not bool(jnp.allclose(a, plain(x))) and not bool(jnp.allclose(a, b))
        c = dropped(x, rngs=nnx.Rngs(dropout=7))
        d = dropped(x, rngs=nnx.Rngs(dropout=7))
        chex.assert_trees_all_close(c, d)  # the call's rngs decide the mask

    def test_errors(self):
        x = jnp.ones((B, T, W))
        with pytest.raises(ValueError, match=r"cross-attention\) need causal=False"):
            layers.LinearAttention(W, H, rngs=nnx.Rngs(0))(x, x)
        with pytest.raises(
            ValueError, match=r"inputs_k must have shape \[batch=2, key_length, 16\]"
        ):
            layers.SoftmaxAttention(W, H, causal=False, rngs=nnx.Rngs(0))(x, jnp.ones((B, S, 8)))
        with pytest.raises(
            ValueError, match=r"key_mask must have shape \[batch, length\]=\(2, 7\)"
        ):
            layers.LinearAttention(W, H, causal=False, rngs=nnx.Rngs(0))(
                x, jnp.ones((B, S, W)), key_mask=jnp.ones((B, T), bool)
            )
        with pytest.raises(ValueError, match=r"dropout_rate must be a number in \[0, 1\)"):
            layers.LinearAttention(W, H, dropout_rate=1.0, rngs=nnx.Rngs(0))
        with pytest.raises(TypeError, match=r"unexpected keyword arguments \['bogus'\]"):
            layers.SoftmaxAttention(W, H, chunk_size=4, bogus=1, rngs=nnx.Rngs(0))
        with pytest.raises(TypeError):
            layers.LinearAttention(W, H, bogus=1, rngs=nnx.Rngs(0))
        with pytest.raises(TypeError):
            layers.LinearAttention(W, H, rngs=nnx.Rngs(0))(x, bogus=1)
