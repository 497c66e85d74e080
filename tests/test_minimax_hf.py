"""MiniMax-01 checkpoints (linattn_jax.hf.minimax) against transformers' own torch model,
from a tiny random config made here: lightning and softmax layers, Mixtral's MoE, residual
factors other than 1."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from linattn_jax import hf
from linattn_jax.layers import LightningAttention, MoE
from linattn_jax.models import LanguageModel
from tests import helpers
from tests.helpers import assert_close_normwise, torch_logits

# The torch reference: these tests skip where torch or transformers is not installed.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
MiniMaxConfig = transformers.MiniMaxConfig
MiniMaxForCausalLM = transformers.MiniMaxForCausalLM

LOGITS_RTOL = 1e-5
CONFIG = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_local_experts=6,
    num_experts_per_tok=2,
    block_size=4,  # transformers' own chunks: several in the tests' lengths
    rms_norm_eps=1e-5,
    linear_attn_alpha_factor=1.5,
    linear_attn_beta_factor=0.75,
    full_attn_alpha_factor=0.5,
    full_attn_beta_factor=1.25,
    mlp_alpha_factor=1.25,
    mlp_beta_factor=0.5,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    make = lambda: MiniMaxForCausalLM(MiniMaxConfig(**CONFIG))
    return helpers.torch_pair(tmp_path_factory, "minimax", make, 1.0)


def test_logits_match_transformers(pair):
    ref, _, model, config = pair
    assert config["model_type"] == "minimax" and model.layout[:2] == ("lightning", "softmax")
    assert model.blocks[2].attention.layer_index == 2 and model.blocks[3].attention.num_layers == 4
    assert all(isinstance(block.mlp, MoE) for block in model.blocks)
    assert isinstance(model.blocks[3].attention, LightningAttention)
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (3, 17))
    assert_close_normwise(helpers.logits(model, tokens), torch_logits(ref, tokens), LOGITS_RTOL)


@pytest.mark.slow  # compiles a prefill, a step and generate's loop
def test_prefill_and_decode_equal_the_full_pass_and_greedy_tokens_match(pair):
    ref, _, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (3, 17))
    helpers.assert_decoding_matches(model, ref, tokens, LOGITS_RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    ref, _, model, config = pair
    back = helpers.assert_save_round_trip(model, config, ref, tmp_path)
    helpers.assert_same_torch_tensors(back, ref)  # every tensor (the decay buffers too)
    bare = helpers.saved_without_config(model, ref, tmp_path / "bare", model_type="minimax")
    tokens = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (2, 9))
    # transformers' default block_size there (256, not 4) chunks its own sums otherwise
    assert_close_normwise(torch_logits(bare, tokens), torch_logits(ref, tokens), LOGITS_RTOL)


def test_the_fused_layout_loads_the_same_and_left_padding_is_each_row_alone(pair, tmp_path):
    ref, path, model, _ = pair
    assert "model.layers.0.mlp.experts.gate_up_proj" in ref.state_dict()  # transformers' own
    helpers.assert_same_params(helpers.load_state_dict(ref, tmp_path, path), model)
    tokens = np.random.default_rng(2).integers(0, CONFIG["vocab_size"], (3, 17))
    helpers.assert_left_padded_row_alone(model, ref, tokens, 5, LOGITS_RTOL)


def test_bad_fields_are_named(pair, tmp_path):
    _, _, model, config = pair
    with pytest.raises(ValueError, match="layer_types must list num_hidden_layers=4"):
        hf.minimax.FORMAT.normalize_config(dict(config, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="sliding_window"):
        hf.minimax.FORMAT.normalize_config(dict(config, sliding_window=8))
    options = hf.minimax.FORMAT.model_options(config) | dict(normed_residual=False)
    plain = nnx.eval_shape(lambda: LanguageModel(**options, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="its option normed_residual=True, the model's False"):
        hf.save_pretrained(plain, tmp_path, config)


def test_linear_layers_only_and_half_rotary_load_match_and_save(tmp_path):
    """Lightning layers only (no softmax layer), ``partial_rotary_factor`` 0.5 in the RoPE
    parameters (``transformers`` ignores it here, as we do): loads, matches and saves, with
    its own config too."""
    config = dict(CONFIG, layer_types=["linear_attention"] * 4, partial_rotary_factor=0.5)
    torch.manual_seed(2)
    ref = helpers.randomized(MiniMaxForCausalLM(MiniMaxConfig(**config)).eval(), 1.0)
    model, ours = helpers.assert_matches_and_saves(ref, tmp_path, CONFIG["vocab_size"])
    hf.save_pretrained(model, tmp_path / "given", ours)
