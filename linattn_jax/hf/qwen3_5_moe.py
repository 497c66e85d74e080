"""Qwen3.5's mixture-of-experts text models in Hugging Face format <-> ``LanguageModel``.

``qwen3_5_moe_text`` (``Qwen3_5MoeForCausalLM``), or the text part of ``qwen3_5_moe``
(``Qwen3_5MoeForConditionalGeneration``), is Qwen3.5 (``hf.qwen3_5``: its attention, Gated
DeltaNet, norms and RoPE, read by that module) with every MLP a mixture of experts
(``layers.MoE``): a softmax router over ``num_experts`` choosing ``num_experts_per_tok``,
the chosen weights renormalised (always, in ``transformers``), SwiGLU experts of width
``moe_intermediate_size``, and one shared SwiGLU expert of width
``shared_expert_intermediate_size`` behind a sigmoid gate. The experts' weights are read in
either layout ``transformers`` reads, and written per expert, as ``transformers`` saves:

* ``mlp.gate.weight`` ``[e, width]``: our ``router`` ``[width, e]``;
* per expert ``j``: ``mlp.experts.{j}.{gate,up}_proj.weight`` ``[hidden, width]`` and
  ``mlp.experts.{j}.down_proj.weight`` ``[width, hidden]``: slice ``j`` of our ``gate``,
  ``up`` ``[e, width, hidden]`` and ``down`` ``[e, hidden, width]`` (transposed);
* or fused: ``mlp.experts.gate_up_proj`` ``[e, 2 * hidden, width]`` (rows ``[gate | up]``)
  and ``mlp.experts.down_proj`` ``[e, width, hidden]``;
* ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``:
  our ``shared`` SwiGLU's kernels and ``shared_gate``'s (transposed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, qwen3_5, tables
from linattn_jax.hf.tables import LINEAR, rules

MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
# transformers' defaults (Qwen3_5MoeTextConfig) of the mixture's fields.
MOE_DEFAULTS = dict(
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)  # fmt: skip
MOE_FIELDS = tuple(MOE_DEFAULTS)

ROUTER_RULES = rules(("mlp.gate.weight", "mlp.router", LINEAR))
FUSED_RULES = tables.FUSED_EXPERT_RULES
EXPERT_RULES = tables.EXPERT_RULES  # under mlp.experts.{j}., slice j
SHARED_RULES = rules(
    ("mlp.shared_expert.gate_proj.weight", "mlp.shared.gate_proj.kernel", LINEAR),
    ("mlp.shared_expert.up_proj.weight", "mlp.shared.up_proj.kernel", LINEAR),
    ("mlp.shared_expert.down_proj.weight", "mlp.shared.down_proj.kernel", LINEAR),
    ("mlp.shared_expert_gate.weight", "mlp.shared_gate.kernel", LINEAR),
)
# A prefix ending so names the fused layout's table: the loader reads a file by the table
# (of those of FORMAT.prefixes) that names most of its tensors, and writes the first.
FUSED = "#fused"


def moe_rows(config: Mapping[str, Any], layer: str, block: str, fused: bool) -> tables.Table:
    """One layer's mixture rows (router, experts per expert or fused, gated shared expert)
    under its Hugging Face prefix ``layer`` and our ``block``."""
    rows = tables.prefixed(ROUTER_RULES, layer, block)
    if fused:
        rows += tables.prefixed(FUSED_RULES, layer, block)
    else:
        rows += tables.experts(EXPERT_RULES, layer, block, config["num_experts"])
    return rows + tables.prefixed(SHARED_RULES, layer, block)


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """Qwen3.5's rows but for the dense MLP's, and each layer's mixture (per expert, or
    fused for a ``prefix`` ending in ``FUSED``), in the model's order."""
    fused, prefix = prefix.endswith(FUSED), prefix.removesuffix(FUSED)
    rows = [(prefix + r.hf, r) for r in qwen3_5.MODEL_RULES]
    for i, layer_type in enumerate(config["layer_types"]):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        rows += tables.prefixed(tables.NORM_RULES, layer, block)
        rows += moe_rows(config, layer, block, fused)
        rows += tables.prefixed(qwen3_5.LAYER_RULES[layer_type], layer, block)
    return rows


def moe_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """``layers.MoE``'s options of a normalised config."""
    return dict(
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        hidden=config["moe_intermediate_size"],
        normalize=True,
        shared_hidden=config["shared_expert_intermediate_size"],
        shared_gate=True,
    )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5's options, every MLP a ``MoE``."""
    dense = dict(config, intermediate_size=config["moe_intermediate_size"])
    return qwen3_5.options(dense) | dict(mlp="moe", moe=moe_options(config))


# The mixture's sizes, checked after Qwen3.5's (whose dense width this type lacks).
MOE_STEPS = (
    common.defaults(MOE_DEFAULTS, keep_none=True),
    common.ints(MOE_FIELDS),
    common.at_most("num_experts_per_tok", "num_experts"),
)

FORMAT = qwen3_5.FORMAT.derive(
    name="Qwen3.5-MoE",
    model_types=MODEL_TYPES,
    architecture="Qwen3_5MoeForCausalLM",
    steps=(
        qwen3_5.text_part("qwen3_5_moe", "qwen3_5_moe_text"),
        common.defaults(qwen3_5.DEFAULTS, keep_none=True),
        *qwen3_5.LAYOUT_STEPS,
        common.ints([f for f in qwen3_5.INT_FIELDS if f != "intermediate_size"]),
        qwen3_5.check_config,
        *MOE_STEPS,
    ),
    options=options,
    table=table,
    prefixes=qwen3_5.FORMAT.prefixes + tuple(p + FUSED for p in qwen3_5.FORMAT.prefixes),
)
