"""Gemma 3 text checkpoints (``linattn_jax.hf.gemma3``, ``gemma3_text``) against
``transformers``' own PyTorch ``Gemma3ForCausalLM`` (CPU, float32): a tiny random model made
here with every option on (a full layer every 2nd, the others sliding over 5 tokens, RoPE
per layer type with a linear scaling on the full layers and another base on the local ones,
``(1 + w)`` QK-norms and sandwich norms, the logit soft cap (and an attention soft cap,
which ``transformers``' Gemma 3 ignores, as we do), ``attention_bias``; random norms and
biases): logits to 1e-5 normwise past the window, prefill then decode steps == the full
forward, 16 greedy tokens, a left-padded row == the row alone, the save round trip,
``--config.init_from``, the legacy RoPE fields and bad fields."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5
ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
}


def _gemma3():
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
        sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=20,
        attn_logit_softcapping=1.5, final_logit_softcapping=2.0, attention_bias=True,
        pad_token_id=0, rope_parameters=ROPE,
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(config)
    model.config._attn_implementation = "eager"  # the soft cap is eager's
    return helpers.randomized_biases(model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``: tied."""
    return helpers.torch_pair(tmp_path_factory, "gemma3", _gemma3, 0.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.layout == ("local_softmax", "softmax")
    assert model.blocks[0].attention.rope_theta == 50.0
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_legacy_rope_fields_and_bad_fields(pair):
    _, _, _, config = pair
    fmt = hf.gemma3.FORMAT
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1000.0, rope_local_base_freq=50.0, rope_scaling=ROPE["full_attention"])
    assert fmt.normalize_config(legacy)["rope_parameters"] == config["rope_parameters"]
    for field, value, message in [
        ("rope_parameters", {"rope_type": "default"}, r"one dict per layer type"),
        ("rope_parameters", {"full_attention": {"rope_type": "longrope"}}, r"\['full_attention'\]' rope_type must be one of"),
        ("hidden_activation", "relu", r"hidden_activation must be 'gelu_pytorch_tanh'"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
    raw = {k: v for k, v in config.items() if k != "layer_types"}
    assert fmt.normalize_config(raw)["layer_types"] == config["layer_types"]  # every 2nd
    raw.pop("sliding_window_pattern")
    assert fmt.normalize_config(raw)["layer_types"] == ["sliding_attention"] * 2  # every 6th
