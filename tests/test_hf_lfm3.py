"""LFM3 checkpoints (``linattn_jax.hf.lfm3``) against ``transformers``' own PyTorch
``Lfm3ForCausalLM`` (CPU, float32): a tiny random model made here with every layer type
(gated short convolutions, a full layer of proportional RoPE over a quarter of the head, a
sliding layer of 5 tokens), attention biases and gates, sandwich norms, an untied head and
random norms: logits to 1e-5 normwise past the window, prefill then decode steps == the
full forward, 16 greedy tokens, a left-padded row == the row alone, the save round trip,
``--config.init_from``, the defaults and the bad fields named."""

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


def _lfm3():
    config = transformers.Lfm3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, norm_eps=1e-5,
        conv_L_cache=4, sliding_window=5, attention_bias=True, tie_word_embeddings=False,
        layer_types=["conv", "full_attention", "sliding_attention"], rope_parameters=ROPE,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return helpers.randomized_biases(transformers.Lfm3ForCausalLM(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "lfm3", _lfm3, 1.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_defaults_and_bad_fields(pair):
    _, _, _, config = pair
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
