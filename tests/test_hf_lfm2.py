"""LFM2's checkpoints (``linattn_jax.hf.lfm2``, ``lfm2_moe``, ``lfm3``) against
``transformers``' own PyTorch models (CPU, float32), each a tiny random model made here with
every layer type and option of its type, random norms and biases: logits to 1e-5 normwise
(LFM3's past its window), prefill then decode steps == the full forward, 16 greedy tokens, a
left-padded row == the row alone, the save round trip, ``--config.init_from``; then each
type's own: LFM2's MLP width rule, legacy names and ``full_attn_idxs``; LFM2-MoE's router
where its sum's 1e-6 counts; LFM3's defaults; the bad fields named.

- ``lfm2``: a gated short convolution (biased, random biases) and a QK-normed GQA layer, an
  MLP width ``block_auto_adjust_ff_dim`` rounds (72), an untied head.
- ``lfm2_moe``: a convolution with a dense MLP, then an attention layer with a mixture
  (random router and ``expert_bias``, so that the choice and the weights differ), tied.
- ``lfm3``: a convolution, a full layer of proportional RoPE over a quarter of the head, a
  sliding layer of 5 tokens, attention biases and gates, sandwich norms, untied.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 300.0},
    "full_attention": {
        "rope_type": "proportional", "rope_theta": 500.0, "partial_rotary_factor": 0.25,
    },
}  # fmt: skip


def _lfm2():
    config = transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=70, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5, conv_bias=True,
        conv_L_cache=3, block_multiple_of=8, block_ffn_dim_multiplier=1.5,
        layer_types=["conv", "full_attention"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip
    return helpers.randomized_biases(transformers.Lfm2ForCausalLM(config))


def _lfm2_moe():
    config = transformers.Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5,
        conv_L_cache=4, num_dense_layers=1, num_experts=6, num_experts_per_tok=2,
        routed_scaling_factor=1.5, layer_types=["conv", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip
    model = transformers.Lfm2MoeForCausalLM(config)
    # transformers makes expert_bias 0 and the router small
    return helpers.randomized_named(model, ("feed_forward.gate.weight", "expert_bias"), 0.5)


def _lfm3():
    config = transformers.Lfm3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, norm_eps=1e-5,
        conv_L_cache=4, sliding_window=5, attention_bias=True, tie_word_embeddings=False,
        layer_types=["conv", "full_attention", "sliding_attention"], rope_parameters=ROPE,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return helpers.randomized_biases(transformers.Lfm3ForCausalLM(config))


MODELS = {"lfm2": _lfm2, "lfm2_moe": _lfm2_moe, "lfm3": _lfm3}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``name -> (torch model, its directory, our model, our config)`` of ``MODELS``, each
    made once."""
    made = {}

    def pair(name: str) -> tuple:
        if name not in made:
            made[name] = helpers.torch_pair(tmp_path_factory, name, MODELS[name], 1.0)
        return made[name]

    return pair


@pytest.mark.parametrize("name", MODELS)
def test_logits_decoding_and_left_padding_match(pairs, name):
    helpers.assert_matches_decodes_and_pads(pairs(name), VOCAB, RTOL)


@pytest.mark.parametrize("name", MODELS)
def test_save_pretrained_round_trip_through_transformers(pairs, name, tmp_path):
    helpers.assert_round_trips(pairs(name), tmp_path)


@pytest.mark.parametrize("name", MODELS)
def test_init_from_builds_the_checkpoints_model(pairs, name, tmp_path):
    ref, _, model, _ = pairs(name)
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_lfm2_legacy_names_layer_indices_and_bad_fields(pairs):
    _, _, _, config = pairs("lfm2")
    fmt = hf.lfm2.FORMAT
    raw = {k: v for k, v in config.items() if k not in ("layer_types", "intermediate_size")}
    raw.update(full_attn_idxs=[1], block_ff_dim=70, tie_embedding=True)
    ref = pairs("lfm2")[0]
    assert ref.model.layers[0].feed_forward.w1.out_features == 72  # 2/3 of 70, * 1.5, up to 8s
    read = fmt.normalize_config(raw)
    assert read["layer_types"] == config["layer_types"]
    assert (read["intermediate_size"], read["tie_word_embeddings"]) == (70, True)
    assert fmt.model_options({**config, "block_auto_adjust_ff_dim": False})["mlp_hidden"] == 70
    assert fmt.model_options({**config, "block_ffn_dim_multiplier": None})["mlp_hidden"] == 46
    for field, value, message in [
        ("layer_types", ["conv", "sliding_attention"], r"layer_types must list"),
        ("conv_L_cache", 0, r"conv_L_cache must be an int >= 1, got 0"),
        ("conv_bias", 1, r"conv_bias must be true or false"),
        ("block_ffn_dim_multiplier", -1, r"block_ffn_dim_multiplier must be a number > 0"),
        ("intermediate_size", 1, r"intermediate_size=1 makes an MLP of width 0"),
        ("num_key_value_heads", 3, r"num_key_value_heads=3 must divide"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})


def test_lfm2_moe_router_of_small_scores_matches(pairs):
    """Scores near 0 (logits near -12), where the sum's 1e-6 matters (a weight of 0.46, not
    0.5): our model's router against ``transformers``' own on the same tokens."""
    ref, _, model, _ = pairs("lfm2_moe")
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


def test_lfm2_moe_reads_the_fused_layout(pairs, tmp_path):
    helpers.assert_reads_the_fused_layout(pairs("lfm2_moe"), tmp_path)


def test_lfm2_moe_bad_fields(pairs):
    _, _, _, config = pairs("lfm2_moe")
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


def test_lfm3_defaults_and_bad_fields(pairs):
    _, _, _, config = pairs("lfm3")
    fmt = hf.lfm3.FORMAT
    raw = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    read = fmt.normalize_config({**raw, "num_hidden_layers": 5})
    assert read["layer_types"] == ["conv", "conv", "full_attention", "conv", "sliding_attention"]
    assert read["rope_parameters"]["full_attention"]["rope_type"] == "proportional"
    for field, value, message in [
        ("layer_types", ["conv", "mlp", "conv"], r"layer_types must list"),
        ("sliding_window", 0, r"sliding_window must be an int >= 1, got 0"),
        ("use_attention_gate", 1, r"use_attention_gate must be true or false"),
        ("rope_parameters", {"chunked": {}}, r"rope_parameters must be one dict per layer type"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
