"""Mistral checkpoints (``linattn_jax.hf.mistral``) against ``transformers``' own PyTorch
``MistralForCausalLM`` (CPU, float32): a tiny random model made here with a sliding window
of 5 tokens on every layer, GQA, a head width other than ``hidden_size /
num_attention_heads`` and random norms: logits to 1e-5 normwise past the window, prefill
then decode steps == the full forward, 16 greedy tokens, a left-padded row == the row
alone, the save round trip, ``--config.init_from``, a null window, the bad fields named."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _mistral():
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
        sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip
    return transformers.MistralForCausalLM(config)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "mistral", _mistral, 1.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_null_window_and_bad_fields(pair):
    _, _, _, config = pair
    fmt = hf.mistral.FORMAT
    assert fmt.normalize_config({**config, "sliding_window": None})["sliding_window"] is None
    absent = {k: v for k, v in config.items() if k != "sliding_window"}
    assert fmt.normalize_config(absent)["sliding_window"] == 4096  # transformers' default
    for field, value, message in [
        ("sliding_window", 0, r"sliding_window must be an int >= 1, got 0"),
        ("num_key_value_heads", 3, r"num_key_value_heads=3 must divide"),
        ("rope_parameters", {"rope_type": "su"}, r"rope_type must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
