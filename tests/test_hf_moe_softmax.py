"""Qwen3-MoE and Mixtral checkpoints (``linattn_jax.hf.qwen3_moe``, ``mixtral``) against
``transformers``' own PyTorch models (CPU, float32): tiny random models made here with every
option on (Qwen3-MoE: a dense layer among the mixtures by ``mlp_only_layers``,
``norm_topk_prob``, QK-norm, ``attention_bias`` with random biases, every layer sliding over
5 tokens; Mixtral: its window; both with routers and experts far from uniform): logits to
1e-5 normwise past the window, prefill then decode steps == the full forward, 16 greedy
tokens, a left-padded row == the row alone, the save round trip (experts per expert as
``transformers`` saves them), the fused layout read, ``--config.init_from``, bad fields."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    head_dim=12, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)  # fmt: skip


def _qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        **SIZES, intermediate_size=40, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, mlp_only_layers=[1], norm_topk_prob=True, attention_bias=True,
        use_sliding_window=True, sliding_window=5,
    )  # fmt: skip
    return helpers.randomized_biases(transformers.Qwen3MoeForCausalLM(config))


def _mixtral():
    config = transformers.MixtralConfig(
        **SIZES, intermediate_size=16, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def pair(request, tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    make = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral}[request.param]
    return helpers.torch_pair(tmp_path_factory, request.param, make, 1.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    _, _, model, config = pair
    if config["model_type"] == "qwen3_moe":
        assert [type(b.mlp).__name__ for b in model.blocks] == ["MoE", "SwiGLU"]
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_round_trip_and_the_fused_layout(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)
    helpers.assert_reads_the_fused_layout(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.FORMATS[config["model_type"]]
    for field, value, message in [
        ("num_local_experts", 1, r"num_experts_per_tok=2 must be <= num_local_experts=1"),
        ("num_experts_per_tok", 0, r"num_experts_per_tok must be an int >= 1"),
        ("hidden_act", "gelu", r"hidden_act must be 'silu'"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
    if config["model_type"] == "qwen3_moe":
        with pytest.raises(ValueError, match=r"mlp_only_layers must be a list of ints"):
            fmt.normalize_config({**config, "mlp_only_layers": "1"})
        older = {k: v for k, v in config.items() if k != "num_local_experts"}
        assert fmt.normalize_config({**older, "num_experts": 4}) == config  # the older name
