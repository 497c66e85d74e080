"""The mixture of experts (linattn_jax.layers.moe) against a dense reference written here:
every token through every expert, weighted by top-k weights chosen by numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax.layers import moe
from tests.helpers import assert_close_normwise, call


def scores_of(logits, score):
    return jax.nn.softmax(logits, -1) if score == "softmax" else jax.nn.sigmoid(logits)


def reference_choice(logits, top_k, *, score, bias, groups, top_groups):
    """Bool ``[n, e]``: each token's top-k experts, chosen by numpy on concrete values."""
    choice = np.asarray(scores_of(logits, score)) + (0 if bias is None else np.asarray(bias))
    n, e = choice.shape
    chosen = np.zeros((n, e), bool)
    per = e // groups
    for i in range(n):
        allowed = np.ones(e, bool)
        if groups > 1:
            group_score = [
                np.sort(choice[i, g * per : (g + 1) * per])[-2:].sum() for g in range(groups)
            ]
            best = np.argsort(group_score)[::-1][:top_groups]
            allowed = np.repeat(np.isin(np.arange(groups), best), per)
        candidates = np.where(allowed, choice[i], -np.inf)
        chosen[i, np.argsort(candidates)[::-1][:top_k]] = True
    return chosen


def reference_weights(logits, chosen, *, score, normalize, scaling):
    """Dense ``[n, e]`` combine weights: zero but where ``chosen`` (the gradient flows
    through the scores alone)."""
    weights = jnp.where(chosen, scores_of(logits, score), 0.0)
    if normalize:
        weights = weights / jnp.sum(weights, -1, keepdims=True)
    return weights * scaling


def layer_choice(layer: moe.MoE, x):
    """``reference_choice`` of ``layer``'s router on ``x [..., width]``."""
    bias = None if layer.bias is None else layer.bias[...]
    logits = x.reshape(-1, x.shape[-1]) @ layer.router[...]
    return reference_choice(
        logits, layer.top_k, score=layer.score, bias=bias, groups=layer.num_groups,
        top_groups=layer.top_k_groups,
    )  # fmt: skip


