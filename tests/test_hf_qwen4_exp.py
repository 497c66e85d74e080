"""Qwen4-Exp checkpoints (``linattn_jax.hf.qwen4_exp``) against ``transformers``' own
PyTorch ``Qwen4ExpForCausalLM`` (CPU, float32): a tiny random model of a Gated DeltaNet
layer with the per-layer n-gram embeddings (PLE, ``eos`` inside the rows) and an indexed
attention layer (QSA: a budget of 4 tokens in blocks of 2, so most queries see a choice of
keys; 16 index heads, so no score ties), mixtures, three residual streams
(hyper-connections with random mixing, injection and norms), a sigmoid output gate and
unnormalised top-k weights: logits to 1e-5 normwise, prefill then decode steps == the full
forward, 16 greedy tokens (``transformers``' cache with the indexer's keys), a left-padded
row == the row alone, the save round trip (the n-gram table in shards),
``--config.init_from``, the multimodal model's text part, the bad fields named."""

import numpy as np
import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 61
EOS = 7
RTOL = 1e-5
# Zero-initialised or near-zero in transformers: drawn at random so a mapping error shows.
RANDOM = (
    "input_mix_weight_down.weight", "input_mix_weight_up.weight", "block_inject_weight.weight",
    "A_log", "dt_bias", "ple.conv1d.weight", "ngram_embedding.weight", "key_proj.weight",
    "value_proj.weight",
)  # fmt: skip


def _text_config(**changes):
    return dict(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6,
        linear_value_head_dim=5, linear_conv_kernel_dim=3, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=10,
        norm_topk_prob=False, hc_count=3, hc_lowrank=5, output_gate_type="sigmoid",
        rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=EOS, indexer_n_heads=16,
        indexer_kv_heads=1, indexer_head_dim=6, indexer_budget=4, indexer_compress_ratio=2,
        rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.5),
        ple_layer_ids=[1], ple_embed_dim=12, ple_conv_kernel_size=3, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=40, split_ngram_parts=2,
    ) | changes  # fmt: skip


def _qwen4_exp():
    config = transformers.Qwen4ExpTextConfig(**_text_config())
    return helpers.randomized_named(transformers.Qwen4ExpForCausalLM(config), RANDOM, 0.5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "qwen4_exp", _qwen4_exp, 0.0)


def test_logits_decoding_and_left_padding_match(pair):
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_scanned_layers_are_refused_with_ngrams(pair):
    """Each PLE layer hashes with its own multipliers: the layers differ, no scan."""
    with pytest.raises(ValueError, match=r"scan_layers stacks identical layers, but ngrams"):
        hf.from_pretrained(pair[1], scan_layers=True)


def test_the_multimodal_models_text_part_loads(pair, tmp_path):
    """``qwen4_exp`` (``Qwen4ExpForConditionalGeneration``, a tiny vision tower beside):
    its text weights under ``model.language_model.``, the same logits."""
    vision = dict(
        depth=1, hidden_size=8, intermediate_size=8, num_heads=2, out_hidden_size=24,
        patch_size=2, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=4,
    )  # fmt: skip
    config = transformers.Qwen4ExpConfig(text_config=_text_config(), vision_config=vision)
    torch.manual_seed(1)
    ref = transformers.Qwen4ExpForConditionalGeneration(config)
    ref = helpers.randomized(helpers.randomized_named(ref, RANDOM, 0.5).eval(), 0.0)
    model, _ = helpers.from_torch(ref, tmp_path)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (3, 17))
    helpers.assert_close_normwise(
        helpers.logits(model, tokens), helpers.torch_logits(ref, tokens), RTOL
    )


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.qwen4_exp.FORMAT
    for field, value, message in [
        ("hc_count", 1, r"hc_count must be an int >= 2, got 1"),
        ("hc_lowrank", 0, r"hc_lowrank must be an int >= 1, got 0"),
        ("output_gate_type", "gelu", r"output_gate_type must be \"one of \[None, 'silu', "),
        ("norm_topk_prob", 1, r"norm_topk_prob must be true or false, got 1"),
        ("ple_layer_ids", [3], r"ple_layer_ids must list ints in \[1, 2\], got \[3\]"),
        ("ple_embed_dim", 10, r"ple_embed_dim=10 must be a multiple of the n-gram heads"),
        ("eos_token_id", None, r"eos_token_id must be set with ple_layer_ids, got None"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})


def test_the_indexer_fields_are_checked():
    """Every attention layer carries the indexer: its fields are needed, and checked."""
    fmt = hf.qwen4_exp.FORMAT
    config = _text_config(model_type="qwen4_exp_text")
    assert fmt.normalize_config(config)["layer_types"][1] == "full_attention"
    named = {**config, "layer_types": ["linear_attention", "indexed_attention"]}
    assert fmt.normalize_config(named)["layer_types"] == ["linear_attention", "full_attention"]
    for field, value, message in [
        ("indexer_n_heads", None, r"indexer_n_heads must be an int >= 1, got None"),
        ("indexer_kv_heads", 2, r"indexer_kv_heads must be 1, got 2"),
        ("indexer_budget", 5, r"indexer_budget=5 must be a multiple of indexer_compress_ratio"),
        ("indexer_head_dim", 1, r"indexer_head_dim=1 must hold the 4 rotary channels"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
