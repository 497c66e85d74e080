"""Bailing-hybrid checkpoints (``linattn_jax.hf.bailing_hybrid``: Ling 3) against
``transformers``' own PyTorch ``BailingHybridForCausalLM`` (CPU, float32): a tiny random
model made here with every layer kind (KDA with its bounded full-rank gate, MLA with
interleaved RoPE and a head gate, a dense SwiGLU, DeepSeek's grouped mixture with a shared
expert), random norms, decays, routers and score biases: logits to 1e-5 normwise, prefill
then decode steps == the full forward, 16 greedy tokens, a left-padded row == the row alone,
the save round trip, ``--config.init_from``, the bad fields named."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _bailing():
    config = transformers.BailingHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=12, q_lora_rank=None,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, n_group=4, topk_group=2,
        num_experts_per_tok=3, num_local_experts=8, n_shared_experts=2,
        routed_scaling_factor=2.5, head_dim=8, rms_norm_eps=1e-5, first_k_dense_replace=1,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        pad_token_id=0, eos_token_id=None, num_mtp_layers=0, rope_theta=500.0,
    )  # fmt: skip
    model = transformers.BailingHybridForCausalLM(config)
    # decays, gates and score biases away from their initial values
    return helpers.randomized_named(model, ("A_log", "dt_bias", "e_score_correction_bias"), 1.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "bailing_hybrid", _bailing, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.layout == ("kda", "mla", "kda")
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_round_trip_and_in_memory_names(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)
    helpers.assert_reads_the_fused_layout(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_default_layers_and_bad_fields(pair):
    _, _, _, config = pair
    fmt = hf.bailing_hybrid.FORMAT
    raw = {k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types")}
    six = fmt.normalize_config({**raw, "num_hidden_layers": 6, "first_k_dense_replace": 2})
    assert six["layer_types"] == ["linear_attention"] * 5 + ["full_attention"]
    assert six["mlp_layer_types"] == ["dense"] * 2 + ["sparse"] * 4
    for field, value, message in [
        ("expert_swiglu_limit_list", [0, 7.0, 0], r"expert_swiglu_limit_list must be all zero"),
        ("kda_lower_bound", 1.0, r"kda_lower_bound must be a number < 0, got 1.0"),
        ("topk_group", 5, r"topk_group=5 must be <= num_expert_group=4"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
