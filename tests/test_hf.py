"""Qwen3.5 checkpoints in Hugging Face format, against the real thing: ``transformers``'
own PyTorch Qwen3.5 (its pure-torch Gated DeltaNet path, on the CPU, no network).

Tiny random models (tied and untied, both layer kinds, 2 key / 4 value heads in the Gated
DeltaNet layers, GQA in attention, random norm gains so that the zero-centred ``1 + w``
convention matters) are saved by ``transformers`` once per module and loaded by ours.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from linattn_jax import hf, sharding
from linattn_jax.models.options import thaw
from tests import helpers
from tests.helpers import assert_close_normwise

# The reference needs torch (the dev extra's CPU wheel, for the Python it is pinned on): on a
# Python or machine without it, the module skips and the rest of the suite runs.
_NO_TORCH = "torch and transformers (the dev extra) are the reference for the Hugging Face tests"
torch = pytest.importorskip("torch", reason=f"torch is not installed: {_NO_TORCH}")
transformers = pytest.importorskip(
    "transformers", reason=f"transformers is not installed: {_NO_TORCH}"
)
Qwen3_5Config = transformers.Qwen3_5Config
Qwen3_5ForCausalLM = transformers.Qwen3_5ForCausalLM
Qwen3_5TextConfig = transformers.Qwen3_5TextConfig

LOGITS_RTOL = 1e-5  # float32 against float32: the sums' order differs (chunks vs scans)
# bfloat16 weights and activations against float32 ones: each of the ~25 matmuls rounds to
# 8 bits of mantissa (2^-8 = 4e-3 relative); measured 6e-3 on the untied model.
BF16_RTOL = 2e-2

SIZES = dict(
    vocab_size=101,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
CONFIGS = {
    # Qwen3.5's layout (three Gated DeltaNet layers, then attention); untied; eps not 1e-6.
    "untied": dict(SIZES, hidden_size=64, num_hidden_layers=4, rms_norm_eps=1e-5),
    # Attention first and last, width 128, tied embeddings.
    "tied": dict(
        SIZES,
        hidden_size=128,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        layer_types=["full_attention", "linear_attention", "full_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5),
    ),
}


def torch_model(name: str, seed: int = 0) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIGS[name])).eval()
    with torch.no_grad():  # the norms start at 0 (1 + w): random gains test the convention
        for key, p in model.named_parameters():
            if "norm" in key:
                p.normal_(0.0, 0.3)
    return model


# Compiled once per model structure and shape (eager calls would run op by op, slowly).
forward = nnx.jit(lambda model, tokens, mask: model(tokens, key_mask=mask))
decode = nnx.jit(lambda model, tokens, state: model(tokens, state=state, return_state=True))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``name -> (torch model, its directory, our model, our config)``, each made once."""
    cache = {}

    def get(name):
        if name not in cache:
            ref = torch_model(name)
            path = str(tmp_path_factory.mktemp(name))
            ref.save_pretrained(path)
            cache[name] = (ref, path, *hf.from_pretrained(path))
        return cache[name]

    return get


@pytest.fixture(params=sorted(CONFIGS))
def pair(request, saved):
    return saved(request.param)


def test_abstract_models_are_each_their_own_and_a_config_is_traced_once(monkeypatch):
    """``hf.abstract_model`` keeps a config's traced construction: a second call traces
    nothing, yet returns a model of its own variables; a config equal but for a value's
    type (10000 against 10000.0, written back as read) is not the same config."""
    config = hf.qwen3_5.FORMAT.normalize_config(
        Qwen3_5TextConfig(**dict(CONFIGS["untied"], rms_norm_eps=1.2345e-5)).to_dict()
    )  # an eps no other test uses: not yet traced in this process
    traced, eval_shape = [], nnx.eval_shape
    monkeypatch.setattr(nnx, "eval_shape", lambda f: traced.append(f) or eval_shape(f))
    first, second = hf.abstract_model(config), hf.abstract_model(config)
    assert len(traced) == 1
    assert nnx.graphdef(first) == nnx.graphdef(second)
    assert first.embed.embedding is not second.embed.embedding
    first.embed.embedding.set_value(jnp.zeros(first.embed.embedding.shape))
    assert isinstance(second.embed.embedding.get_value(), jax.ShapeDtypeStruct)
    assert isinstance(hf.abstract_model(config).embed.embedding.get_value(), jax.ShapeDtypeStruct)
    rope = dict(config["rope_parameters"], rope_theta=10000)
    whole = hf.abstract_model(dict(config, rope_parameters=rope))
    assert len(traced) == 2
    assert type(whole.hf_config["rope_parameters"]["rope_theta"]) is int


