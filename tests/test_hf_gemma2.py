"""Gemma 2 checkpoints (``linattn_jax.hf.gemma2``) against ``transformers``' own PyTorch
``Gemma2ForCausalLM`` (CPU, float32): a tiny random model made here with every option on
(alternating sliding windows of 5 tokens, attention and logit soft caps small enough to
bite, ``query_pre_attn_scalar``, four random ``(1 + w)`` norms per layer, GeGLU, the
embedding scale, ``attention_bias`` with random biases; tied): logits to 1e-5 normwise past
the window, prefill then decode steps == the full forward, 16 greedy tokens, a left-padded
row == the row alone, the save round trip, untied, ``--config.init_from``, bad fields."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _gemma2(**options):
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
        sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0, attention_bias=True, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **options,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(config)
    model.config._attn_implementation = "eager"  # the soft cap is eager's
    return helpers.randomized_biases(model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``: tied."""
    return helpers.torch_pair(tmp_path_factory, "gemma2", _gemma2, 0.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.layout == ("local_softmax", "softmax")
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)
    assert pair[2].head is None


def test_untied_load_match_and_save(tmp_path):
    torch.manual_seed(1)
    untied = helpers.randomized(_gemma2(tie_word_embeddings=False).eval(), 0.0)
    model, _ = helpers.assert_matches_and_saves(untied, tmp_path, VOCAB, RTOL)
    assert model.head is not None


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.gemma2.FORMAT
    for field, value, message in [
        ("hidden_activation", "gelu", r"hidden_activation must be 'gelu_pytorch_tanh'"),
        ("use_bidirectional_attention", True, r"use_bidirectional_attention must be False"),
        ("attn_logit_softcapping", 0, r"attn_logit_softcapping must be a finite number > 0"),
        ("sliding_window", None, r"sliding_window must be an int >= 1, got None"),
        ("layer_types", ["full_attention"], r"layer_types must list num_hidden_layers=2"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
    raw = {k: v for k, v in config.items() if k != "layer_types"}
    assert fmt.normalize_config(raw)["layer_types"] == config["layer_types"]
