"""Lara Mini checkpoints (``linattn_jax.hf.lara_mini``) against ``transformers``' own
PyTorch ``LaraMiniForCausalLM`` (CPU, float32): a tiny random model made here with every
layer kind (Gated DeltaNet with grouped value heads, a sliding window of 5 tokens with
RoPE, full attention without), a mixture of 4 experts and an ungated shared expert, random
norms and routers: logits to 1e-5 normwise past the window, prefill then decode steps ==
the full forward, 16 greedy tokens, a left-padded row == the row alone, the save round
trip, the in-memory names, ``--config.init_from``, the bad fields named."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _lara_mini():
    config = transformers.LaraMiniConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        sliding_window=5, rms_norm_eps=1e-5, eos_token_id=None, tie_word_embeddings=False,
        layer_types=["linear_attention", "sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip
    model = transformers.LaraMiniForCausalLM(config)
    # gates and decays away from their initial values (the model has no such buffers)
    return helpers.randomized_named(model, ("A_log", "dt_bias"), 1.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "lara_mini", _lara_mini, 1.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.layout == ("gated_deltanet", "local_softmax", "softmax")
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_round_trip_and_in_memory_names(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)
    helpers.assert_reads_the_fused_layout(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_default_layers_and_bad_fields(pair):
    _, _, _, config = pair
    fmt = hf.lara_mini.FORMAT
    seven = fmt.normalize_config({**config, "num_hidden_layers": 7, "layer_types": None})
    assert seven["layer_types"][3:6] == ["full_attention", "sliding_attention", "linear_attention"]
    for field, value, message in [
        ("layer_types", ["mamba"] * 3, r"layer_types must list num_hidden_layers=3"),
        ("num_experts_per_tok", 5, r"num_experts_per_tok=5 must be <= num_experts=4"),
        ("attention_bias", True, r"attention_bias"),
        ("sliding_window", 0, r"sliding_window must be an int >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