def torch_logits(ref, tokens, mask=None) -> np.ndarray:
    kwargs = {}
    if mask is not None:  # transformers' generate's positions: real tokens counted
        position_ids = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        kwargs = dict(
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(position_ids),
        )
    with torch.no_grad():
        return ref(torch.tensor(tokens), **kwargs).logits.numpy()


def test_logits_match_transformers(pair):
    ref, _, model, _ = pair
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (3, 17))
    ours = forward(model, jnp.asarray(tokens, jnp.int32), jnp.ones((3, 17), bool))
    assert ours.shape == (3, 17, SIZES["vocab_size"])
    assert_close_normwise(ours, torch_logits(ref, tokens), LOGITS_RTOL)


def test_left_padding_matches_transformers(pair):
    ref, _, model, _ = pair
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, SIZES["vocab_size"], (3, 17))
    mask = np.ones((3, 17), bool)
    mask[0, :5], mask[1, :1] = False, False  # rows of 12, 16 and 17 real tokens
    ours = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)))
    expected = torch_logits(ref, tokens, mask)
    assert_close_normwise(ours[mask], expected[mask], LOGITS_RTOL)
    # Each row's real positions equal the row alone, unpadded, in transformers.
    assert_close_normwise(ours[0, 5:], torch_logits(ref, tokens[:1, 5:])[0], LOGITS_RTOL)


def test_greedy_generation_matches_transformers(saved):
    """32 greedy tokens from three left-padded prompts, each row as transformers writes it
    alone (the untied model, Qwen3.5's layout: the decoding loop carries three Gated
    DeltaNet states and conv windows and an attention cache; the tied model's decoding is
    the decode-step test's)."""
    ref, _, model, _ = saved("untied")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, SIZES["vocab_size"], n) for n in (5, 9, 1)]
    t = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), t), np.int32)
    mask = np.zeros((len(prompts), t), bool)
    for i, p in enumerate(prompts):
        tokens[i, t - len(p) :], mask[i, t - len(p) :] = p, True
    ours = np.asarray(model.generate(jnp.asarray(tokens), 32, temperature=0.0, prompt_mask=mask))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            expected = ref.generate(
                torch.tensor(p[None]), max_new_tokens=32, do_sample=False, min_new_tokens=32
            ).numpy()
        np.testing.assert_array_equal(ours[i, t:], expected[0, len(p) :])


def test_decode_step_logits_match_transformers(saved):
    """Prefill through the chunked form, then one O(1) step: the step's logits equal
    transformers' over the whole sequence at its last position (the tied model: attention
    first and last, their caches under a partial RoPE with head_dim != width / heads, the
    Gated DeltaNet layer's state and conv window between them)."""
    ref, _, model, _ = saved("tied")
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, SIZES["vocab_size"], (2, 11))
    expected = torch_logits(ref, tokens)
    state = model.init_state(2, 16)
    prefill, state = decode(model, jnp.asarray(tokens[:, :10], jnp.int32), state)
    step, _ = decode(model, jnp.asarray(tokens[:, 10:], jnp.int32), state)
    assert_close_normwise(prefill, expected[:, :10], LOGITS_RTOL)
    assert_close_normwise(step[:, 0], expected[:, 10], LOGITS_RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    ref, _, model, config = pair
    hf.save_pretrained(model, tmp_path, config)
    back = Qwen3_5ForCausalLM.from_pretrained(tmp_path).eval()
    for key, value in ref.state_dict().items():  # every tensor, bit for bit
        np.testing.assert_array_equal(back.state_dict()[key].numpy(), value.numpy(), err_msg=key)
    tokens = np.random.default_rng(4).integers(0, SIZES["vocab_size"], (2, 9))
    assert_close_normwise(torch_logits(back, tokens), torch_logits(ref, tokens), 1e-7)
    again, again_config = hf.from_pretrained(tmp_path)
    assert again_config["layer_types"] == config["layer_types"]
    jax.tree.map(np.testing.assert_array_equal, nnx_params(again), nnx_params(model))
    assert thaw(model.hf_config) == config and again.hf_config == model.hf_config
    helpers.assert_saved_alike_without_config(model, tmp_path)


def test_bfloat16_load_is_within_rounding(saved):
    _, path, model, _ = saved("tied")
    model16, _ = hf.from_pretrained(path, jnp.bfloat16)
    dtypes = {x.dtype for x in jax.tree.leaves(nnx_params(model16))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (3, 17))
    tokens, mask = jnp.asarray(tokens, jnp.int32), jnp.ones((3, 17), bool)
    assert_close_normwise(forward(model16, tokens, mask), forward(model, tokens, mask), BF16_RTOL)


def nnx_params(model):
    return nnx.state(model, nnx.Param)


def test_sharded_safetensors_load_the_same(pair, tmp_path):
    ref, _, model, _ = pair
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    sharded, _ = hf.from_pretrained(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, nnx_params(sharded), nnx_params(model))
    # Beside the shards, a model.safetensors is what transformers reads: ours too.
    tensors = {}
    for file in tmp_path.glob("model-*.safetensors"):
        tensors.update(load_file(file))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + np.float32(1)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    single, _ = hf.from_pretrained(tmp_path)
    np.testing.assert_array_equal(single.norm.scale[...], model.norm.scale[...] + 1)
    ours = tmp_path / "ours"  # and ours sharded, read by transformers
    hf.save_pretrained(model, ours, max_shard_size=None)  # the shards below replace it
    hf.save_pretrained(model, ours, max_shard_size="20KB")
    assert len(list(ours.glob("model-*.safetensors"))) > 2
    assert not (ours / "model.safetensors").exists()
    back = Qwen3_5ForCausalLM.from_pretrained(ours).eval()
    for key, value in ref.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[key].numpy(), value.numpy(), err_msg=key)