def reference_moe(layer: moe.MoE, x, chosen):
    """``layer``'s output with every token through every expert (``[n, e, width]``), the
    experts ``chosen`` (``layer_choice``) weighted."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ layer.router[...]
    weights = reference_weights(
        logits, chosen, score=layer.score, normalize=layer.normalize, scaling=layer.scaling
    )
    gate, up, down = layer.gate[...], layer.up[...], layer.down[...]
    h = jax.nn.silu(jnp.einsum("nd,edh->neh", flat, gate)) * jnp.einsum("nd,edh->neh", flat, up)
    out = jnp.einsum("ne,ned->nd", weights, jnp.einsum("neh,ehd->ned", h, down))
    if layer.shared is not None:
        s = layer.shared
        shared = jax.nn.silu(flat @ s.gate_proj.kernel[...]) * (flat @ s.up_proj.kernel[...])
        shared = shared @ s.down_proj.kernel[...]
        if layer.shared_gate is not None:
            shared = shared * jax.nn.sigmoid(flat @ layer.shared_gate.kernel[...])
        out = out + shared
    return out.reshape(x.shape)


# A covering set of the router's variants (each option on in some case).
VARIANTS = {
    "softmax": dict(score="softmax"),
    "softmax_normalized_shared_gate": dict(
        score="softmax", normalize=True, shared_hidden=6, shared_gate=True
    ),
    "sigmoid_bias_scaled": dict(score="sigmoid", normalize=True, scaling=2.5, score_bias=True),
    "grouped": dict(
        score="sigmoid",
        normalize=True,
        scaling=1.5,
        score_bias=True,
        num_groups=4,
        top_k_groups=2,
        shared_hidden=5,
    ),  # fmt: skip
}


def make_layer(dtype=jnp.float64, **options) -> moe.MoE:
    layer = moe.MoE(8, 8, 3, 6, rngs=nnx.Rngs(0), param_dtype=dtype, **options)
    if layer.bias is not None:
        layer.bias[...] = (jax.random.normal(jax.random.key(5), (8,)) * 0.3).astype(jnp.float32)
    return layer


@pytest.mark.parametrize("method", ["ragged", "tiled"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_the_dense_reference_outputs_and_gradients(variant, method):
    with jax.enable_x64(True):
        layer = make_layer(**VARIANTS[variant], method=method)
        x = jax.random.normal(jax.random.key(1), (2, 7, 8), jnp.float64)
        cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float64)
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x, fn):
            return jnp.sum(fn(nnx.merge(graphdef, params, rest), x) * cotangent)

        ours = lambda layer, x: layer(x, record=False)
        chosen = layer_choice(layer, x)
        reference = lambda layer, x: reference_moe(layer, x, chosen)
        # Each under jit: one program, where eagerly every operation compiles on its own.
        forward = jax.jit(lambda p, x, fn: fn(nnx.merge(graphdef, p, rest), x), static_argnums=2)
        out = forward(params, x, ours)
        expected = forward(params, x, reference)
        assert out.dtype == jnp.float64
        assert_close_normwise(out, expected, 1e-12)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        grads = grad(params, x, ours)
        expected_grads = grad(params, x, reference)
        assert_close_normwise(grads, expected_grads, 1e-12)


def test_route_chooses_as_the_reference_and_drops_no_token():
    logits = jax.random.normal(jax.random.key(3), (11, 8))
    bias = jax.random.normal(jax.random.key(4), (8,)) * 0.3
    options = dict(score="sigmoid", normalize=True, scaling=2.0, bias=bias)
    routing = moe.route(logits, 3, **options, num_groups=4, top_k_groups=2)
    chosen = reference_choice(logits, 3, score="sigmoid", bias=bias, groups=4, top_groups=2)
    dense = reference_weights(logits, chosen, score="sigmoid", normalize=True, scaling=2.0)
    got = np.zeros((11, 8), bool)
    np.put_along_axis(got, np.asarray(routing.experts), True, axis=1)
    np.testing.assert_array_equal(got, chosen)
    np.testing.assert_allclose(
        np.asarray(jnp.take_along_axis(dense, routing.experts, 1)), routing.weights, rtol=1e-6
    )
    valid = jnp.arange(11) % 4 != 0  # 8 real tokens
    plan = moe.dispatch(routing.experts, valid, 8)
    assert int(jnp.sum(plan.group_sizes)) == 8 * 3  # every real token's k choices
    counts = np.bincount(np.asarray(routing.experts)[np.asarray(valid)].ravel(), minlength=8)
    np.testing.assert_array_equal(plan.group_sizes, counts)
    sorted_experts = np.asarray(routing.experts).ravel()[np.asarray(plan.order)][: 8 * 3]
    assert np.all(np.diff(sorted_experts) >= 0)
    np.testing.assert_array_equal(plan.order[plan.inverse], np.arange(33))


def test_padded_tokens_change_nothing_even_as_nan():
    layer = make_layer(jnp.float32, **VARIANTS["softmax_normalized_shared_gate"])
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    mask = jnp.array([[False, False, True, True, True, True], [True] * 5 + [False]])
    poisoned = jnp.where(mask[..., None], x, jnp.nan).at[1, 5, 0].set(jnp.inf)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x):
        model = nnx.merge(graphdef, params, rest)
        out = model(x, key_mask=mask)
        return jnp.sum(out**2) + jnp.sum(model.losses[...]), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (value, out), grads = grad(params, x)
    (value_p, out_p), grads_p = grad(params, poisoned)
    assert np.all(np.asarray(out)[~np.asarray(mask)] == 0)
    for a, b in ((value, value_p), (out, out_p), (grads, grads_p)):
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), a, b)
    assert np.all(np.asarray(grads[1])[~np.asarray(mask)] == 0)
    # The real tokens' outputs and losses are those of the real tokens alone.
    call(layer, poisoned, key_mask=mask)
    masked_losses = layer.losses[...]
    np.testing.assert_allclose(out[1:, :5], call(layer, x[1:, :5]), rtol=1e-5, atol=1e-6)
    real = x[mask]  # [9, 8]
    call(layer, real[None])
    np.testing.assert_allclose(masked_losses, layer.losses[...], rtol=1e-6)


def test_losses_follow_their_formulas():
    logits = jax.random.normal(jax.random.key(6), (10, 4)) * 2
    valid = jnp.arange(10) < 7
    routing = moe.route(logits, 2)
    probs, experts = np.asarray(routing.probs)[:7], np.asarray(routing.experts)[:7]
    f = np.array([(experts == i).sum() for i in range(4)]) / 7  # shares of the choices
    expected = 4 * np.sum(f * probs.mean(0))
    np.testing.assert_allclose(
        moe.load_balancing_loss(routing.probs, routing.experts, valid), expected, rtol=1e-6
    )
    z = np.log(np.exp(np.asarray(logits, np.float64)[:7]).sum(-1))
    np.testing.assert_allclose(moe.router_z_loss(logits, valid), np.mean(z**2), rtol=1e-6)
    # Perfect balance gives k: two tokens choosing disjoint experts with uniform probs.
    uniform = jnp.full((2, 4), 0.25)
    assert float(moe.load_balancing_loss(uniform, jnp.array([[0, 1], [2, 3]]))) == pytest.approx(2)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(top_k=9), "top_k"),
        (dict(score="relu"), "score"),
        (dict(num_groups=3), "num_groups"),
        (dict(num_groups=4, top_k_groups=5), "top_k_groups"),
        (dict(num_groups=4, top_k_groups=1), "top_k=3 exceeds"),
        (dict(shared_gate=True), "shared_gate"),
        (dict(normalize="yes"), "normalize"),
        (dict(method="dense"), "method must be one of"),
    ],
)
def test_bad_options_are_refused_by_name(options, message):
    kwargs = dict(width=8, num_experts=8, top_k=3, hidden=4) | options
    with pytest.raises(ValueError, match=message):
        moe.MoE(**kwargs, rngs=nnx.Rngs(0))


def test_an_input_of_another_width_is_refused_by_name():
    """#53 item 7: a ValueError naming the width, not ``dot_general``'s TypeError."""
    layer = moe.MoE(16, 4, 2, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 16\], got \(2, 3, 17\)"):
        layer(jnp.zeros((2, 3, 17)))


