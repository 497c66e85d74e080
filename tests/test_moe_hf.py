"""Qwen3.5-MoE checkpoints (linattn_jax.hf.qwen3_5_moe) against transformers' own torch
model, from a tiny random config made here."""

from __future__ import annotations

import numpy as np
import pytest

from linattn_jax import hf
from linattn_jax.layers import MoE
from tests import helpers
from tests.helpers import assert_close_normwise, torch_logits

# The torch reference: these tests skip where torch or transformers is not installed.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Qwen3_5MoeForCausalLM = transformers.Qwen3_5MoeForCausalLM
Qwen3_5MoeTextConfig = transformers.Qwen3_5MoeTextConfig
Qwen3NextConfig = transformers.Qwen3NextConfig
Qwen3NextForCausalLM = transformers.Qwen3NextForCausalLM

LOGITS_RTOL = 1e-5
CONFIG = dict(
    vocab_size=101,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rms_norm_eps=1e-5,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
)


def randomized(ref):
    """``ref`` with random norms (the ``1 + w`` form), and routers far from uniform."""
    return helpers.randomized(ref, 0.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    make = lambda: Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**CONFIG))
    return helpers.torch_pair(tmp_path_factory, "qwen3_5_moe", make, 0.0)


def test_logits_and_greedy_tokens_match_transformers(pair):
    ref, _, model, config = pair
    assert config["model_type"] == "qwen3_5_moe_text"
    assert all(isinstance(block.mlp, MoE) for block in model.blocks)
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (3, 17))
    assert_close_normwise(helpers.logits(model, tokens), torch_logits(ref, tokens), LOGITS_RTOL)
    helpers.assert_greedy_tokens_match(model, ref, tokens[:1, :6])


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    ref, _, model, config = pair
    back = helpers.assert_save_round_trip(model, config, ref, tmp_path)
    helpers.assert_same_torch_tensors(back, ref)  # every tensor, bit for bit
    # Without a config: the model's own, which transformers reads alike.
    bare = helpers.saved_without_config(
        model, ref, tmp_path / "bare", model_type="qwen3_5_moe_text"
    )
    tokens = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (2, 9))
    np.testing.assert_array_equal(torch_logits(bare, tokens), torch_logits(ref, tokens))


def test_the_fused_layout_loads_the_same_and_left_padding_is_each_row_alone(pair, tmp_path):
    ref, path, model, _ = pair
    assert "model.layers.0.mlp.experts.gate_up_proj" in ref.state_dict()  # transformers' own
    helpers.assert_same_params(helpers.load_state_dict(ref, tmp_path, path), model)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, CONFIG["vocab_size"], (3, 17))  # the logits test's shape
    helpers.assert_left_padded_row_alone(model, ref, tokens, 4, LOGITS_RTOL)


def test_a_dense_model_is_refused_and_bad_fields_are_named(pair, tmp_path):
    _, _, model, config = pair
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be <= num_experts=8"):
        hf.qwen3_5_moe.FORMAT.normalize_config(dict(config, num_experts_per_tok=9))
    dense = dict(config, model_type="qwen3_5_text", intermediate_size=32)  # Qwen3.5's
    with pytest.raises(
        ValueError, match=r"model_type'\]='qwen3_5_text', but the model has 'qwen3_5_moe_text'"
    ):
        hf.save_pretrained(model, tmp_path, dense)
    assert not (tmp_path / "config.json").exists()


def test_qwen3_next_matches_transformers_and_round_trips(tmp_path):
    """Qwen3-Next: grouped DeltaNet projections, a dense first layer (mlp_only_layers), top-k
    weights not renormalised, tied embeddings (greedy decoding: the Qwen3.5-MoE test's)."""
    config = dict(
        CONFIG, intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(1)
    ref = randomized(Qwen3NextForCausalLM(Qwen3NextConfig(**config)).eval())
    ref.save_pretrained(tmp_path / "ref")
    model, ours = hf.from_pretrained(tmp_path / "ref")
    assert ours["model_type"] == "qwen3_next" and not isinstance(model.blocks[0].mlp, MoE)
    assert isinstance(model.blocks[1].mlp, MoE) and not model.blocks[1].mlp.normalize
    tokens = np.random.default_rng(3).integers(0, CONFIG["vocab_size"], (3, 17))
    logits = helpers.logits(model, tokens)
    assert_close_normwise(logits, torch_logits(ref, tokens), LOGITS_RTOL)
    hf.save_pretrained(model, tmp_path / "ours", ours)
    back = Qwen3NextForCausalLM.from_pretrained(tmp_path / "ours").eval()
    helpers.assert_same_torch_tensors(back, ref)
    assert hf.read_config(tmp_path / "ours") == ours


def test_scanned_experts_load_into_their_layer_and_expert_slices(tmp_path):
    """``scan_layers=True`` with per-expert tensors: expert ``e`` of layer ``l`` is slice
    ``(l // 2, e)`` of block ``l % 2``'s stacked experts; the unrolled model's logits, and
    its files on save."""
    torch.manual_seed(2)
    layers = ["linear_attention", "full_attention"] * 2
    ref = randomized(
        Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**CONFIG, layer_types=layers)).eval()
    )
    ref.save_pretrained(tmp_path / "ref")
    unrolled, config = hf.from_pretrained(tmp_path / "ref")
    scanned, _ = hf.from_pretrained(tmp_path / "ref", scan_layers=True)
    assert scanned.blocks[0].mlp.gate.shape[:2] == (2, CONFIG["num_experts"])
    tokens = np.random.default_rng(3).integers(0, CONFIG["vocab_size"], (2, 11))
    logits = helpers.logits(scanned, tokens)
    assert_close_normwise(logits, torch_logits(ref, tokens), LOGITS_RTOL)
    assert_close_normwise(logits, helpers.logits(unrolled, tokens), 1e-6)
    hf.save_pretrained(scanned, tmp_path / "scanned", config)
    hf.save_pretrained(unrolled, tmp_path / "unrolled", config)
    for name in ("config.json", "model.safetensors"):
        a, b = (tmp_path / d / name for d in ("scanned", "unrolled"))
        assert a.read_bytes() == b.read_bytes(), name
