"""Qwen2 and Qwen3 checkpoints (``linattn_jax.hf.qwen2``, ``qwen3``) against
``transformers``' own PyTorch models (CPU, float32): tiny random models made here with every
option on (q/k/v biases, Qwen3's QK-norm and ``attention_bias``, a sliding window of 5
tokens on the layers from ``max_window_layers`` on; Qwen2 tied, Qwen3 untied; random norms
and biases): logits to 1e-5 normwise past the window, prefill then decode steps == the full
forward, 16 greedy tokens, a left-padded row == the row alone, the save round trip,
``--config.init_from`` and the bad fields named."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, use_sliding_window=True,
    sliding_window=5, max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)  # fmt: skip


def _qwen2():
    config = transformers.Qwen2Config(**SIZES, tie_word_embeddings=True)
    return helpers.randomized_biases(transformers.Qwen2ForCausalLM(config))


def _qwen3():
    config = transformers.Qwen3Config(**SIZES, head_dim=12, attention_bias=True)
    return helpers.randomized_biases(transformers.Qwen3ForCausalLM(config))


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def pair(request, tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    make = {"qwen2": _qwen2, "qwen3": _qwen3}[request.param]
    return helpers.torch_pair(tmp_path_factory, request.param, make, 1.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.layout == ("softmax", "local_softmax")
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    _, _, model, config = pair
    helpers.assert_round_trips(pair, tmp_path)
    assert (model.head is None) == (config["model_type"] == "qwen2")  # tied / untied


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.FORMATS[config["model_type"]]
    sliding = ["full_attention", "sliding_attention"]
    for changes, message in [
        ({"layer_types": ["full_attention", "chunked_attention"]}, r"layer_types must list"),
        ({"layer_types": sliding, "use_sliding_window": False}, r"need use_sliding_window"),
        ({"layer_types": sliding, "sliding_window": None}, r"sliding_window must be an int"),
        ({"hidden_act": "gelu"}, r"hidden_act must be 'silu'"),
        ({"rope_parameters": {"rope_type": "longrope"}}, r"rope_type must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, **changes})
    raw = {**config, "use_sliding_window": False}
    raw.pop("layer_types")  # then no layer slides, as in transformers
    assert set(fmt.normalize_config(raw)["layer_types"]) == {"full_attention"}
