"""Llama checkpoints in Hugging Face format (``LlamaForCausalLM``, ``model_type``
``llama``) <-> ``LanguageModel``: the base of the softmax model types.

Every layer is softmax attention (GQA, RoPE over whole heads, ``rotate_half``; our
``"softmax"`` kind) and a SwiGLU MLP, each after an RMSNorm of epsilon ``rms_norm_eps``;
``head_dim`` is ``hidden_size / num_attention_heads`` unless given, ``num_key_value_heads``
``num_attention_heads`` unless given; RoPE scaled as ``rope_parameters`` (or the legacy
``rope_scaling``) says (``hf.rope``: linear, dynamic, yarn, llama3). The tensors are
Llama's (``tables``' shared rows) under ``model.``, ``lm_head.weight`` apart (untied only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, rope, tables

# transformers' LlamaConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, pretraining_tp=1, max_position_embeddings=2048,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip


def heads(config: common.Config) -> None:
    """``num_key_value_heads`` (``num_attention_heads``) and ``head_dim`` (``hidden_size /
    num_attention_heads``) where null, as ``transformers`` derives them."""
    n = config["num_attention_heads"]
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = n
    if config.get("head_dim") is None and common.is_int(n) and n > 0:
        if common.is_int(config["hidden_size"]):
            config["head_dim"] = config["hidden_size"] // n


def softmax_options(config: Mapping[str, Any], **more: Any) -> dict[str, Any]:
    """Llama's attention as ``kind_options["softmax"]``, with ``more`` options."""
    return dict(
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        **rope.options(config),
        **more,
    )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer softmax attention with a SwiGLU MLP."""
    return dict(
        num_heads=config["num_attention_heads"],
        attention="softmax",
        kind_options={"softmax": softmax_options(config)},
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
    )


FORMAT = common.ModelFormat(
    name="Llama",
    model_types=("llama",),
    architecture="LlamaForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        heads,
        common.ints(INT_FIELDS),
        common.divides("num_key_value_heads", "num_attention_heads"),
        common.choice("hidden_act", ("silu",)),
        common.false(("attention_bias", "mlp_bias")),
        common.unsupported({"pretraining_tp": 1}),
        common.bools(("tie_word_embeddings",)),
        common.numbers(("rms_norm_eps",)),
        rope.parameters(10000.0),
    ),
    options=options,
    table=tables.layered(
        tables.MODEL_RULES,
        lambda config, i: tables.NORM_RULES + tables.ATTENTION_RULES + tables.MLP_RULES,
    ),
    finish=common.rms_norm_eps("rms_norm_eps"),
)
