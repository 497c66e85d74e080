"""Granite-4.0-H checkpoints (``linattn_jax.hf.granitemoehybrid``) against ``transformers``'
own PyTorch ``GraniteMoeHybridForCausalLM`` (CPU, float32, its pure-torch paths): tiny random
models made here, one with experts and RoPE, one dense without RoPE, with random multipliers,
norms, ``A_log``, ``dt_bias``, ``D`` and convolution biases (so that a mapping error shows):
logits to 1e-5 normwise, 16 greedy tokens, prefill then decode steps against the full
forward, left padding, the save/load round trip and a directory ``transformers`` reads."""

import numpy as np
import pytest
from flax import nnx

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def _granite(seed, layer_types=("linear_attention", "full_attention"), **options):
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=12, shared_intermediate_size=20,
        num_hidden_layers=2, layer_types=list(layer_types),
        num_attention_heads=2, num_key_value_heads=1, mamba_n_heads=4, mamba_d_head=8,
        mamba_d_state=6, mamba_n_groups=2, mamba_chunk_size=8, rms_norm_eps=1e-5,
        pad_token_id=0, bos_token_id=0, eos_token_id=1, **options,
    )  # fmt: skip
    torch.manual_seed(seed)
    return helpers.randomized_mamba(transformers.GraniteMoeHybridForCausalLM(config).eval())


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Experts, a shared MLP, RoPE, untied, and multipliers far from 1."""
    torch_model = _granite(
        0, num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope",
        embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2,
        logits_scaling=2.5, tie_word_embeddings=False,
    )  # fmt: skip
    return torch_model, *helpers.from_torch(torch_model, tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """No experts (the shared MLP alone), no RoPE, tied, other multipliers."""
    torch_model = _granite(
        1, num_local_experts=0, position_embedding_type=None, embedding_multiplier=0.5,
        residual_multiplier=1.7, attention_multiplier=0.4, logits_scaling=0.8,
        tie_word_embeddings=True,
    )  # fmt: skip
    return torch_model, *helpers.from_torch(torch_model, tmp_path_factory.mktemp("dense"))


@pytest.mark.parametrize(
    "fixture",
    ["moe", pytest.param("dense", marks=pytest.mark.slow)],  # dense: no RoPE, tied
)
def test_logits_greedy_tokens_and_round_trip_equal_transformers(fixture, request, tmp_path):
    torch_model, model, config = request.getfixturevalue(fixture)
    bare = helpers.assert_logits_greedy_and_round_trip(model, config, torch_model, tmp_path, VOCAB)
    # Without a config, the model's form picks its model type, multipliers and all.
    assert bare["model_type"] == "granitemoehybrid"
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier"):
        assert bare[field] == config[field]
    assert bare["logits_scaling"] == config["logits_scaling"]


@pytest.mark.slow  # compiles the prefill, a decoding step and a masked forward
def test_prefill_then_decode_steps_and_left_padding(moe):
    _, model, _ = moe
    helpers.assert_decode_steps_and_left_padding(model, VOCAB)


def test_bad_configs_and_models_are_refused_by_name(moe, tmp_path):
    _, model, config = moe
    fmt = hf.pretrained.format_of(config)
    # The released checkpoints' names for the layer types (transformers renames them).
    legacy = {**config, "layer_types": ["mamba", "attention"]}
    assert fmt.normalize_config(legacy)["layer_types"] == config["layer_types"]
    for field, value, message in [
        ("layer_types", ["mamba", "sliding"], "layer_types must list num_hidden_layers=2"),
        ("embedding_multiplier", 0.0, "embedding_multiplier must be a finite number > 0"),
        ("position_embedding_type", "alibi", "position_embedding_type must be .*rope"),
        ("num_experts_per_tok", 5, "num_experts_per_tok=5 must be <= num_local_experts=4"),
        ("attention_bias", True, "attention_bias must be false"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
    # A multiplier the written config would lose is refused, not dropped.
    with pytest.raises(ValueError, match=r"config\['residual_multiplier'\]=1.0, but the model"):
        hf.save_pretrained(model, tmp_path / "other", {**config, "residual_multiplier": 1.0})
    from linattn_jax.models import LanguageModel

    mamba = hf.mamba2.FORMAT.normalize_config(
        dict(model_type="mamba2", vocab_size=16, hidden_size=8, num_hidden_layers=1,
             num_heads=2, head_dim=8, state_size=4, n_groups=1)
    )  # fmt: skip
    options = hf.mamba2.FORMAT.model_options(mamba) | dict(logits_scaling=2.0)
    scaled = nnx.eval_shape(lambda: LanguageModel(**options, rngs=nnx.Rngs(0)))
    with pytest.raises(
        ValueError, match=r"builds another model: its option logits_scaling=1.0, the model's 2.0"
    ):
        hf.save_pretrained(scaled, tmp_path / "scaled", mamba)
    assert not (tmp_path / "scaled").exists()


def test_init_from_builds_the_checkpoints_model(moe, tmp_path):
    """``--config.init_from=DIR`` of a directory ``transformers`` saved: the run's model is
    the checkpoint's, parameter for parameter."""
    torch_model, model, _ = moe
    helpers.assert_init_from_builds(model, torch_model, tmp_path)


def test_released_configs_nope_and_attention_only_load_match_and_save(tmp_path):
    """Every Granite-4.0-H release says ``position_embedding_type: "nope"`` (no RoPE, as
    ``transformers`` reads anything but ``"rope"``); a model of attention layers only (no
    Mamba-2 layer) with ``partial_rotary_factor`` 0.5 in its RoPE parameters (which
    ``transformers`` ignores here, as we do): each loads, matches and saves."""
    nope = _granite(3, num_local_experts=0, position_embedding_type="nope")
    model, config = helpers.assert_matches_and_saves(nope, tmp_path / "nope", VOCAB)
    assert (
        config["position_embedding_type"] == "nope" and model.blocks[1].attention.rotary_dim is None
    )
    attention_only = _granite(
        4, num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope",
        layer_types=["full_attention"] * 2, partial_rotary_factor=0.5,
    )  # fmt: skip
    model, config = helpers.assert_matches_and_saves(attention_only, tmp_path / "attn", VOCAB)
    hf.save_pretrained(model, tmp_path / "given", config)  # the config it was loaded with


def test_scanned_layers_with_experts_run_as_unrolled(moe, tmp_path):
    """``scan_layers=True`` with experts: the router losses' record is stacked with the
    layers (it was reset to one layer's shape, and the first forward failed)."""
    torch_model, model, _ = moe
    torch_model.save_pretrained(tmp_path)
    scanned, _ = hf.from_pretrained(tmp_path, scan_layers=True)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 9))
    helpers.assert_close_normwise(
        helpers.logits(scanned, tokens), helpers.logits(model, tokens), 1e-6
    )
