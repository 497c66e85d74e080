"""DeltaRuleAttention with published shapes: ``head_dim`` (dk), ``value_head_dim`` (dv),
``expand_v`` and grouped value heads (``num_v_heads``), against the recipe written out in
float64 numpy with each q and k head repeated for its group of value heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import layers
from tests import helpers

B, T, W = 2, 9, 16


def _np(p):
    return np.asarray(p[...], np.float64)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _reference(layer, x):
    """The recipe per token; value head j reads q and k head j // (hv / h)."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, hv, dk, dv = layer.num_heads, layer.num_v_heads, layer.key_dim, layer.value_dim
    qkv = np.concatenate([x @ _np(p.kernel) for p in (layer.q_proj, layer.k_proj, layer.v_proj)], -1)  # fmt: skip
    kernel = _np(layer.conv.kernel)
    n = kernel.shape[0] - 1
    padded = np.concatenate([np.zeros((b, n, qkv.shape[-1])), qkv], 1)
    qkv = _silu(sum(kernel[i] * padded[:, i : i + t] for i in range(n + 1)))
    q, k = (qkv[..., i * h * dk : (i + 1) * h * dk].reshape(b, t, h, dk) for i in (0, 1))
    v = qkv[..., 2 * h * dk :].reshape(b, t, hv, dv)
    q, k = (y / np.sqrt(np.sum(y * y, -1, keepdims=True) + 1e-6) for y in (q, k))
    group = [j * h // hv for j in range(hv)]  # the key head of each value head
    q, k = q[:, :, group], k[:, :, group]
    beta = 1.0 / (1.0 + np.exp(-(x @ _np(layer.beta_proj.kernel))))  # [b, t, hv]
    a = x @ _np(layer.gate.proj.kernel) + _np(layer.gate.dt_bias)
    alpha = np.exp(-np.exp(_np(layer.gate.A_log)) * np.log1p(np.exp(a)))  # [b, t, hv]
    out, s = np.zeros((b, t, hv, dv)), np.zeros((b, hv, dk, dv))
    for i in range(t):
        s = alpha[:, i, :, None, None] * s
        error = v[:, i] - np.einsum("bhkv,bhk->bhv", s, k[:, i])
        s = s + beta[:, i, :, None, None] * k[:, i, :, :, None] * error[..., None, :]
        out[:, i] = np.einsum("bhkv,bhk->bhv", s, q[:, i] / np.sqrt(dk))
    out = out / np.sqrt(np.mean(out * out, -1, keepdims=True) + 1e-6) * _np(layer.output_norm.scale)
    out = out * _silu(x @ _np(layer.g_proj.kernel)).reshape(b, t, hv, dv)
    return out.reshape(b, t, hv * dv) @ _np(layer.out_proj.kernel), s


SHAPES = {
    "dk_dv": dict(head_dim=6, value_head_dim=10),
    "expand_v": dict(head_dim=4, expand_v=2),
    "grouped": dict(num_v_heads=4),
    "qwen35_like": dict(head_dim=8, value_head_dim=8, num_v_heads=4),
}


def _layer(**kw):
    return layers.DeltaRuleAttention(W, 2, chunk_size=4, rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("name", list(SHAPES))
def test_layer_equals_recipe_with_repeated_qk(name):
    layer = _layer(**SHAPES[name])
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, W))
    y, cache = layer(x, return_state=True, state=layer.init_state(B))
    ref, ref_s = _reference(layer, x)
    np.testing.assert_allclose(y, ref, **helpers.tol(jnp.float32))
    np.testing.assert_allclose(cache.state.s, ref_s, atol=2e-5, rtol=2e-5)
    hv, dk, dv = layer.num_v_heads, layer.key_dim, layer.value_dim
    assert cache.state.s.shape == (B, hv, dk, dv)
    assert cache.conv.shape == (B, 3, 2 * 2 * dk + hv * dv)


# Jitted (eager, the layer and its gradient ran op by op: most of the test's time).
_forward = nnx.jit(lambda layer, x: layer(x))
_run = nnx.jit(lambda layer, x, state: layer(x, state=state, return_state=True))
_grads = nnx.jit(nnx.grad(lambda layer, x: jnp.sum(jnp.sin(layer(x)))))


@pytest.mark.parametrize("name", ["grouped", "dk_dv"])
def test_prefill_then_steps_equal_full_forward_and_gradients_reach_everything(name):
    layer = _layer(**SHAPES[name])
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, W))
    full = _forward(layer, x)
    y, cache = _run(layer, x[:, :5], layer.init_state(B))
    outs = [y]
    for i in range(5, T):
        y, cache = _run(layer, x[:, i : i + 1], cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5, rtol=1e-5)
    grads = _grads(layer, x)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_v_heads=3), r"num_v_heads must be a multiple of num_heads=2, got 3"),
        (dict(head_dim=0), r"head_dim must be an int >= 1"),
        (dict(expand_v=0.3), r"expand_v must be a number > 0 making head_dim \* expand_v an int"),
        (dict(value_head_dim=4, expand_v=2), r"give value_head_dim or expand_v, not both"),
    ],
)
def test_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        _layer(**kw)


def test_width_need_not_divide_with_head_dim():
    layer = layers.DeltaRuleAttention(12, 5, head_dim=4, num_v_heads=10, rngs=nnx.Rngs(0))
    assert layer(jnp.ones((1, 3, 12))).shape == (1, 3, 12)
