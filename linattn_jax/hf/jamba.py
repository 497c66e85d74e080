"""Jamba checkpoints in Hugging Face format (``JambaForCausalLM``, ``model_type`` ``jamba``)
<-> ``LanguageModel``: the config's fields as the model's options, and the one table of
weights.

Jamba is a hybrid of Mamba-1 mixers (our ``"mamba"``, ``hf.mamba``'s rows under
``mamba.``) and softmax attention (our ``"softmax"``), every layer followed by a SwiGLU MLP
or a mixture of SwiGLU experts (``layers.MoE``). Its conventions, each mapped to an option
of ours:

* layer ``i`` is attention where ``i % attn_layer_period == attn_layer_offset``, else a
  mixer; its MLP is a mixture of ``num_experts`` where ``i % expert_layer_period ==
  expert_layer_offset`` (and ``num_experts > 1``), else a SwiGLU of ``intermediate_size``;
* the router takes the top ``num_experts_per_tok`` of a softmax over all experts, the
  chosen weights not renormalised (``MoE(normalize=False)``); experts are saved per expert
  under ``feed_forward.experts.{j}.`` or fused (``hf.experts``);
* the mixer's ``dt``, ``B`` and ``C`` pass RMS norms with weights (``dt_layernorm``,
  ``b_layernorm``, ``c_layernorm``: our ``mixer_rms_weights``);
* attention is Llama's without RoPE (GQA, no biases, heads ``head_dim`` wide: by default
  ``hidden_size // num_attention_heads``, as ``transformers`` reads it);
* every RMSNorm's epsilon is ``rms_norm_eps``; ``mamba_dt_rank`` ``"auto"`` is
  ``ceil(hidden_size / 16)``; ``use_mamba_kernels``, ``use_mambapy`` and
  ``use_associative_scan`` choose how ``transformers`` runs the same scan.

The tensors live under ``model.`` (``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import bamba, common, experts, mamba, tables
from linattn_jax.hf.tables import COPY, EXPERTS_GATE_UP, EXPERTS_LINEAR, LINEAR

MODEL_TYPES = ("jamba",)

NORM_RULES = bamba.BLOCK_RULES[:2]  # input_layernorm, pre_ff_layernorm
MLP_RULES = tables.under(tables.SWIGLU_RULES, "feed_forward.", "mlp.")
ROUTER_RULES = tables.rules(("feed_forward.router.weight", "mlp.router", LINEAR))
FUSED_RULES = tables.rules(
    ("feed_forward.experts.gate_up_proj", ("mlp.gate", "mlp.up"), EXPERTS_GATE_UP),
    ("feed_forward.experts.down_proj", "mlp.down", EXPERTS_LINEAR),
)
MIXER_NORM_RULES = tables.rules(
    ("mamba.dt_layernorm.weight", "attention.dt_layernorm.scale", COPY),
    ("mamba.b_layernorm.weight", "attention.b_layernorm.scale", COPY),
    ("mamba.c_layernorm.weight", "attention.c_layernorm.scale", COPY),
)


def is_attention(config: Mapping[str, Any], i: int) -> bool:
    """Whether layer ``i`` is softmax attention (else a Mamba-1 mixer)."""
    return i % config["attn_layer_period"] == config["attn_layer_offset"]


def is_moe(config: Mapping[str, Any], i: int) -> bool:
    """Whether layer ``i``'s MLP is a mixture, as ``transformers``' Jamba decides."""
    period, offset = config["expert_layer_period"], config["expert_layer_offset"]
    return config["num_experts"] > 1 and i % period == offset


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """Every tensor, in the model's order: the experts per expert, or fused for a
    ``prefix`` ending in ``experts.FUSED``."""
    fused, prefix = prefix.endswith(experts.FUSED), prefix.removesuffix(experts.FUSED)
    mixer = mamba.mixer_rules(
        "mamba.", conv_bias=config["mamba_conv_bias"], bias=config["mamba_proj_bias"]
    )
    rows = [(prefix + r.hf, r) for r in bamba.MODEL_RULES]
    for i in range(config["num_hidden_layers"]):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        own = tables.ATTENTION_RULES if is_attention(config, i) else mixer + MIXER_NORM_RULES
        rows += tables.prefixed(NORM_RULES + own, layer, block)
        if not is_moe(config, i):
            rows += tables.prefixed(MLP_RULES, layer, block)
        elif fused:
            rows += tables.prefixed(ROUTER_RULES + FUSED_RULES, layer, block)
        else:
            rows += tables.prefixed(ROUTER_RULES, layer, block)
            rows += tables.experts(
                tables.EXPERT_RULES, layer, block, config["num_experts"], "feed_forward.experts."
            )
    return rows


# transformers' JambaConfig defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=65536, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
    rms_norm_eps=1e-6, num_experts_per_tok=2, num_experts=16, expert_layer_period=2,
    expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16,
    mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto", mamba_conv_bias=True,
    mamba_proj_bias=False,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "num_experts_per_tok", "num_experts",
    "expert_layer_period", "attn_layer_period", "mamba_d_state", "mamba_d_conv",
    "mamba_expand", "mamba_dt_rank", "head_dim",
)  # fmt: skip


def derived(config: common.Config) -> None:
    """What ``transformers`` derives: ``num_experts`` from ``num_local_experts`` (its
    alias), ``num_key_value_heads`` (``num_attention_heads`` when null), ``head_dim``
    (``hidden_size // num_attention_heads`` when absent) and ``mamba_dt_rank`` ``"auto"``
    (``ceil(hidden_size / 16)``)."""
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    if config["num_key_value_heads"] is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") is None and common.is_int(hidden) and common.is_int(heads) and heads:
        config["head_dim"] = hidden // heads
    if config["mamba_dt_rank"] == "auto" and common.is_int(config["hidden_size"]):
        config["mamba_dt_rank"] = math.ceil(config["hidden_size"] / 16)


def check_layout(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless each offset is below its period (as ``transformers``)."""
    common.check_ints(config, ("attn_layer_offset", "expert_layer_offset"), minimum=0)
    for kind in ("attn", "expert"):
        offset, period = f"{kind}_layer_offset", f"{kind}_layer_period"
        if config[offset] >= config[period]:
            raise ValueError(
                f"config.json: {offset} must be below {period}={config[period]}, "
                f"got {config[offset]}"
            )


def check_experts(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless a mixture (``num_experts > 1``) has at most
    ``num_experts`` chosen per token."""
    if config["num_experts"] > 1:
        common.check_at_most(config, "num_experts_per_tok", "num_experts")


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Mamba-1 mixers and Llama's attention without RoPE, each with a SwiGLU or a mixture."""
    n = config["num_hidden_layers"]
    mixer = dict(
        expand=config["mamba_expand"],
        state_dim=config["mamba_d_state"],
        dt_rank=config["mamba_dt_rank"],
        conv_size=config["mamba_d_conv"],
        use_conv_bias=config["mamba_conv_bias"],
        use_bias=config["mamba_proj_bias"],
        mixer_rms_eps=float(config["rms_norm_eps"]),
        mixer_rms_weights=True,
    )
    softmax = bamba.llama_attention(config, rope=False) | dict(head_dim=config["head_dim"])
    moe = dict(
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        hidden=config["intermediate_size"],
        normalize=False,
    )
    return dict(
        num_heads=config["num_attention_heads"],
        attention=["softmax" if is_attention(config, i) else "mamba" for i in range(n)],
        kind_options={"mamba": mixer, "softmax": softmax},
        mlp=experts.layout([is_moe(config, i) for i in range(n)]),
        mlp_hidden=config["intermediate_size"],
        **(dict(moe=moe) if config["num_experts"] > 1 else {}),
    )


FORMAT = common.ModelFormat(
    name="Jamba",
    model_types=MODEL_TYPES,
    architecture="JambaForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=("num_key_value_heads",)),
        derived,
        common.ints(INT_FIELDS),
        check_layout,
        check_experts,
        common.divides("num_key_value_heads", "num_attention_heads"),
        common.choice("hidden_act", ("silu",)),
        common.bools(("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings")),
        lambda config: common.check_number(config, "rms_norm_eps", 0, 1),
    ),
    options=options,
    table=table,
    prefixes=("model.", "model." + experts.FUSED),
    finish=common.rms_norm_eps("rms_norm_eps"),
)