@pytest.mark.parametrize(
    "sizes", [[9, 0, 0, 4], [0, 0, 13, 0], [1, 2, 3, 4], [0, 0, 0, 0]], ids=str
)
def test_tiled_grouped_matmuls_equal_ragged_dot_and_skip_the_rows_past_the_groups(sizes):
    """The CPU form (``layers.grouped``: each expert's rows in whole tiles of 8 rows here)
    against ``ragged_dot`` on skewed, empty and odd groups: outputs and gradients, with NaN
    and inf in the rows past the groups (they give zeros and get zero gradient)."""
    with jax.enable_x64(True):
        m, sizes = 16, jnp.array(sizes, jnp.int32)
        n = int(sizes.sum())
        keys = jax.random.split(jax.random.key(6), 4)
        x = jax.random.normal(keys[0], (m, 5), jnp.float64)
        x = x.at[n:].set(jnp.array([jnp.nan, jnp.inf, -jnp.inf, 1.0, 2.0]))
        gate, up = (jax.random.normal(k, (4, 5, 7), jnp.float64) for k in keys[1:3])
        down = jax.random.normal(keys[3], (4, 7, 5), jnp.float64)
        real = (jnp.arange(m) < n)[:, None]

        def loss(method, x, *weights):
            out = moe.grouped_swiglu(x, *weights, sizes, method=method)
            return jnp.sum(jnp.where(real, out, 0) ** 2), out

        grad = jax.grad(loss, argnums=(1, 2, 3, 4), has_aux=True)
        (gx, *gw), out = grad("tiled", x, gate, up, down)
        clean = jnp.where(real, x, 0)  # ragged_dot's masked lowering would pass NaN on
        (_, *expected_gw), expected = grad("ragged", clean, gate, up, down)
        assert bool(jnp.all(out[n:] == 0)) and bool(jnp.all(gx[n:] == 0))
        assert bool(jnp.all(jnp.isfinite(gx)))
        if n:
            assert_close_normwise(out[:n], expected[:n], 1e-12)
        assert_close_normwise(gw, expected_gw, 1e-12)
        assert moe.grouped.tiles(sizes, m).tile == 8