def test_multimodal_directory_loads_its_text_model(pair, tmp_path):
    """A ``qwen3_5`` (image-text) directory: the text model under
    ``model.language_model.``, the vision tower and MTP weights skipped."""
    _, path, model, config = pair
    text = {k: v for k, v in config.items() if k not in ("architectures", "dtype")}
    tie = text.pop("tie_word_embeddings")
    text["tie_word_embeddings"] = not tie  # transformers reads the top-level field
    outer = dict(model_type="qwen3_5", text_config=text, tie_word_embeddings=tie)
    (tmp_path / "config.json").write_text(json.dumps(outer))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    renamed["mtp.fc.weight"] = np.zeros((2, 2), np.float32)
    save_file(renamed, tmp_path / "model.safetensors")
    loaded, loaded_config = hf.from_pretrained(tmp_path)
    assert loaded_config["model_type"] == "qwen3_5_text"
    jax.tree.map(np.testing.assert_array_equal, nnx_params(loaded), nnx_params(model))


def test_real_size_config_maps_every_tensor():
    """Qwen3.5's published dimensions (``transformers``' defaults, the 9B-style config:
    width 4096, 248,320 tokens, 16 x 256 attention heads over 4 KV heads, 16 key / 32
    value heads of 128 in the Gated DeltaNet layers) at 2 layers: every tensor's name and
    shape, against transformers' model built on the meta device (no memory), for the text
    model and for the text part of the image-text one."""
    text = Qwen3_5TextConfig(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]
    )
    config = hf.qwen3_5.FORMAT.normalize_config(text.to_dict())
    with torch.device("meta"):
        reference = Qwen3_5ForCausalLM(text).state_dict()
    ours = hf.expected_tensors(config)
    assert sorted(ours) == sorted(reference)
    for name, (shape, _) in ours.items():
        assert shape == tuple(reference[name].shape), name
    outer = Qwen3_5Config(text_config=text.to_dict())
    config = hf.qwen3_5.FORMAT.normalize_config(outer.to_dict())
    assert config["hidden_size"] == 4096 and config["vocab_size"] == 248320
    ours = hf.expected_tensors(config, "model.language_model.")
    assert sorted(ours) == sorted(
        k.replace("model.", "model.language_model.", 1) for k in reference
    )
    model = hf.abstract_model(config, jnp.bfloat16)  # nothing allocated
    assert model.embed.embedding.shape == (248320, 4096)
    # The 27B-style shape: width 5120 over 24 attention heads (no multiple: head_dim
    # decides), 3 value heads to each Gated DeltaNet key head, the multimodal RoPE's fields.
    wide = dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=24,
        linear_num_value_heads=48, attn_output_gate=True,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
            mrope_section=[11, 11, 10], mrope_interleaved=True,
        ),
    )  # fmt: skip
    text = Qwen3_5TextConfig(**wide)
    with torch.device("meta"):
        reference = Qwen3_5ForCausalLM(text).state_dict()
    ours = hf.expected_tensors(hf.qwen3_5.FORMAT.normalize_config(text.to_dict()))
    assert {n: s for n, (s, _) in ours.items()} == {n: tuple(x.shape) for n, x in reference.items()}


