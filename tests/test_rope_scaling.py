"""RoPE's scalings (``layers.rope_scaling``) against ``transformers``' own
``ROPE_INIT_FUNCTIONS``: the inverse frequencies to 1e-6 and the attention factor, for every
type (YaRN with and without its mscales, a given attention factor, untruncated; dynamic
below and past its length; partial rotation), the legacy ``rope_scaling`` read, and unknown
types and fields refused by name."""

import math

import numpy as np
import pytest

from linattn_jax import hf
from linattn_jax.layers import rope_scaling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ROPE_INIT_FUNCTIONS = pytest.importorskip("transformers.modeling_rope_utils").ROPE_INIT_FUNCTIONS

HEAD_DIM, MAX_LENGTH = 64, 256
CASES = [
    ({"rope_type": "linear", "factor": 3.0}, None),
    ({"rope_type": "dynamic", "factor": 2.0}, None),
    ({"rope_type": "dynamic", "factor": 2.0}, 100),
    ({"rope_type": "dynamic", "factor": 4.0}, 1000),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, None),
    (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
         "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
        None,
    ),
    (
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16,
         "attention_factor": 0.9, "truncate": False},
        None,
    ),
    (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        None,
    ),
]  # fmt: skip


def _config(parameters: dict, partial: float):
    theta = 5000.0 if parameters["rope_type"] != "llama3" else 500000.0
    rope = {**parameters, "rope_theta": theta, "partial_rotary_factor": partial}
    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 2, num_attention_heads=2, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_LENGTH, rope_parameters=rope,
    )  # fmt: skip


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("parameters,seq_len", CASES)
def test_frequencies_and_attention_factor_match_transformers(parameters, seq_len, partial):
    config = _config(parameters, partial)
    theirs, factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, seq_len=seq_len)
    rope = config.rope_parameters
    dim = int(HEAD_DIM * partial)
    # Ours from the config as the hf loader reads it (dynamic's length filled in).
    options = hf.rope.scaling(
        rope, {"max_position_embeddings": MAX_LENGTH}, ["partial_rotary_factor"]
    )
    scaling = rope_scaling.parse_rope_scaling(options, dim)
    ours = rope_scaling.inverse_frequencies(scaling, dim, rope["rope_theta"], seq_len)
    theirs = theirs.numpy()
    assert ours.shape == theirs.shape == (dim // 2,)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6, atol=0)
    assert math.isclose(scaling.attention_factor, factor, rel_tol=1e-12)


def test_proportional_frequencies_match_transformers():
    """LFM3's full layers: the whole head's pairs and frequencies, the first
    ``partial_rotary_factor`` of them kept (9 of 32 here), the rest 0, over ``factor``."""
    parameters = {"rope_type": "proportional", "factor": 2.0}
    config = _config(parameters, 0.3)
    theirs, factor = ROPE_INIT_FUNCTIONS["proportional"](config)
    options = hf.rope.options({"max_position_embeddings": MAX_LENGTH}, config.rope_parameters)
    assert "partial_rotary_factor" not in options  # the scaling's own, not the layer's
    scaling = rope_scaling.parse_rope_scaling(options["rope_scaling"], HEAD_DIM)
    ours = rope_scaling.inverse_frequencies(scaling, HEAD_DIM, options["rope_theta"])
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=1e-6, atol=0)
    assert np.count_nonzero(np.asarray(ours)) == 9 and factor == scaling.attention_factor == 1


def test_legacy_rope_scaling_and_yarns_factor_are_read_as_transformers_reads_them():
    base = dict(
        model_type="llama", vocab_size=10, hidden_size=16, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64, rope_theta=100.0,
    )  # fmt: skip
    fmt = hf.llama.FORMAT
    config = fmt.normalize_config({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert "rope_scaling" not in config and "rope_theta" not in config
    assert config["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}
    yarn = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16}
    config = fmt.normalize_config({**base, "rope_parameters": yarn})
    assert config["rope_parameters"]["factor"] == 4.0  # max_position_embeddings / original
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4}
    config = fmt.normalize_config({**base, "rope_parameters": llama3})
    assert config["rope_parameters"]["original_max_position_embeddings"] == 64


def test_unknown_types_and_fields_are_refused_by_name():
    with pytest.raises(ValueError, match="rope_type must be one of .* got 'longrope'"):
        rope_scaling.parse_rope_scaling({"rope_type": "longrope", "factor": 2.0}, 8)
    with pytest.raises(ValueError, match=r"unknown \['beta_fast'\], missing \[\]"):
        rope_scaling.parse_rope_scaling({"rope_type": "linear", "factor": 2, "beta_fast": 3}, 8)
    with pytest.raises(ValueError, match=r"missing \['original_max_position_embeddings'\]"):
        rope_scaling.parse_rope_scaling({"rope_type": "yarn", "factor": 2.0}, 8)
    with pytest.raises(ValueError, match="factor must be a finite number > 0, got 0"):
        rope_scaling.parse_rope_scaling({"rope_type": "linear", "factor": 0}, 8)
    with pytest.raises(ValueError, match="truncate must be true or false"):
        rope_scaling.parse_rope_scaling(
            {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
             "truncate": 1}, 8,
        )  # fmt: skip
    with pytest.raises(ValueError, match="'dynamic' needs rotary_dim >= 4, got 2"):
        rope_scaling.parse_rope_scaling(
            {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}, 2
        )
    base = dict(
        model_type="llama", vocab_size=10, hidden_size=16, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2,
    )  # fmt: skip
    for rope, message in [
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type must be one of .* got 'longrope'"),
        ({"rope_type": "linear"}, r"rope_parameters: .*missing \['factor'\]"),
        ({"rope_type": "default", "factor": 2.0}, r"unknown \['factor'\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            hf.llama.FORMAT.normalize_config({**base, "rope_parameters": rope})
