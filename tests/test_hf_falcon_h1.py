"""Falcon-H1 checkpoints (``linattn_jax.hf.falcon_h1``: attention beside Mamba-2 in every
layer) against ``transformers``' own PyTorch ``FalconH1ForCausalLM`` (CPU, float32, its
pure-torch paths): tiny random models made here, with every multiplier (embedding, LM head,
key, the branches' in and out, the MLP's, the SSM projection's) away from 1 and random norms,
``A_log``, ``dt_bias``, ``D`` and convolution biases (so that a mapping error shows): logits
to 1e-5 normwise, 16 greedy tokens, prefill then decode steps, left padding, the save/load
round trip and a directory ``transformers`` reads."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def _falcon(seed, **options):
    config = transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, mamba_d_ssm=24, mamba_n_heads=4,
        mamba_d_state=6, mamba_n_groups=2, mamba_chunk_size=8, rms_norm_eps=1e-5,
        pad_token_id=0, bos_token_id=0, eos_token_id=1, embedding_multiplier=1.7,
        lm_head_multiplier=0.6, key_multiplier=0.8, attention_in_multiplier=1.3,
        attention_out_multiplier=0.7, ssm_in_multiplier=0.9, ssm_out_multiplier=1.2,
        mlp_multipliers=[1.4, 0.6], ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7], **options,
    )  # fmt: skip
    torch.manual_seed(seed)
    return helpers.randomized_mamba(transformers.FalconH1ForCausalLM(config).eval())


@pytest.fixture(scope="module")
def normed(tmp_path_factory):
    """The mixer's grouped RMSNorm before the gate (``mamba_norm_before_gate``), untied."""
    torch_model = _falcon(0, mamba_rms_norm=True, mamba_norm_before_gate=True)
    return torch_model, *helpers.from_torch(torch_model, tmp_path_factory.mktemp("normed"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """No mixer norm (``y * SiLU(z)``), tied embeddings."""
    torch_model = _falcon(1, mamba_rms_norm=False, tie_word_embeddings=True)
    return torch_model, *helpers.from_torch(torch_model, tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("fixture", ["normed", pytest.param("plain", marks=pytest.mark.slow)])
def test_logits_greedy_tokens_and_round_trip_equal_transformers(fixture, request, tmp_path):
    torch_model, model, config = request.getfixturevalue(fixture)
    bare = helpers.assert_logits_greedy_and_round_trip(model, config, torch_model, tmp_path, VOCAB)
    assert bare["model_type"] == "falcon_h1"
    assert bare["ssm_multipliers"] == config["ssm_multipliers"]
    assert bare["key_multiplier"] == pytest.approx(config["key_multiplier"], rel=1e-12)


@pytest.mark.slow  # compiles the prefill, a decoding step and a masked forward
def test_prefill_then_decode_steps_and_left_padding(normed):
    _, model, _ = normed
    helpers.assert_decode_steps_and_left_padding(model, VOCAB)


def test_bad_configs_are_refused_by_name(normed, tmp_path):
    _, model, config = normed
    # A partial_rotary_factor transformers ignores here (as we do) is no reason to refuse.
    half = dict(config, rope_parameters=dict(config["rope_parameters"], partial_rotary_factor=0.5))
    hf.save_pretrained(model, tmp_path / "half", half)
    fmt = hf.pretrained.format_of(config)
    for field, value, message in [
        ("ssm_multipliers", [1.0, 1.0], r"ssm_multipliers must list 5 finite numbers > 0"),
        ("key_multiplier", -1.0, r"key_multiplier must be a finite number > 0"),
        ("projectors_bias", True, r"projectors_bias \(out_proj's bias\) must equal"),
        ("mamba_d_ssm", 20, r"mamba_d_ssm \(20\) must equal mamba_n_heads \* mamba_d_head"),
        ("mlp_bias", True, r"mlp_bias must be false"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
    with pytest.raises(ValueError, match=r"config\['ssm_out_multiplier'\]=1.0, but the model"):
        hf.save_pretrained(model, tmp_path / "other", {**config, "ssm_out_multiplier": 1.0})


def test_init_from_builds_the_checkpoints_model(normed, tmp_path):
    """``--config.init_from=DIR`` of a directory ``transformers`` saved: the run's model is
    the checkpoint's, parameter for parameter."""
    torch_model, model, _ = normed
    helpers.assert_init_from_builds(model, torch_model, tmp_path)
