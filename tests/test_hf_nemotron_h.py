"""Nemotron-H with ``moe`` layers (``linattn_jax.hf.nemotron_h``) against ``transformers``'
own PyTorch ``NemotronHForCausalLM`` (CPU, float32, its pure-torch paths): a tiny random
model made here of every layer type (``M``, ``E``, ``*``, ``-``, ``E``) whose mixtures have
sigmoid scores, a random correction bias, 1 of 2 groups, renormalised and scaled weights,
squared-ReLU experts and a shared squared-ReLU MLP (random norms, ``A_log``, ``dt_bias``,
``D``, routers): logits to 1e-5 normwise, prefill then decode steps == the full forward, 16
greedy tokens, a left-padded row == the row alone, the save round trip (per expert) and
``transformers``' fused layout; a mixture in a latent space (``moe_latent_size``); bad
fields."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
RTOL = 1e-5


def _nemotron_h(**options):
    config = transformers.NemotronHConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, mamba_num_heads=4,
        mamba_head_dim=8, ssm_state_size=6, n_groups=2, chunk_size=8, layer_norm_epsilon=1e-5,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
        moe_shared_expert_intermediate_size=20, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, pad_token_id=0, bos_token_id=0,
        eos_token_id=1,
    ), **options})  # fmt: skip
    model = helpers.randomized_mamba(transformers.NemotronHForCausalLM(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mixer.gate.weight"):
                p.normal_(0.0, 0.5)  # routers far from uniform
    return helpers.randomized_biases(model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "nemotron_h", _nemotron_h, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    _, _, model, _ = pair
    mlps = [type(b.mlp).__name__ for b in model.blocks]
    assert mlps == ["NoneType", "MoE", "NoneType", "ReLU2MLP", "MoE"]
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_round_trip_and_the_fused_layout(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)
    helpers.assert_reads_the_fused_layout(pair, tmp_path)


def test_latent_mixture_matches_and_saves(tmp_path):
    """``moe_latent_size``: the experts between ``fc1_latent_proj`` and ``fc2_latent_proj``."""
    torch.manual_seed(1)
    latent = _nemotron_h(layers_block_type=["full_attention", "moe"], moe_latent_size=8)
    model, _ = helpers.assert_matches_and_saves(latent.eval(), tmp_path, VOCAB, RTOL)
    assert model.blocks[1].mlp.up.shape == (8, 8, 12)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.nemotron_h.FORMAT
    for field, value, message in [
        ("moe_latent_size", 0, r"moe_latent_size must be an int >= 1, got 0"),
        ("n_group", 3, r"n_group=3 must divide n_routed_experts=8"),
        ("topk_group", 3, r"topk_group=3 must be <= n_group=2"),
        ("num_experts_per_tok", 9, r"num_experts_per_tok=9 must be <= n_routed_experts=8"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
