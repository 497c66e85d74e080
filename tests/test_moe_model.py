"""Mixtures of experts in models: chosen per layer (``mlp=[...]``), scanned and rematerialised
as the unrolled stack, their losses collected, decoding untouched by them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import models
from linattn_jax.layers import MLPS, MoE, SwiGLU, mlp_layout, moe
from tests import helpers

MOE = dict(num_experts=4, top_k=2, hidden=8, score="sigmoid", normalize=True, shared_hidden=8)
V, W = 32, 16


def _model(scan_layers=False, **kw):
    return models.LanguageModel(
        V, W, 2, 2, attention="linear", mlp=["swiglu", "moe"], moe=MOE, mlp_hidden=12,
        scan_layers=scan_layers, rngs=nnx.Rngs(0), **kw,
    )  # fmt: skip


def _loss(model, tokens):
    """Mean logit plus the MoE losses: every part reaches the gradient."""
    logits = model(tokens)
    return jnp.mean(logits * jnp.cos(logits)) + jnp.sum(moe.collect_losses(model))


def test_layers_take_their_own_mlp_and_scans_equal_the_unrolled_stack():
    unrolled = _model()
    assert isinstance(unrolled.blocks[0].mlp, SwiGLU) and isinstance(unrolled.blocks[1].mlp, MoE)
    scanned = _model(scan_layers=True, remat="full")
    assert scanned.period == 2
    for j in range(2):  # depth 2, period 2: each block stacked 1 deep
        nnx.update(
            scanned.blocks[j], jax.tree.map(lambda x: x[None], nnx.state(unrolled.blocks[j]))
        )
    for name in ("embed", "norm"):
        nnx.update(getattr(scanned, name), nnx.state(getattr(unrolled, name)))
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, V)
    grad = nnx.jit(nnx.value_and_grad(_loss))
    value, grads = grad(unrolled, tokens)
    value_s, grads_s = grad(scanned, tokens)
    np.testing.assert_allclose(value_s, value, rtol=1e-6)
    assert float(jnp.sum(moe.collect_losses(unrolled))) > 0
    np.testing.assert_allclose(moe.collect_losses(scanned), moe.collect_losses(unrolled), rtol=1e-6)
    for j in range(2):
        block = jax.tree.map(lambda x: x[0], grads_s["blocks"][j])
        helpers.assert_close_normwise(block, grads["blocks"][j], rtol=1e-5)
    assert float(jnp.max(jnp.abs(grads["blocks"][1]["mlp"]["router"]))) > 0
    # Decoding (a loop over the model it closes over) and a plain jit of a closure record
    # nothing and fail on nothing.
    before = moe.collect_losses(unrolled)
    out = unrolled.generate(tokens[:, :4], 3, temperature=0.0)
    full = jax.jit(lambda t: unrolled(t))(out[:, :-1])
    np.testing.assert_array_equal(jnp.argmax(full[:, 3:], -1), out[:, 4:])
    np.testing.assert_array_equal(moe.collect_losses(unrolled), before)


@pytest.mark.parametrize(
    "mlp, message", [(["moe"], "depth=2"), ("relu", "mlp must be one of"), (["gelu", 3], "3")]
)
def test_bad_mlp_layouts_are_refused(mlp, message):
    with pytest.raises(ValueError, match=message):
        mlp_layout(mlp, 2)
    assert "moe" in MLPS


def test_moe_blocks_need_their_options():
    with pytest.raises(ValueError, match="moe="):
        models.LanguageModel(V, W, 1, 2, mlp="moe", rngs=nnx.Rngs(0))
