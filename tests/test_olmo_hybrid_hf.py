"""OLMo-Hybrid checkpoints (linattn_jax.hf.olmo_hybrid) against transformers' own torch
model, from a tiny random config made here: Gated DeltaNet with grouped value heads and
negative eigenvalues, OLMo's post-norm attention with QK-norms over all heads."""

from __future__ import annotations

import numpy as np
import pytest

from linattn_jax import hf
from tests import helpers
from tests.helpers import assert_close_normwise, torch_logits

# The torch reference: these tests skip where torch or transformers is not installed.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
OlmoHybridConfig = transformers.OlmoHybridConfig
OlmoHybridForCausalLM = transformers.OlmoHybridForCausalLM

LOGITS_RTOL = 1e-5
CONFIG = dict(
    vocab_size=101,
    pad_token_id=0,
    eos_token_id=1,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=4,  # hv dv = h dk: see test_the_in_memory_names...
    rms_norm_eps=1e-5,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``: RoPE on."""
    make = lambda: OlmoHybridForCausalLM(OlmoHybridConfig(**CONFIG))
    return helpers.torch_pair(tmp_path_factory, "olmo_hybrid", make, 1.0)


def test_logits_match_transformers_and_left_padding_is_each_row_alone(pair):
    ref, _, model, config = pair
    assert model.layout == ("gated_deltanet", "softmax", "gated_deltanet")
    assert model.blocks[1].post_norm and model.blocks[0].attention.beta_max == 2.0
    tokens = np.random.default_rng(0).integers(2, CONFIG["vocab_size"], (3, 17))
    helpers.assert_left_padded_row_alone(model, ref, tokens, 5, LOGITS_RTOL)


@pytest.mark.slow  # compiles a prefill, a step and generate's loop
def test_prefill_and_decode_equal_the_full_pass_and_greedy_tokens_match(pair):
    ref, _, model, _ = pair
    tokens = np.random.default_rng(0).integers(2, CONFIG["vocab_size"], (3, 17))
    helpers.assert_decoding_matches(model, ref, tokens, LOGITS_RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    ref, _, model, config = pair
    back = helpers.assert_save_round_trip(model, config, ref, tmp_path)
    helpers.assert_same_torch_tensors(back, ref)  # every tensor, bit for bit
    bare = helpers.saved_without_config(model, ref, tmp_path / "bare", model_type="olmo_hybrid")
    tokens = np.random.default_rng(1).integers(2, CONFIG["vocab_size"], (2, 9))
    np.testing.assert_array_equal(torch_logits(bare, tokens), torch_logits(ref, tokens))
    # A partial_rotary_factor transformers ignores here (as we do) is no reason to refuse.
    half = dict(config, rope_parameters=dict(config["rope_parameters"], partial_rotary_factor=0.5))
    hf.save_pretrained(model, tmp_path / "half", half)


def test_the_in_memory_names_load_the_same_and_nope_matches(pair, tmp_path):
    ref, path, model, config = pair
    assert "model.layers.0.linear_attn.conv1d.weight" in ref.state_dict()  # transformers' own
    helpers.assert_same_params(helpers.load_state_dict(ref, tmp_path, path), model)
    # NoPE (the released checkpoints: no rope_theta): the same weights, no rotation
    nope = OlmoHybridConfig(**CONFIG)
    nope.rope_parameters = {"rope_type": "default", "rope_theta": None}
    ref_nope = OlmoHybridForCausalLM(nope).eval()
    ref_nope.load_state_dict(ref.state_dict())
    ref_nope.save_pretrained(tmp_path / "nope")
    ours, ours_config = hf.from_pretrained(tmp_path / "nope")
    assert ours_config["rope_parameters"]["rope_theta"] is None
    assert ours.blocks[1].attention.rotary_dim is None
    tokens = np.random.default_rng(2).integers(2, CONFIG["vocab_size"], (3, 17))
    logits = helpers.logits(ours, tokens)
    assert_close_normwise(logits, torch_logits(ref_nope, tokens), LOGITS_RTOL)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    with pytest.raises(ValueError, match="layer_types must list num_hidden_layers=3"):
        hf.olmo_hybrid.FORMAT.normalize_config(dict(config, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="attention_bias"):
        hf.olmo_hybrid.FORMAT.normalize_config(dict(config, attention_bias=True))


def test_the_true_conv_shapes_are_written_for_unequal_key_and_value_widths(pair):
    _, _, _, config = pair
    wide = hf.olmo_hybrid.FORMAT.normalize_config(dict(config, linear_value_head_dim=6))
    shapes = {name: shape for name, (shape, _) in hf.expected_tensors(wide).items()}
    conv = "model.layers.0.linear_attn.{}_conv1d.weight"
    assert [shapes[conv.format(p)] for p in "qkv"] == [(16, 1, 4), (16, 1, 4), (24, 1, 4)]


def test_transformers_equal_thirds_of_unequal_widths_load_with_its_logits(tmp_path):
    # transformers saves the fused conv [2 h dk + hv dv] as three equal chunks (19, 19, 18
    # channels here, keys 16 and values 24 wide) and joins them back on load.
    torch.manual_seed(1)
    wide = dict(CONFIG, linear_value_head_dim=6, num_hidden_layers=2)
    wide["layer_types"] = ["linear_attention", "full_attention"]
    ref = helpers.randomized(OlmoHybridForCausalLM(OlmoHybridConfig(**wide)).eval(), 1.0)
    ref.save_pretrained(tmp_path)
    shapes = {n: s for n, (s, _) in hf.expected_tensors(hf.read_config(tmp_path)).items()}
    assert shapes["model.layers.0.linear_attn.v_conv1d.weight"] == (24, 1, 4)  # ours written
    model, _ = hf.from_pretrained(tmp_path)
    tokens = np.random.default_rng(3).integers(2, CONFIG["vocab_size"], (2, 9))
    assert_close_normwise(helpers.logits(model, tokens), torch_logits(ref, tokens), LOGITS_RTOL)
