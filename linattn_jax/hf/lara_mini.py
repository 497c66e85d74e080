"""Lara Mini checkpoints (``LaraMiniForCausalLM``, ``model_type`` ``lara_mini``) <->
``LanguageModel``.

Lara Mini is Qwen3.5-MoE's hybrid (``hf.qwen3_5_moe``: Gated DeltaNet, softmax attention,
a mixture of experts in every layer) with three kinds of layer by ``layer_types``:
``"linear_attention"`` (our ``"gated_deltanet"``), ``"sliding_attention"`` (our
``"local_softmax"``: the last ``sliding_window`` tokens, RoPE over whole heads) and
``"full_attention"`` (our ``"softmax"``, no positional encoding). Its differences from
Qwen3.5-MoE, each an option of ours:

* every RMSNorm is plain, ``w * norm(x)`` (Qwen3.5's are ``(1 + w)``), the q/k norms per
  head too, all of epsilon ``rms_norm_eps`` (the Gated DeltaNet's gated one as well);
* the attention has no output gate;
* the shared expert is added in full (no ``shared_expert_gate``);
* the file fuses the Gated DeltaNet's input projections into one ``linear_attn.in_proj``
  (rows ``[q | k | v | z | b | a]``, our ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``,
  ``beta_proj``, ``gate.proj``) and names its gated norm ``linear_attn.out_norm``; the
  experts are fused (``mlp.experts.gate_up_proj``, ``down_proj``). ``transformers``' in-memory
  names (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``norm``) are read too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, llama, qwen3_5, qwen3_5_moe, rope, tables
from linattn_jax.hf.tables import COPY, SPLIT, rules

MODEL_TYPES = ("lara_mini",)
LAYER_KINDS = {**qwen3_5.LAYER_KINDS, **llama.LAYER_KINDS}
MEMORY = "#memory"  # a prefix ending so names the in-memory names' table
# transformers' LaraMiniConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=151936, hidden_size=1024, num_hidden_layers=34, num_attention_heads=16,
    num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=True,
    attention_bias=False, head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=4,
    num_experts=128, norm_topk_prob=True, sliding_window=512, max_position_embeddings=131072,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
    "num_experts", "sliding_window",
)  # fmt: skip
PATTERN = ("linear_attention", "sliding_attention", "linear_attention", "full_attention",
           "sliding_attention")  # fmt: skip

DELTA_RULES = rules(
    (
        "linear_attn.in_proj.weight",
        tuple(
            f"attention.{p}.kernel"
            for p in ("q_proj", "k_proj", "v_proj", "g_proj", "beta_proj", "gate.proj")
        ),
        SPLIT,
    ),
    ("linear_attn.out_norm.weight", "attention.output_norm.scale", COPY),
)
FUSED_AWAY = ("linear_attn.in_proj_", "linear_attn.norm.")  # the in-memory rows the file fuses
SAVED_DELTA_RULES = DELTA_RULES + tuple(
    r for r in qwen3_5.LAYER_RULES["linear_attention"] if not r.hf.startswith(FUSED_AWAY)
)
SOFTMAX_RULES = tables.ATTENTION_RULES + tables.QK_NORM_RULES  # full and sliding layers
SHARED_RULES = qwen3_5_moe.SHARED_RULES[:3]  # no shared_expert_gate
MOE_RULES = qwen3_5_moe.ROUTER_RULES + tables.FUSED_EXPERT_RULES + SHARED_RULES


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """Every tensor, in the model's order: the saved names, or the in-memory ones for a
    ``prefix`` ending in ``MEMORY``."""
    memory, prefix = prefix.endswith(MEMORY), prefix.removesuffix(MEMORY)
    delta = qwen3_5.LAYER_RULES["linear_attention"] if memory else SAVED_DELTA_RULES
    rows = [(prefix + r.hf, r) for r in tables.MODEL_RULES]
    for i, layer_type in enumerate(config["layer_types"]):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        mixer = delta if layer_type == "linear_attention" else SOFTMAX_RULES
        rows += tables.prefixed(tables.NORM_RULES + mixer + MOE_RULES, layer, block)
    return rows


def layers(config: common.Config) -> None:
    """``layer_types`` (``transformers``' default: the released period of five) checked."""
    n = config["num_hidden_layers"]
    if config.get("layer_types") is None:
        config["layer_types"] = [PATTERN[i % len(PATTERN)] for i in range(n)]
    common.check_layer_types(config, tuple(LAYER_KINDS))


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE's Gated DeltaNet and mixture (the shared expert ungated), plain norms,
    ungated attention: full layers without RoPE, sliding ones with it."""
    softmax = dict(
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        qk_norm=True,
    )
    local = dict(softmax, **rope.options(config), sliding_window=config["sliding_window"])
    delta = dict(
        num_heads=config["linear_num_key_heads"],
        num_v_heads=config["linear_num_value_heads"],
        head_dim=config["linear_key_head_dim"],
        value_head_dim=config["linear_value_head_dim"],
        conv_size=config["linear_conv_kernel_dim"],
    )
    moe = qwen3_5_moe.moe_options(config)
    return dict(
        num_heads=config["num_attention_heads"],
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options=dict(
            gated_deltanet=delta, softmax=dict(softmax, rope=False), local_softmax=local
        ),
        mlp="moe",
        moe=moe | dict(normalize=config["norm_topk_prob"], shared_gate=False),
    )


FORMAT = qwen3_5_moe.FORMAT.derive(
    name="Lara Mini",
    model_types=MODEL_TYPES,
    architecture="LaraMiniForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        common.ints(INT_FIELDS),
        common.divides("num_key_value_heads", "num_attention_heads"),
        common.divides("linear_num_key_heads", "linear_num_value_heads"),
        common.at_most("num_experts_per_tok", "num_experts"),
        layers,
        common.unsupported({"hidden_act": "silu", "attention_bias": False}),
        common.bools(("tie_word_embeddings", "norm_topk_prob")),
        common.numbers(("rms_norm_eps",)),
        rope.parameters(10000.0),
    ),
    options=options,
    table=table,
    prefixes=("model.", "model." + MEMORY),
    ignored=lambda config: (),
)
