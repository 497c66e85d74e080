"""DeepSeek-V3 checkpoints (``DeepseekV3ForCausalLM``, ``model_type`` ``deepseek_v3``): every
layer MLA (``layers.LatentAttention``, Kimi Linear's names; the latents' norms' epsilon
1e-6), RoPE on ``qk_rope_head_dim`` channels (``hf.rope``; YaRN's ``mscale_all_dim`` squared
into the scores' scale, as ``transformers``), a SwiGLU on the first ``first_k_dense_replace``
layers and DeepSeek's mixture after (``layers.MoE``: sigmoid scores, the correction bias for
the choice only, ``topk_group`` of ``n_group`` groups by their two best, ``norm_topk_prob``,
``routed_scaling_factor``, ``n_shared_experts`` as one shared SwiGLU). ``rope_interleave``'s
rope rows of q and the shared key (interleaved pairs) are read as rotate-half's halves and
written back interleaved; the multi-token-prediction layers are not read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, experts, kimi_linear, llama, rope, tables
from linattn_jax.hf.tables import COPY, rules
from linattn_jax.layers.rope_scaling import yarn_mscale

# transformers' DeepseekV3Config defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
    num_nextn_predict_layers=1, pretraining_tp=1,
)  # fmt: skip
INTS = (
    "moe_intermediate_size", "n_shared_experts", "n_routed_experts", "kv_lora_rank", "v_head_dim",
    "qk_rope_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
)  # fmt: skip
MOE_RULES = rules(("mlp.gate.e_score_correction_bias", "mlp.bias", COPY)) + tables.under(
    tables.SWIGLU_RULES, "mlp.shared_experts.", "mlp.shared."
)


def attention_rules(config: Mapping[str, Any]) -> tuple[tables.Rule, ...]:
    """MLA's rows, the rope rows of q and of the shared key permuted (``rope_interleave``)."""
    q = kimi_linear.MLA_Q_RULES if config["q_lora_rank"] is None else kimi_linear.MLA_Q_LORA_RULES
    rows = q + kimi_linear.MLA_RULES
    if not config["rope_interleave"]:
        return rows
    p, rank = config["qk_rope_head_dim"] // 2, config["kv_lora_rank"]
    q, kv = (tables.rope_pairs(n + 2 * p, p) for n in (config["qk_nope_head_dim"], rank))
    how = {"q_proj": q, "q_b_proj": q, "kv_a_proj_with_mqa": kv}
    return tuple(dataclasses.replace(r, how=how.get(r.hf.split(".")[1], r.how)) for r in rows)


def check(config: common.Config) -> None:
    """Checks MLA's and the mixture's fields; ``head_dim`` is the rope's, as in transformers."""
    common.check_ints(config, INTS + (() if config["q_lora_rank"] is None else ("q_lora_rank",)))
    config["head_dim"] = config["qk_rope_head_dim"]
    common.check_ints(config, ("first_k_dense_replace", "num_nextn_predict_layers"), minimum=0)
    common.check_bools(config, ("norm_topk_prob", "rope_interleave"))
    common.check_unsupported(config, {"attention_bias": False, "pretraining_tp": 1})
    common.check_divides(config, "n_group", "n_routed_experts")
    common.check_at_most(config, "topk_group", "n_group")
    common.check_positive(config, ("routed_scaling_factor",))
    if (
        config.get("num_key_value_heads", config["num_attention_heads"])
        != config["num_attention_heads"]
    ):
        raise ValueError("config.json: num_key_value_heads must equal num_attention_heads (MLA)")
    if config["qk_rope_head_dim"] % 2:
        raise ValueError(f"config.json: qk_rope_head_dim must be even, got {config['head_dim']}")


def mla_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """``LatentAttention``'s options: DeepSeek-V3's MLA with RoPE (YaRN's ``mscale_all_dim``
    squared into the scores' scale)."""
    rp = config["rope_parameters"]
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    if rp["rope_type"] != "default" and rp.get("mscale_all_dim"):
        scale *= yarn_mscale(rp["factor"], rp["mscale_all_dim"]) ** 2
    return dict(
        num_heads=config["num_attention_heads"], kv_lora_rank=config["kv_lora_rank"],
        q_lora_rank=config["q_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
        scale=scale, **rope.options(config),
    )  # fmt: skip


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """MLA on every layer; SwiGLU on the first dense ones, DeepSeek's mixture after."""
    mla = mla_options(config)
    dense = config["first_k_dense_replace"]
    moe = dict(
        num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
        hidden=config["moe_intermediate_size"], score="sigmoid",
        normalize=config["norm_topk_prob"], scaling=float(config["routed_scaling_factor"]),
        score_bias=True, num_groups=config["n_group"], top_k_groups=config["topk_group"],
        shared_hidden=config["n_shared_experts"] * config["moe_intermediate_size"],
    )  # fmt: skip
    mlps = experts.layout([i >= dense for i in range(config["num_hidden_layers"])])
    return llama.layered_options(config, ["mla"], {"mla": mla}, mlp=mlps) | dict(moe=moe)


def mtp(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The multi-token-prediction layers' names (not read)."""
    n = config["num_hidden_layers"]
    return tuple(f"model.layers.{n + k}." for k in range(config["num_nextn_predict_layers"]))


FORMAT = llama.FORMAT.derive(
    name="DeepSeek-V3",
    model_types=("deepseek_v3",),
    architecture="DeepseekV3ForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=("q_lora_rank",)), check, *llama.CHECKS,
        rope.parameters(1e4),
    ),
    options=options,
    table=experts.table(
        attention_rules, lambda config, i: i >= config["first_k_dense_replace"], experts.ROUTER,
        tables.EXPERT_RULES, "mlp.experts.", "n_routed_experts", lambda config, i: MOE_RULES,
    ),
    prefixes=("model.", "model." + experts.FUSED),
    ignored=mtp,
    finish=kimi_linear.finish,
)  # fmt: skip
