"""Jamba checkpoints (``linattn_jax.hf.jamba``) against ``transformers``' own PyTorch
``JambaForCausalLM`` (CPU, float32, its pure-torch selective scan): a tiny random model made
here whose two layers hold a mixer with a mixture and attention with a SwiGLU, GQA with
heads wider than ``hidden_size / num_attention_heads``, random norms (the mixers' dt, B and
C norms too), ``A_log``, ``D``, ``dt_proj``, convolution and projection biases and a router
far from uniform: logits to 1e-5 normwise, prefill then decode steps == the full forward,
16 greedy tokens, a left-padded row == the row alone, the save round trip, the experts fused
as ``transformers`` holds them, ``--config.init_from``, the derived and bad fields named."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
RTOL = 1e-5


def _jamba():
    config = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
        mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=3, mamba_proj_bias=True,
        head_dim=8, rms_norm_eps=1e-5, use_mamba_kernels=False,
    )  # fmt: skip
    model = helpers.randomized_mamba(transformers.JambaForCausalLM(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_proj.bias", "in_proj.bias", "out_proj.bias")):
                p.copy_(torch.randn_like(p))
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "jamba", _jamba, 1.0)


def test_layers_logits_decoding_and_left_padding_match(pair):
    _, _, model, _ = pair
    kinds = [type(block.attention).__name__ for block in model.blocks]
    assert kinds == ["MambaMixer", "SoftmaxAttention"]
    assert [type(block.mlp).__name__ for block in model.blocks] == ["MoE", "SwiGLU"]
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_reads_the_fused_experts(pair, tmp_path):
    helpers.assert_reads_the_fused_layout(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_derived_and_bad_fields(pair):
    _, _, _, config = pair
    fmt = hf.format_of(config)
    nulls = dict(mamba_dt_rank="auto", num_key_value_heads=None, head_dim=None)
    derived = fmt.normalize_config({**config, **nulls})
    assert [derived[k] for k in nulls] == [1, 4, 4]
    for field, value, message in [
        ("attn_layer_offset", 2, r"attn_layer_offset must be below attn_layer_period=2, got 2"),
        ("expert_layer_offset", -1, r"expert_layer_offset must be an int >= 0, got -1"),
        ("num_experts_per_tok", 5, r"num_experts_per_tok"),
        ("hidden_act", "gelu", r"hidden_act must be 'silu'"),
        ("mamba_dt_rank", 0, r"mamba_dt_rank must be an int >= 1, got 0"),
        ("mamba_conv_bias", "yes", r"mamba_conv_bias must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
