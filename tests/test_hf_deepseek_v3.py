"""DeepSeek-V3 checkpoints (``linattn_jax.hf.deepseek_v3``) against ``transformers``' own
PyTorch ``DeepseekV3ForCausalLM`` (CPU, float32): a tiny random model made here with every
option on (MLA with ``q_lora_rank`` and interleaved rope rows, YaRN with both mscales, a
dense first layer, then DeepSeek's mixture: sigmoid scores, a random correction bias, 2 of 4
groups, renormalised, scaled, a shared expert; random norms): logits to 1e-5 normwise,
prefill then decode steps == the full forward, 16 greedy tokens, a left-padded row == the
row alone, the save round trip, the fused layout, ``--config.init_from``; MLA without
``q_lora_rank`` nor interleaving; bad fields."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5
YARN = {
    "rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8,
    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 8, "beta_slow": 1,
}  # fmt: skip


def _deepseek(**options):
    config = transformers.DeepseekV3Config(**{
        **dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4,
            v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2,
            first_k_dense_replace=1, max_position_embeddings=32, rms_norm_eps=1e-5,
            rope_parameters=YARN,
        ),
        **options,
    })  # fmt: skip
    return helpers.randomized_biases(transformers.DeepseekV3ForCausalLM(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "deepseek_v3", _deepseek, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert [type(b.mlp).__name__ for b in model.blocks] == ["SwiGLU", "MoE"]
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_round_trip_and_the_fused_layout(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)  # the rope rows interleaved again
    helpers.assert_reads_the_fused_layout(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_mla_without_q_lora_rank_nor_interleaving(tmp_path):
    torch.manual_seed(1)
    plain = _deepseek(q_lora_rank=None, rope_interleave=False, num_hidden_layers=2)
    model, _ = helpers.assert_matches_and_saves(
        helpers.randomized(plain.eval(), 1.0), tmp_path, VOCAB
    )
    assert model.blocks[0].attention.q_proj is not None


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.deepseek_v3.FORMAT
    for field, value, message in [
        ("n_group", 3, r"n_group=3 must divide n_routed_experts=8"),
        ("topk_group", 5, r"topk_group=5 must be <= n_group=4"),
        ("attention_bias", True, r"attention_bias must be False"),
        ("qk_rope_head_dim", 3, r"qk_rope_head_dim must be even"),
        ("num_key_value_heads", 2, r"num_key_value_heads must equal num_attention_heads"),
        ("rope_parameters", {"rope_type": "longrope"}, r"rope_type must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
