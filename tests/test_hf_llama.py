"""Llama checkpoints (``linattn_jax.hf.llama``) against ``transformers``' own PyTorch
``LlamaForCausalLM`` (CPU, float32, its pure-torch paths): tiny random models made here with
GQA, a head width other than ``hidden_size / num_attention_heads``, random norms (so that a
mapping error shows), untied and tied (with random ``attention_bias`` biases), RoPE scaled
(yarn, dynamic, llama3): logits to 1e-5 normwise, 16 greedy tokens, prefill then decode
steps against the full forward, left padding, the save/load round trip (and a save without
a config writing the same files) and a directory ``transformers`` reads."""

import numpy as np
import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _llama(rope=None, **options):
    sizes = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
    )  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 500.0, **(rope or {})}
    config = transformers.LlamaConfig(**{**sizes, **options}, rope_parameters=rope)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``: untied."""
    return helpers.torch_pair(tmp_path_factory, "llama", _llama, 1.0)


def test_logits_greedy_tokens_decoding_and_left_padding_match(pair):
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


SCALED_ROPES = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
    {"rope_type": "dynamic", "factor": 3.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
]  # fmt: skip


@pytest.mark.parametrize("rope", SCALED_ROPES, ids=lambda rope: rope["rope_type"])
def test_scaled_rope_matches_past_the_original_length_and_saves(rope, tmp_path):
    """One layer, 20 tokens past ``max_position_embeddings=16``: logits, then greedy decoding
    (dynamic: its frequencies per call, from the prefill's length to each step's, as
    ``transformers``' growing ones); saved, ``transformers`` reads the same scaling."""
    torch.manual_seed(2)
    ref = helpers.randomized(_llama(rope, num_hidden_layers=1, max_position_embeddings=16), 1.0)
    model, config = helpers.from_torch(ref.eval(), tmp_path / "hf")
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 20))
    expected = helpers.torch_logits(ref, tokens)
    helpers.assert_close_normwise(helpers.logits(model, tokens), expected, RTOL)
    helpers.assert_greedy_tokens_match(model, ref, tokens[:1, :6])
    back = helpers.assert_save_round_trip(model, config, ref, tmp_path / "ours")
    assert back.config.rope_parameters == ref.config.rope_parameters
    helpers.assert_close_normwise(helpers.torch_logits(back, tokens), expected, RTOL)


def test_tied_embeddings_and_attention_biases_load_match_and_save(tmp_path):
    torch.manual_seed(1)
    tied = helpers.randomized(_llama(tie_word_embeddings=True, attention_bias=True).eval(), 1.0)
    helpers.randomized_biases(tied)
    model, config = helpers.assert_matches_and_saves(tied, tmp_path, VOCAB, RTOL)
    assert model.head is None and config["tie_word_embeddings"] is True


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.llama.FORMAT
    for field, value, message in [
        ("num_key_value_heads", 3, r"num_key_value_heads=3 must divide num_attention_heads=4"),
        ("hidden_act", "gelu", r"hidden_act must be 'silu'"),
        ("mlp_bias", True, r"mlp_bias must be false"),
        ("rope_parameters", {"rope_type": "longrope"}, r"rope_type must be one of .*'longrope'"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)
