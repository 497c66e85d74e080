"""LFM2 checkpoints (``linattn_jax.hf.lfm2``) against ``transformers``' own PyTorch
``Lfm2ForCausalLM`` (CPU, float32): a tiny random model made here with gated short
convolutions (biased, random biases) and QK-normed GQA attention layers, an MLP width
``block_auto_adjust_ff_dim`` rounds, an untied head and random norms: logits to 1e-5
normwise, prefill then decode steps == the full forward, 16 greedy tokens, a left-padded
row == the row alone, the save round trip, ``--config.init_from``, the legacy names and
``full_attn_idxs``, the bad fields named."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _lfm2():
    config = transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=70, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5, conv_bias=True,
        conv_L_cache=3, block_multiple_of=8, block_ffn_dim_multiplier=1.5,
        layer_types=["conv", "full_attention"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip
    return helpers.randomized_biases(transformers.Lfm2ForCausalLM(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "lfm2", _lfm2, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    ref, _, model, _ = pair
    assert ref.model.layers[0].feed_forward.w1.out_features == 72  # 2/3 of 70, * 1.5, up to 8s
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_legacy_names_layer_indices_and_bad_fields(pair):
    _, _, _, config = pair
    fmt = hf.lfm2.FORMAT
    raw = {k: v for k, v in config.items() if k not in ("layer_types", "intermediate_size")}
    raw.update(full_attn_idxs=[1], block_ff_dim=70, tie_embedding=True)
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