def test_config_defaults_are_transformers():
    """Fields a config.json leaves out mean what they mean to transformers: head_dim 256
    (not hidden_size / heads), layer_types from full_attention_interval, the top-level
    rope_theta and partial_rotary_factor."""
    raw = dict(
        CONFIGS["untied"],
        num_hidden_layers=6,
        full_attention_interval=3,
        rope_theta=5e5,
        partial_rotary_factor=0.5,
    )
    del raw["head_dim"], raw["rms_norm_eps"]
    reference = Qwen3_5TextConfig(**raw)
    ours = hf.qwen3_5.FORMAT.normalize_config(dict(raw, model_type="qwen3_5_text"))
    for field in ("head_dim", "layer_types", "rms_norm_eps", "linear_conv_kernel_dim"):
        assert ours[field] == getattr(reference, field), field
    assert ours["head_dim"] == 256 and ours["layer_types"][2] == "full_attention"
    for key in ("rope_type", "rope_theta", "partial_rotary_factor"):
        assert ours["rope_parameters"][key] == reference.rope_parameters[key], key


@pytest.fixture
def broken(saved, tmp_path):
    """A copy of the untied model's directory to break."""
    _, path, _, _ = saved("untied")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_tensor_is_named(broken):
    name = "model.layers.0.mlp.up_proj.weight"
    _edit_tensors(broken, lambda t: t.pop(name))
    with pytest.raises(
        ValueError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' is missing"
    ):
        hf.from_pretrained(broken)


def test_wrong_shape_is_named(broken):
    name = "model.layers.1.linear_attn.in_proj_qkv.weight"

    def edit(t):
        t[name] = t[name][:-1]

    _edit_tensors(broken, edit)
    with pytest.raises(ValueError, match=r"in_proj_qkv\.weight' has shape \(\d+, \d+\), config"):
        hf.from_pretrained(broken)


def test_unexpected_tensor_is_named(broken):
    _edit_tensors(broken, lambda t: t.update({"model.layers.9.extra": np.zeros(2, np.float32)}))
    with pytest.raises(ValueError, match=r"does not have, such as \['model\.layers\.9\.extra'\]"):
        hf.from_pretrained(broken)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(model_type="bert"), r"model_type must be one of .* got 'bert'"),
        (dict(hidden_size=None), r"hidden_size must be an int >= 1, got None"),
        (dict(layer_types=["linear_attention"]), r"layer_types must list num_hidden_layers=4"),
        (dict(hidden_act="gelu"), r"hidden_act must be 'silu'"),
        (dict(rope_parameters=dict(rope_type="yarn")), r"rope_type must be 'default'"),
        (dict(rope_parameters="x"), r"rope_parameters must be a dict, got 'x'"),
        (dict(tie_word_embeddings="no"), r"tie_word_embeddings must be true or false"),
        (dict(attention_bias=True), r"attention_bias must be false"),
        (dict(attn_output_gate=False), r"attn_output_gate must be true"),
        (
            dict(linear_num_value_heads=3),
            r"linear_num_key_heads=2 must divide linear_num_value_heads=3",
        ),
        (
            dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.1}),
            r"partial_rotary_factor must be in \(0, 1\] and rotate an even number",
        ),
        # transformers reads a legacy rope_scaling before rope_parameters.
        (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), r"rope_type must be 'default'"),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "linear"}}),
            r"rope_parameters must be one dict for every layer",
        ),
    ],
)
def test_bad_config_field_is_named(broken, fields, message):
    _edit_config(broken, **fields)
    with pytest.raises(ValueError, match=message):
        hf.from_pretrained(broken)


def test_missing_files_and_bad_dtype(broken, tmp_path_factory):
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(ValueError, match="has no config.json"):
        hf.from_pretrained(empty)
    shutil.copy(broken / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match="holds neither model.safetensors nor"):
        hf.from_pretrained(empty)
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\)"):
        hf.from_pretrained(broken, jnp.int8)
    with pytest.raises(ValueError, match=r"param_dtype must be one of \('float32', 'bfloat16'\)"):
        hf.from_pretrained(broken, param_dtype="float16")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (empty / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"names model-00001-of-00002.safetensors, missing"):
        hf.from_pretrained(empty)


