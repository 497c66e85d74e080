"""OLMo-Hybrid checkpoints (linattn_jax.hf.olmo_hybrid) against transformers' own torch
model, from a tiny random config made here: Gated DeltaNet with grouped value heads and
negative eigenvalues, OLMo's post-norm attention with QK-norms over all heads."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
from flax import nnx
from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

from linattn_jax import hf
from tests.helpers import assert_close_normwise

LOGITS_RTOL = 1e-5
CONFIG = dict(
    vocab_size=101,
    pad_token_id=0,
    eos_token_id=1,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=4,  # hv dv = h dk: see test_the_in_memory_names...
    rms_norm_eps=1e-5,
)


def randomized(ref):
    """``ref`` with random norms (the gated norms too)."""
    with torch.no_grad():
        for key, p in ref.named_parameters():
            if "norm" in key:
                p.normal_(1.0, 0.3)
    return ref


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``: RoPE on."""
    torch.manual_seed(0)
    ref = randomized(OlmoHybridForCausalLM(OlmoHybridConfig(**CONFIG)).eval())
    path = str(tmp_path_factory.mktemp("olmo_hybrid"))
    ref.save_pretrained(path)
    return (ref, path, *hf.from_pretrained(path))


forward = nnx.jit(lambda model, tokens, mask: model(tokens, key_mask=mask))


def torch_logits(ref, tokens, mask=None) -> np.ndarray:
    with torch.no_grad():
        mask = None if mask is None else torch.tensor(mask, dtype=torch.long)
        return ref(torch.tensor(tokens), attention_mask=mask).logits.numpy()


def test_logits_match_transformers_and_left_padding_is_each_row_alone(pair):
    ref, _, model, config = pair
    assert model.layout == ("gated_deltanet", "softmax", "gated_deltanet")
    assert model.blocks[1].post_norm and model.blocks[0].attention.beta_max == 2.0
    tokens = np.random.default_rng(0).integers(2, CONFIG["vocab_size"], (3, 17))
    mask = np.ones((3, 17), bool)
    mask[0, :5] = False
    ours = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)))
    assert_close_normwise(ours[1:], torch_logits(ref, tokens[1:]), LOGITS_RTOL)
    assert_close_normwise(ours[0, 5:], torch_logits(ref, tokens[:1, 5:])[0], LOGITS_RTOL)


@pytest.mark.slow  # compiles a prefill, a step and generate's loop
def test_prefill_and_decode_equal_the_full_pass_and_greedy_tokens_match(pair):
    ref, _, model, _ = pair
    tokens = np.random.default_rng(0).integers(2, CONFIG["vocab_size"], (3, 17))
    full = forward(model, jnp.asarray(tokens, jnp.int32), jnp.ones(tokens.shape, bool))
    run = nnx.jit(lambda m, t, s: m(t, state=s, return_state=True))
    head, state = run(model, jnp.asarray(tokens[:, :12], jnp.int32), model.init_state(3, 17))
    steps = [head]
    for i in range(12, 17):
        logits, state = run(model, jnp.asarray(tokens[:, i : i + 1], jnp.int32), state)
        steps.append(logits)
    assert_close_normwise(jnp.concatenate(steps, 1), full, LOGITS_RTOL)
    prompt = tokens[:1, :6]
    out = np.asarray(model.generate(jnp.asarray(prompt, jnp.int32), 16, temperature=0.0))
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor(prompt), max_new_tokens=16, do_sample=False, min_new_tokens=16
        ).numpy()
    np.testing.assert_array_equal(out[0, 6:], expected[0, 6:])


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    ref, _, model, config = pair
    hf.save_pretrained(model, tmp_path, config)
    back = OlmoHybridForCausalLM.from_pretrained(tmp_path).eval()
    for key, value in ref.state_dict().items():  # every tensor, bit for bit
        np.testing.assert_array_equal(back.state_dict()[key].numpy(), value.numpy(), err_msg=key)
    again, again_config = hf.from_pretrained(tmp_path)
    assert again_config == config
    params = lambda m: nnx.state(m, nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, params(again), params(model))
    hf.save_pretrained(model, tmp_path / "bare", model_type="olmo_hybrid")
    bare = OlmoHybridForCausalLM.from_pretrained(tmp_path / "bare").eval()
    tokens = np.random.default_rng(1).integers(2, CONFIG["vocab_size"], (2, 9))
    np.testing.assert_array_equal(torch_logits(bare, tokens), torch_logits(ref, tokens))


def test_the_in_memory_names_load_the_same_and_nope_matches(pair, tmp_path):
    ref, path, model, config = pair
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.linear_attn.conv1d.weight" in state  # transformers' own names
    safetensors.torch.save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(path, "config.json"), tmp_path / "config.json")
    memory, _ = hf.from_pretrained(tmp_path)
    params = lambda m: nnx.state(m, nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, params(memory), params(model))
    # NoPE (the released checkpoints: no rope_theta): the same weights, no rotation
    nope = OlmoHybridConfig(**CONFIG)
    nope.rope_parameters = {"rope_type": "default", "rope_theta": None}
    ref_nope = OlmoHybridForCausalLM(nope).eval()
    ref_nope.load_state_dict(ref.state_dict())
    ref_nope.save_pretrained(tmp_path / "nope")
    ours, ours_config = hf.from_pretrained(tmp_path / "nope")
    assert ours_config["rope_parameters"]["rope_theta"] is None
    assert ours.blocks[1].attention.rotary_dim is None
    tokens = np.random.default_rng(2).integers(2, CONFIG["vocab_size"], (3, 17))
    logits = forward(ours, jnp.asarray(tokens, jnp.int32), jnp.ones(tokens.shape, bool))
    assert_close_normwise(logits, torch_logits(ref_nope, tokens), LOGITS_RTOL)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    with pytest.raises(ValueError, match="layer_types must list num_hidden_layers=3"):
        hf.olmo_hybrid.normalize_config(dict(config, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="attention_bias"):
        hf.olmo_hybrid.normalize_config(dict(config, attention_bias=True))


def test_the_true_conv_shapes_are_written_for_unequal_key_and_value_widths(pair):
    _, _, _, config = pair
    wide = hf.olmo_hybrid.normalize_config(dict(config, linear_value_head_dim=6))
    shapes = {name: shape for name, (shape, _) in hf.expected_tensors(wide).items()}
    conv = "model.layers.0.linear_attn.{}_conv1d.weight"
    assert [shapes[conv.format(p)] for p in "qkv"] == [(16, 1, 4), (16, 1, 4), (24, 1, 4)]
