"""Phi-3 checkpoints (``linattn_jax.hf.phi3``) against ``transformers``' own PyTorch
``Phi3ForCausalLM`` (CPU, float32): a tiny random model made here with every option on (the
fused ``qkv_proj`` and ``gate_up_proj`` under GQA, RoPE on half of each head, a sliding
window of 5 tokens, random norms): logits to 1e-5 normwise past the window, prefill then
decode steps == the full forward, 16 greedy tokens, a left-padded row == the row alone, the
save round trip (``transformers`` reads our fused tensors back bit for bit), tied
embeddings, ``--config.init_from``, LongRoPE and bad fields named."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _phi3(**options):
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, sliding_window=5,
        pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
        "partial_rotary_factor": 0.5}, **options,
    )  # fmt: skip
    return transformers.Phi3ForCausalLM(config)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``: untied."""
    return helpers.torch_pair(tmp_path_factory, "phi3", _phi3, 1.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.blocks[0].attention.rotary_dim == 6  # half of head_dim 12
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_tied_embeddings_load_match_and_save(tmp_path):
    torch.manual_seed(1)
    tied = helpers.randomized(_phi3(tie_word_embeddings=True).eval(), 1.0)
    model, _ = helpers.assert_matches_and_saves(tied, tmp_path, VOCAB, RTOL)
    assert model.head is None


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_longrope_and_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.phi3.FORMAT
    for field, value, message in [
        ("rope_scaling", {"type": "su", "short_factor": [1.0]}, r"Phi-3's rope_type .* got 'su'"),
        ("rope_parameters", {"rope_type": "longrope"}, r"LongRoPE.* got 'longrope'"),
        ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": 0.1},
         r"partial_rotary_factor must be in \(0, 1\] and rotate an even number"),
        ("sliding_window", 0, r"sliding_window must be an int >= 1, got 0"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
    top = {**config, "rope_parameters": {"rope_type": "default"}, "partial_rotary_factor": 0.5}
    assert fmt.normalize_config(top)["rope_parameters"]["partial_rotary_factor"] == 0.5