# -- text in, text out ---------------------------------------------------------------------

WORDS = [f"w{i}" for i in range(SIZES["vocab_size"])]


@pytest.fixture
def with_tokenizer(saved, tmp_path):
    """The untied model's directory with a word-level ``tokenizer.json`` (``w0`` .. ``w100``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, path, model, _ = saved("untied")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path, model


PROMPT_IDS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [42]]


def test_generate_text_is_the_tokens_generate_writes(with_tokenizer):
    path, model = with_tokenizer
    tokenizer = hf.load_tokenizer(path)
    prompts = [" ".join(WORDS[i] for i in ids) for ids in PROMPT_IDS]
    texts = hf.generate_text(model, tokenizer, prompts, 32)  # greedy
    t = max(map(len, PROMPT_IDS))  # the same batch as the greedy test: left padded
    tokens = np.zeros((3, t), np.int32)
    mask = np.zeros((3, t), bool)
    for i, ids in enumerate(PROMPT_IDS):
        tokens[i, t - len(ids) :], mask[i, t - len(ids) :] = ids, True
    ids = np.asarray(model.generate(jnp.asarray(tokens), 32, temperature=0.0, prompt_mask=mask))
    assert texts == [" ".join(WORDS[j] for j in row[t:]) for row in ids]


@pytest.mark.slow  # compiles two more decoding loops (one prompt with an EOS; sampling)
def test_generate_command_line_and_sampling(with_tokenizer, capsys):
    from experiments import generate

    path, model = with_tokenizer
    tokenizer = hf.load_tokenizer(path)
    prompts = [" ".join(WORDS[i] for i in ids) for ids in PROMPT_IDS]
    # The batch of the test above: each row is its prompt's text alone (the greedy test).
    words = hf.generate_text(model, tokenizer, prompts, 32)[1].split()
    unused = next(i for i, w in enumerate(WORDS) if w not in words)
    end = words.index(words[3])
    # Several EOS ids: the text ends at any of them, here the second (the first, which
    # the decoding loop stops at, is never sampled).
    _edit_config(path, eos_token_id=[unused, WORDS.index(words[3])])
    argv = ["--checkpoint", str(path), "--prompt", prompts[1], "--steps", "32"]
    assert generate.main(argv) == 0
    # The prompt, then its continuation (this word-level tokenizer decodes without spaces
    # at the ends; Qwen's byte-level one keeps them).
    assert capsys.readouterr().out == prompts[1] + " ".join(words[:end]) + "\n"
    # One prompt (a string) samples as a batch of it does, the same under the same key.
    key = jax.random.key(1)
    options = dict(temperature=0.8, top_k=5)
    sampled = hf.generate_text(model, tokenizer, prompts[1], 8, key, **options)
    assert [sampled] == hf.generate_text(model, tokenizer, prompts[1:2], 8, key, **options)
    assert len(sampled.split()) == 8 and set(sampled.split()) <= set(WORDS)


def test_text_errors_are_named(with_tokenizer, saved, capsys):
    from experiments import generate

    path, model = with_tokenizer
    _, bare, _, _ = saved("untied")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        hf.load_tokenizer(bare)
    with pytest.raises(ValueError, match="a string or a non-empty list of strings"):
        hf.generate_text(model, hf.load_tokenizer(path), [], 4)
    with pytest.raises(ValueError, match=r"eos_id must be None or ids in \[0, 101\)"):
        hf.generate_text(model, hf.load_tokenizer(path), "w1", 4, eos_id=[3, 101])
    assert hf.eos_ids({"eos_token_id": 7}) == (7,) and hf.eos_ids({}) == ()
    assert hf.eos_ids({"eos_token_id": [7, 3]}) == (7, 3)
    with pytest.raises(ValueError, match=r"eos_token_id must be an int or a list of ints"):
        hf.eos_ids({"eos_token_id": "</s>"})
    assert generate.main(["--checkpoint", bare, "--prompt", "w1"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
    missing = os.path.join(bare, "no-such-checkpoint")
    for read in (hf.load_tokenizer, hf.read_config):
        with pytest.raises(ValueError, match="no-such-checkpoint is not a directory"):
            read(missing)
    assert generate.main(["--checkpoint", missing, "--prompt", "w1"]) == 2
    assert "no-such-checkpoint is not a directory" in capsys.readouterr().err


def test_init_from_a_directory_with_a_tokenizer_warns_that_it_is_not_used(with_tokenizer, caplog):
    # The task feeds its own token ids (MQAR's, a text task's bytes): a checkpoint's
    # tokenizer.json would silently mean nothing, so the run says so.
    from experiments import trainer
    from tests.test_experiments import tiny_config

    path, _ = with_tokenizer
    with caplog.at_level("WARNING"):
        trainer.build_model(tiny_config("configs/mqar.py:small", f"init_from={path}"))
    assert f"init_from={path}: its tokenizer.json is not used; task mqar" in caplog.text
    caplog.clear()
    os.remove(os.path.join(path, "tokenizer.json"))
    with caplog.at_level("WARNING"):
        trainer.build_model(tiny_config("configs/mqar.py:small", f"init_from={path}"))
    assert "tokenizer.json" not in caplog.text


def test_trainer_builds_its_model_from_a_checkpoint(saved, tmp_path):
    """``--config.init_from=DIR``: the run's model is the checkpoint's."""
    from experiments import trainer
    from tests.test_experiments import tiny_config

    _, path, model, _ = saved("untied")
    config = tiny_config("configs/mqar.py:small", f"init_from={path}")
    built = trainer.build_model(config)
    jax.tree.map(np.testing.assert_array_equal, nnx_params(built), nnx_params(model))
    # model.dtype=bfloat16 computes in bfloat16 over float32 parameters, as a random
    # initialisation does (bfloat16 parameters would round away the optimiser's updates).
    half = tiny_config("configs/mqar.py:small", f"init_from={path}", "model.dtype=bfloat16")
    half = trainer.build_model(half)
    assert {x.dtype for x in jax.tree.leaves(nnx_params(half))} == {jnp.dtype(jnp.float32)}
    assert half.blocks[0].attention.q_proj.dtype == jnp.bfloat16
    scanned = tiny_config("configs/mqar.py:small", f"init_from={path}", "model.scan_layers=true")
    scanned = trainer.build_model(scanned)  # "untied": one period of 4 layers, stacked 1 deep
    assert scanned.period == 4
    np.testing.assert_array_equal(
        scanned.blocks[3].attention.q_proj.kernel[0], model.blocks[3].attention.q_proj.kernel
    )
    bad = tiny_config("configs/mqar.py:small", f"init_from={tmp_path}")
    with pytest.raises(ValueError, match=r"init_from=.* has no config.json"):
        trainer.train(bad, tmp_path / "bad")
    wide = tiny_config("configs/mqar.py:small", f"init_from={path}", "mqar.vocab_size=256")
    with pytest.raises(ValueError, match=r"knows 101 tokens, fewer than the task's 256"):
        trainer.train(wide, tmp_path / "wide")


@pytest.mark.slow  # compiles a training step of the hybrid (the tied one: one DeltaNet layer)
def test_trainer_fine_tunes_from_a_checkpoint(saved, tmp_path):
    from experiments import trainer
    from tests.test_experiments import tiny_config

    _, path, model, _ = saved("tied")
    config = tiny_config("configs/mqar.py:small", f"init_from={path}", "steps=1", "seq_len=32")
    with jax.numpy_dtype_promotion("standard"):
        final = trainer.train(config, tmp_path / "run")
    assert np.isfinite(final["loss"]) and final["step"] == 1


def test_mesh_places_each_parameter_with_its_sharding(saved):
    _, path, _, _ = saved("untied")
    # The layers' logical names (embed, heads, ...) are placed under sharding.RULES, not
    # read as mesh axes (a mesh without an "embed" axis would refuse them).
    auto = (jax.sharding.AxisType.Auto,) * 2
    explicit = jax.make_mesh(
        (1, 1), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    with pytest.raises(
        ValueError, match=r"^mesh: .* Auto mesh axes, got fsdp=Explicit, tensor=Explicit"
    ):
        hf.from_pretrained(path, mesh=explicit)  # it loaded, then every call raised
    mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), axis_types=auto)
    model, _ = hf.from_pretrained(path, mesh=mesh)
    params = nnx_params(model)
    expected = jax.tree.leaves(sharding.place(params, mesh))
    for x, want in zip(jax.tree.leaves(params), expected, strict=True):
        assert isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding == want


def test_save_refuses_a_model_its_config_does_not_build(tmp_path):
    """A model carries its config (``model.hf_config``) only when loaded: a model built from
    options needs one, which must build it (the first difference named); nothing is
    written."""
    from linattn_jax.models import LanguageModel

    model = nnx.eval_shape(lambda: LanguageModel(16, 8, 1, 2, attention="linear", rngs=nnx.Rngs(0)))
    assert model.hf_config is None
    with pytest.raises(ValueError, match=r"the model carries no Hugging Face config"):
        hf.save_pretrained(model, tmp_path)
    config = hf.qwen3_5.FORMAT.normalize_config(
        dict(CONFIGS["untied"], model_type="qwen3_5_text", vocab_size=16, hidden_size=8)
    )
    with pytest.raises(
        ValueError,
        match=r"the Qwen3.5 config builds another model: its option depth=4, the model's 1",
    ):
        hf.save_pretrained(model, tmp_path, config)
    assert not (tmp_path / "config.json").exists()


def test_the_docs_weight_table_lists_every_rule():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs/guide/pretrained.md").read_text()
    rules = hf.qwen3_5.MODEL_RULES + hf.qwen3_5.BLOCK_RULES + (hf.qwen3_5.HEAD_RULE,)
    rules += sum(hf.qwen3_5.LAYER_RULES.values(), ())
    for rule in rules:  # each row names the tensor, or its sibling (up_proj beside gate_proj)
        name = rule.hf.removesuffix(".weight").rsplit(".", 1)[-1]
        assert rule.hf in page or f"`{name}`" in page, rule.hf
        for ours in rule.ours:
            assert ours in page or f"`{ours.split('.')[-2]}`" in page, ours


def test_a_stored_config_without_init_from_resumes():
    from experiments import validation
    from experiments.configuration import load_config

    config = load_config("configs/mqar.py:small")
    stored = config.to_dict()
    del stored["init_from"]  # a workdir written before the field existed
    assert validation.config_changes(stored, config) == []
    config.init_from = "somewhere"
    assert validation.config_changes(stored, config) == ["init_from='' there, 'somewhere' now"]


def test_a_model_of_one_kind_saves_and_transformers_loads_it(tmp_path):
    """Built from options, not loaded: Gated DeltaNet layers only (the attention's sizes in
    config.json are placeholders, as no layer reads them)."""
    config = hf.qwen3_5.FORMAT.normalize_config(
        dict(
            CONFIGS["untied"],
            model_type="qwen3_5_text",
            layer_types=["linear_attention"] * 2,
            num_hidden_layers=2,
            head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25),
        )
    )
    # Random parameters filled in on the host (an eager initialisation compiles op by op).
    graphdef, state = nnx.split(hf.abstract_model(config))
    rng = np.random.default_rng(0)
    for _, variable in nnx.to_flat_state(state):
        shape = variable.get_value().shape
        variable.set_value(jnp.asarray(rng.normal(0.0, 0.1, shape).astype(np.float32)))
    model = nnx.merge(graphdef, state)
    hf.save_pretrained(model, tmp_path, max_shard_size=None)
    back = Qwen3_5ForCausalLM.from_pretrained(tmp_path)
    assert back.config.layer_types == ["linear_attention"] * 2
    loaded, _ = hf.from_pretrained(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, nnx_params(loaded), nnx_params(model))
    with pytest.raises(ValueError, match=r"config\['vocab_size'\]=7, but the model has 101"):
        hf.save_pretrained(model, tmp_path / "bad", dict(config, vocab_size=7))


def test_unreadable_files_are_named_in_one_line(broken, tmp_path_factory, capsys):
    """A truncated or malformed file: a ValueError naming it, before anything is read, and
    one line with exit status 2 from the command lines, the work directory untouched."""
    from experiments import generate, trainer
    from tests.test_experiments import tiny_config

    sharded = tmp_path_factory.mktemp("sharded")
    shutil.copy(broken / "config.json", sharded / "config.json")
    index = sharded / "model.safetensors.index.json"
    for text in ("[1, 2]", '{"weight_map": {"model.norm.weight": '):  # a list; truncated
        index.write_text(text)
        with pytest.raises(
            ValueError,
            match=r"model\.safetensors\.index\.json (has no weight_map|is not readable JSON)",
        ):
            hf.from_pretrained(sharded)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        hf.check_pretrained(broken)
    run = tmp_path_factory.mktemp("run") / "workdir"
    with pytest.raises(ValueError, match=r"init_from=.*model\.safetensors is not a readable"):
        trainer.train(tiny_config("configs/mqar.py:small", f"init_from={broken}"), run)
    assert not run.exists()
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    assert generate.main(["--checkpoint", str(broken), "--prompt", "w1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.json is not a readable tokenizer" in err[0]


def test_save_compares_the_config_on_what_the_model_uses(saved, tmp_path):
    """``save_pretrained(model, path, config)`` with ``from_pretrained``'s own config: a
    ``partial_rotary_factor`` of 0.3 rotates 4 of 16 channels (the model's 0.25 does the
    same); an all-linear model's ``rope_theta`` is nothing the model uses."""
    from linattn_jax.models import LanguageModel

    _, path, _, _ = saved("tied")
    shutil.copytree(path, tmp_path / "in")
    _edit_config(
        tmp_path / "in",
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.3),
    )
    model, config = hf.from_pretrained(tmp_path / "in")
    assert model.blocks[0].attention.rotary_dim == 4
    hf.save_pretrained(model, tmp_path / "out", config)
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"][
            "partial_rotary_factor"
        ]
        == 0.3
    )
    with pytest.raises(
        ValueError,
        match=r"config\['rope_parameters'\]=.*'partial_rotary_factor': 0.5}, but the model has "
        r".*'partial_rotary_factor': 0.3}",
    ):
        hf.save_pretrained(
            model,
            tmp_path / "bad",
            dict(
                config, rope_parameters=dict(config["rope_parameters"], partial_rotary_factor=0.5)
            ),
        )
    raw = dict(
        SIZES,
        model_type="qwen3_5_text",
        hidden_size=32,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        rope_parameters=dict(rope_theta=1e7),
    )
    linear = hf.qwen3_5.FORMAT.normalize_config(raw)
    model = LanguageModel(**hf.qwen3_5.FORMAT.model_options(linear), rngs=nnx.Rngs(0))
    hf.save_pretrained(model, tmp_path / "linear", linear)
    _, back = hf.from_pretrained(tmp_path / "linear")
    assert back["rope_parameters"]["rope_theta"] == 1e7


