"""LFM2-MoE checkpoints (``linattn_jax.hf.lfm2_moe``) against ``transformers``' own PyTorch
``Lfm2MoeForCausalLM`` (CPU, float32): a tiny random model made here of a gated short
convolution with a dense MLP, then an attention layer with a mixture (random router and
``expert_bias``, so that the choice and the weights differ), a tied head and random norms:
logits to 1e-5 normwise, prefill then decode steps == the full forward, 16 greedy tokens, a
left-padded row == the row alone, the save round trip, ``--config.init_from``, the bad
fields named."""

import jax.numpy as jnp
import numpy as np
import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _lfm2_moe():
    config = transformers.Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5,
        conv_L_cache=4, num_dense_layers=1, num_experts=6, num_experts_per_tok=2,
        routed_scaling_factor=1.5, layer_types=["conv", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip
    model = transformers.Lfm2MoeForCausalLM(config)
    with torch.no_grad():  # transformers makes expert_bias 0 and the router small
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("feed_forward.gate.weight", "expert_bias")):
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "lfm2_moe", _lfm2_moe, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_the_router_of_small_scores_matches(pair):
    """Scores near 0 (logits near -12), where the sum's 1e-6 matters (a weight of 0.46, not
    0.5): our model's router against ``transformers``' own on the same tokens."""
    ref, _, model, _ = pair
    theirs = ref.model.layers[1].feed_forward
    x = np.random.default_rng(1).normal(size=(5, 32)).astype(np.float32)
    router = -12.0 + 0.05 * np.random.default_rng(2).normal(size=(6, 32)).astype(np.float32)
    x = np.abs(x) / np.abs(x).sum(-1, keepdims=True)  # logits in about [-12.2, -11.8]
    moe = model.blocks[1].mlp
    saved = theirs.gate.weight.clone(), moe.router[...]
    try:  # the fixture's models are shared: their routers put back after
        with torch.no_grad():
            theirs.gate.weight.copy_(torch.tensor(router))
            _, weights, chosen = theirs.gate(torch.tensor(x), theirs.expert_bias)
        moe.router[...] = jnp.asarray(router.T)
        ours, _ = moe.route(jnp.asarray(x))
    finally:
        with torch.no_grad():
            theirs.gate.weight.copy_(saved[0])
        moe.router[...] = saved[1]
    np.testing.assert_array_equal(ours.experts, chosen.numpy())
    np.testing.assert_allclose(ours.weights, weights.numpy(), rtol=1e-5)
    assert np.all(ours.weights < 0.99 * 1.5 / 2)  # the 1e-6 counts


def test_bad_fields(pair):
    _, _, _, config = pair
    fmt = hf.lfm2_moe.FORMAT
    for field, value, message in [
        ("layer_types", None, r"layer_types must list num_hidden_layers=2"),
        ("num_experts_per_tok", 7, r"num_experts_per_tok=7 must be <= num_experts=6"),
        ("num_dense_layers", -1, r"num_dense_layers must be an int >= 0, got -1"),
        ("use_expert_bias", "yes", r"use_expert_bias must be true or false"),
        ("routed_scaling_factor", 0, r"routed_scaling_factor must be a finite number > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
