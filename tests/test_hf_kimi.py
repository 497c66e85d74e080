"""Kimi Linear checkpoints (linattn_jax.hf.kimi_linear: KDA, MLA, DeepSeek-style MoE)
against transformers' own torch model, from a tiny random config made here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import hf
from linattn_jax.layers import DeltaRuleAttention, LatentAttention, MoE
from linattn_jax.layers.moe import RouterBias
from tests import helpers
from tests.helpers import assert_close_normwise

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGITS_RTOL = 1e-5
CONFIG = dict(
    vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=12,
    q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
    n_group=4, topk_group=2, num_experts_per_tok=3, num_local_experts=8, n_shared_experts=2,
    routed_scaling_factor=2.5, linear_head_dim=8, linear_num_heads=2, rms_norm_eps=1e-5,
    layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
    initializer_range=0.1,
    pad_token_id=0, bos_token_id=1, eos_token_id=None,
)  # fmt: skip


def randomized(ref):
    """``ref`` with random norms, score biases, gates and routers far from uniform."""
    with torch.no_grad():
        for key, p in ref.named_parameters():
            if "norm" in key:
                p.normal_(1.0, 0.3)
            elif key.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif key.endswith("dt_bias"):
                p.normal_(-2.0, 0.5)
        for key, b in ref.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return ref


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    torch.manual_seed(0)
    config = transformers.KimiLinearConfig(**CONFIG)
    ref = randomized(transformers.KimiLinearForCausalLM(config).eval())
    path = str(tmp_path_factory.mktemp("kimi_linear"))
    ref.save_pretrained(path)
    return (ref, path, *hf.from_pretrained(path))


forward = nnx.jit(lambda model, tokens, mask: model(tokens, key_mask=mask))
decode = nnx.jit(lambda model, tokens, state: model(tokens, state=state, return_state=True))


def torch_logits(ref, tokens) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor(tokens)).logits.numpy()


def test_logits_greedy_tokens_and_decoding_match_transformers(pair):
    ref, _, model, config = pair
    assert config["model_type"] == "kimi_linear" and config["num_experts"] == 8
    assert [type(b.attention) for b in model.blocks] == [DeltaRuleAttention, LatentAttention]
    assert not isinstance(model.blocks[0].mlp, MoE) and isinstance(model.blocks[1].mlp, MoE)
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (3, 17))
    mask = np.ones((3, 17), bool)
    mask[0, :4] = False  # row 0 left-padded
    ours = np.asarray(forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)))
    assert_close_normwise(ours[1:], torch_logits(ref, tokens[1:]), LOGITS_RTOL)
    assert_close_normwise(ours[0, 4:], torch_logits(ref, tokens[:1, 4:])[0], LOGITS_RTOL)
    # Prefill + one token at a time == the full forward (MLA's absorbed cache, KDA's step).
    state = model.init_state(2, 20)
    full = ours[1:, :12]
    logits, state = decode(model, jnp.asarray(tokens[1:, :9]), state)
    steps = [logits]
    for i in range(9, 12):
        logits, state = decode(model, jnp.asarray(tokens[1:, i : i + 1]), state)
        steps.append(logits)
    assert_close_normwise(jnp.concatenate(steps, 1), full, LOGITS_RTOL)
    prompt = tokens[1:2, :6]
    out = np.asarray(model.generate(jnp.asarray(prompt, jnp.int32), 16, temperature=0.0))
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor(prompt), max_new_tokens=16, do_sample=False, min_new_tokens=16
        ).numpy()
    np.testing.assert_array_equal(out[0, 6:], expected[0, 6:])


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    ref, _, model, config = pair
    hf.save_pretrained(model, tmp_path, config)
    back = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path).eval()
    ref_state, back_state = ref.state_dict(), back.state_dict()
    assert set(back_state) == set(ref_state)
    for key, value in ref_state.items():  # every tensor (buffers too), bit for bit
        np.testing.assert_array_equal(back_state[key].numpy(), value.numpy(), err_msg=key)
    again, again_config = hf.from_pretrained(tmp_path)
    assert again_config == config
    helpers.assert_saved_alike_without_config(model, tmp_path)
    weights = lambda m: nnx.state(m, nnx.Any(nnx.Param, RouterBias))  # the score bias too
    jax.tree.map(np.testing.assert_array_equal, weights(again), weights(model))
    # bfloat16 parameters; the score bias stays float32, as transformers keeps it.
    half, _ = hf.from_pretrained(tmp_path, jnp.bfloat16)
    assert half.blocks[1].mlp.router.dtype == jnp.bfloat16
    assert half.blocks[1].mlp.bias.dtype == jnp.float32
    # Without a config: the model's own, which transformers reads alike.
    hf.save_pretrained(model, tmp_path / "bare", model_type="kimi_linear")
    bare = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "bare").eval()
    tokens = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (2, 9))
    np.testing.assert_array_equal(torch_logits(bare, tokens), torch_logits(ref, tokens))


def test_moonshot_config_fields_and_bad_fields(pair):
    _, _, _, config = pair
    raw = {k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types")}
    raw["linear_attn_config"] = dict(
        full_attn_layers=[2], kda_layers=[1], head_dim=8, num_heads=2,
        short_conv_kernel_size=4,
    )  # fmt: skip
    raw["first_k_dense_replace"] = 1
    assert hf.kimi_linear.FORMAT.normalize_config(raw) == config
    with pytest.raises(ValueError, match="num_key_value_heads=1 must equal"):
        hf.kimi_linear.FORMAT.normalize_config(dict(config, num_key_value_heads=1))
    with pytest.raises(ValueError, match="topk_group=5 must be <="):
        hf.kimi_linear.FORMAT.normalize_config(dict(config, topk_group=5))
    with pytest.raises(ValueError, match="hidden_act"):
        hf.kimi_linear.FORMAT.normalize_config(dict(config, hidden_act="gelu"))


def test_low_rank_queries_load_and_match(tmp_path):
    """``q_lora_rank`` (q_a_proj, q_a_layernorm, q_b_proj), no dense layer, and
    ``tie_word_embeddings`` true, which transformers' Kimi ignores (its head is its own)."""
    config = dict(
        CONFIG, q_lora_rank=6, tie_word_embeddings=True, mlp_layer_types=["sparse"] * 2,
    )  # fmt: skip
    torch.manual_seed(1)
    ref = randomized(
        transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**config)).eval()
    )
    ref.save_pretrained(tmp_path / "ref")
    model, ours = hf.from_pretrained(tmp_path / "ref")
    assert model.blocks[1].attention.q_a_proj is not None and model.head is not None
    tokens = np.random.default_rng(3).integers(0, CONFIG["vocab_size"], (2, 11))
    logits = forward(model, jnp.asarray(tokens, jnp.int32), jnp.ones(tokens.shape, bool))
    assert_close_normwise(logits, torch_logits(ref, tokens), LOGITS_RTOL)
    hf.save_pretrained(model, tmp_path / "ours", ours)
    back = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "ours").eval()
    for key, value in ref.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[key].numpy(), value.numpy(), err_msg=key)