def test_a_save_leaves_no_earlier_shards(saved, tmp_path):
    _, _, model, _ = saved("untied")
    hf.save_pretrained(model, tmp_path, max_shard_size="20KB")
    many = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    hf.save_pretrained(model, tmp_path, max_shard_size="60KB")
    fewer = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert 1 < len(fewer) < len(many)
    names = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(fewer) == set(names.values())  # only this save's shards are left
    (tmp_path / "model-00099-of-00099.txt").write_text("not ours")  # kept: not a shard name
    hf.save_pretrained(model, tmp_path, max_shard_size=None)
    assert (
        not list(tmp_path.glob("model-*.safetensors"))
        and (tmp_path / "model-00099-of-00099.txt").exists()
    )


def test_scanned_layers_load_match_and_save_the_same_files(tmp_path):
    """``scan_layers=True``: layer ``l`` read into slice ``l // 2`` of block ``l % 2``
    (attention, Gated DeltaNet, twice: stacked 2 deep); the logits and greedy tokens of the
    unrolled model, and a save that writes the unrolled model's files byte for byte."""
    torch.manual_seed(1)
    layers = ["full_attention", "linear_attention"] * 2
    config = Qwen3_5TextConfig(**dict(CONFIGS["untied"], layer_types=layers))
    ref = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for key, p in ref.named_parameters():
            if "norm" in key:
                p.normal_(0.0, 0.3)
    ref.save_pretrained(tmp_path / "ref")
    unrolled, ours = hf.from_pretrained(tmp_path / "ref")
    scanned, _ = hf.from_pretrained(tmp_path / "ref", scan_layers=True)
    assert (scanned.period, len(scanned.blocks)) == (2, 2)
    assert scanned.blocks[1].attention.q_proj.kernel.shape[0] == 2  # layers 1 and 3
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 13))
    mask = jnp.ones(tokens.shape, bool)
    logits = forward(scanned, jnp.asarray(tokens, jnp.int32), mask)
    assert_close_normwise(logits, torch_logits(ref, tokens), LOGITS_RTOL)
    assert_close_normwise(logits, forward(unrolled, jnp.asarray(tokens, jnp.int32), mask), 1e-6)
    prompt = jnp.asarray(tokens[:1, :5], jnp.int32)
    np.testing.assert_array_equal(
        scanned.generate(prompt, 8, temperature=0.0), unrolled.generate(prompt, 8, temperature=0.0)
    )
    hf.save_pretrained(scanned, tmp_path / "scanned", ours)
    hf.save_pretrained(unrolled, tmp_path / "unrolled", ours)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "scanned" / name).read_bytes() == (
            tmp_path / "unrolled" / name
        ).read_bytes(), name
