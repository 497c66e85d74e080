"""Mamba and Falcon-Mamba checkpoints (``linattn_jax.hf.mamba``, ``hf.falcon_mamba``)
against ``transformers``' own PyTorch ``MambaForCausalLM`` and ``FalconMambaForCausalLM``
(CPU, float32, their pure-torch selective scans): tiny random models made here with random
norms, ``A_log``, ``D``, ``dt_proj`` and convolution biases (Mamba's with in/out biases and
an untied head, Falcon-Mamba's tied with its norms on dt, B and C): logits to 1e-5
normwise, prefill then decode steps == the full forward, 16 greedy tokens, a left-padded
row == the row alone, the save round trip, ``--config.init_from``, the bad fields named."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
RTOL = 1e-5
SIZES = dict(
    vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
    conv_kernel=3, time_step_rank=3, layer_norm_epsilon=1e-5,
)  # fmt: skip


def _randomized(model):
    """``helpers.randomized_mamba`` (A_log, D, conv biases, norms) and random ``dt_proj``
    biases (Mamba-1's dt bias)."""
    helpers.randomized_mamba(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_proj.bias", "in_proj.bias", "out_proj.bias")):
                p.copy_(torch.randn_like(p))
    return model


def _mamba():
    config = transformers.MambaConfig(**SIZES, use_bias=True, tie_word_embeddings=False)
    return _randomized(transformers.MambaForCausalLM(config))


def _falcon_mamba():
    config = transformers.FalconMambaConfig(**SIZES, mixer_rms_eps=1e-3)
    return _randomized(transformers.FalconMambaForCausalLM(config))


@pytest.fixture(scope="module", params=["mamba", "falcon_mamba"])
def pair(request, tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    make = {"mamba": _mamba, "falcon_mamba": _falcon_mamba}[request.param]
    return helpers.torch_pair(tmp_path_factory, request.param, make, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, config = pair
    if config["model_type"] == "mamba":
        helpers.assert_init_from_builds(model, ref, tmp_path)


def test_derived_and_bad_fields(pair):
    _, _, _, config = pair
    fmt = hf.format_of(config)
    derived = fmt.normalize_config({**config, "time_step_rank": "auto", "intermediate_size": 7})
    assert (derived["time_step_rank"], derived["intermediate_size"]) == (1, 32)
    cases = [
        ("hidden_act", "gelu", r"hidden_act must be 'silu'"),
        ("time_step_rank", 0, r"time_step_rank must be an int >= 1, got 0"),
        ("use_conv_bias", "yes", r"use_conv_bias must be"),
        ("layer_norm_epsilon", 2.0, r"layer_norm_epsilon"),
    ]
    if config["model_type"] == "falcon_mamba":
        cases.append(("mixer_rms_eps", -1.0, r"mixer_rms_eps"))
    for field, value, message in cases:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