@pytest.mark.slow  # compiles a training step of the MoE hybrid
def test_trainer_fine_tunes_from_a_kimi_checkpoint(pair, tmp_path):
    """``--config.init_from=DIR``: the run's model is the checkpoint's, and it trains."""
    from experiments import trainer
    from tests.test_experiments import tiny_config

    _, path, model, _ = pair
    config = tiny_config("configs/mqar.py:small", f"init_from={path}", "steps=1", "seq_len=32")
    built = trainer.build_model(config)
    weights = lambda m: nnx.state(m, nnx.Any(nnx.Param, RouterBias))
    jax.tree.map(np.testing.assert_array_equal, weights(built), weights(model))
    with jax.numpy_dtype_promotion("standard"):
        final = trainer.train(config, tmp_path / "run")
    assert np.isfinite(final["loss"]) and final["step"] == 1


def test_the_docs_weight_table_lists_every_rule_and_other_forms_are_refused(tmp_path):
    from pathlib import Path

    from linattn_jax.models import LanguageModel

    page = (Path(__file__).parents[1] / "docs/guide/kimi.md").read_text()
    k = hf.kimi_linear
    rules = k.MODEL_RULES + k.NORM_RULES + k.KDA_RULES + k.MLA_Q_RULES + k.MLA_Q_LORA_RULES
    rules += k.MLA_RULES + k.DENSE_RULES + k.ROUTER_RULES + k.EXPERT_RULES + k.SHARED_RULES
    for rule in rules + (k.HEAD_RULE,):  # each row names the tensor, or its sibling
        name = rule.hf.removesuffix(".weight").rsplit(".", 1)[-1]
        assert rule.hf in page or f"`{name}`" in page, rule.hf
    assert all(f"{p}_conv1d" in page for p in "qkv")  # the conv's three tensors
    model = nnx.eval_shape(
        lambda: LanguageModel(16, 8, 1, 2, attention="softmax", rngs=nnx.Rngs(0))
    )
    with pytest.raises(ValueError, match="the model carries no Hugging Face config"):
        hf.save_pretrained(model, tmp_path, model_type="kimi_linear")
    # KimiLinearForCausalLM's head is its own: a tied model is not one.
    config = hf.kimi_linear.FORMAT.normalize_config(dict(CONFIG, model_type="kimi_linear"))
    options = hf.kimi_linear.FORMAT.model_options(config) | dict(tie_embeddings=True)
    tied = nnx.eval_shape(lambda: LanguageModel(**options, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="its option tie_embeddings=False, the model's True"):
        hf.save_pretrained(tied, tmp_path, config)
    assert not (tmp_path / "config.json").exists()


def test_scanned_layers_run_as_unrolled(pair, tmp_path):
    """``scan_layers=True`` with a mixture: the router losses' record is stacked with the
    layers (it was reset to one layer's shape, and the first forward failed)."""
    ref, path, model, _ = pair
    scanned, _ = hf.from_pretrained(path, scan_layers=True)
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 9))
    assert_close_normwise(helpers.logits(scanned, tokens), helpers.logits(model, tokens), 1e-6)
