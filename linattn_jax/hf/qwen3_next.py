"""Qwen3-Next in Hugging Face format <-> ``LanguageModel``.

``qwen3_next`` (``Qwen3NextForCausalLM``) is Qwen3.5's hybrid (``hf.qwen3_5``: gated
attention, Gated DeltaNet, zero-centred norms, partial RoPE) with two differences:

* the Gated DeltaNet's projections are fused per key-head group: ``in_proj_qkvz`` holds,
  for each of the ``linear_num_key_heads`` groups in turn, ``[q_g | k_g | v_g | z_g]`` (the
  group's ``r = linear_num_value_heads / linear_num_key_heads`` value heads in ``v_g`` and
  ``z_g``), and ``in_proj_ba`` holds ``[b_g | a_g]`` (``r`` each): split into our
  ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``, ``beta_proj`` and ``gate.proj``;
* a layer's MLP is a mixture of experts (``hf.qwen3_5_moe``'s weights: router, experts per
  expert or fused, gated shared expert; ``norm_topk_prob`` renormalises the top-k weights)
  when its index is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``,
  else a dense SwiGLU of ``intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, qwen3_5, qwen3_5_moe, tables
from linattn_jax.hf.tables import rules

MODEL_TYPES = ("qwen3_next",)
# transformers' defaults (Qwen3NextConfig) of the fields Qwen3.5 lacks.
NEXT_DEFAULTS = dict(
    intermediate_size=5632, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, decoder_sparse_step=1, norm_topk_prob=True,
)  # fmt: skip
# Qwen3.5's Gated DeltaNet projections that Qwen3-Next fuses per key-head group.
FUSED_AWAY = tuple(f"linear_attn.in_proj_{p}." for p in ("qkv", "z", "b", "a"))


def grouped_rules(config: Mapping[str, Any]) -> tuple[tables.Rule, ...]:
    """The Gated DeltaNet's two fused projections, grouped by key head."""
    groups = tables.grouped(config["linear_num_key_heads"])
    a = "attention."
    return rules(
        (
            "linear_attn.in_proj_qkvz.weight",
            [a + p for p in ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel", "g_proj.kernel")],
            groups,
        ),
        ("linear_attn.in_proj_ba.weight", (a + "beta_proj.kernel", a + "gate.proj.kernel"), groups),
    )


def mlp_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's MLP: ``"moe"`` or ``"swiglu"``, as ``transformers`` chooses."""
    step, dense = config["decoder_sparse_step"], set(config["mlp_only_layers"])
    return [
        "moe" if i not in dense and (i + 1) % step == 0 else "swiglu"
        for i in range(config["num_hidden_layers"])
    ]


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """Every tensor, in the model's order: Qwen3.5's rows with the Gated DeltaNet's grouped
    projections, and the MoE layers' mixtures (per expert, or fused for a ``prefix`` ending
    in ``qwen3_5_moe.FUSED``)."""
    fused, prefix = prefix.endswith(qwen3_5_moe.FUSED), prefix.removesuffix(qwen3_5_moe.FUSED)
    rows = [(prefix + r.hf, r) for r in qwen3_5.MODEL_RULES]
    for i, (layer_type, mlp) in enumerate(
        zip(config["layer_types"], mlp_types(config), strict=True)
    ):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        rows += tables.prefixed(tables.NORM_RULES, layer, block)
        if mlp == "moe":
            rows += qwen3_5_moe.moe_rows(config, layer, block, fused)
        else:
            rows += tables.prefixed(tables.MLP_RULES, layer, block)
        own = qwen3_5.LAYER_RULES[layer_type]
        if layer_type == "linear_attention":
            kept = tuple(r for r in own if not r.hf.startswith(FUSED_AWAY))
            own = grouped_rules(config) + kept
        rows += tables.prefixed(own, layer, block)
    return rows


def drop_nulls(config: common.Config) -> None:
    """A null field is as good as absent (``transformers`` fills in its default)."""
    for field in [k for k, v in config.items() if v is None]:
        del config[field]


def check_moe(config: common.Config) -> None:
    """Checks the mixture's fields and reads ``mlp_only_layers`` (none: ``[]``)."""
    common.check_ints(config, [f for f in NEXT_DEFAULTS if f != "norm_topk_prob"])
    common.check_bools(config, ("norm_topk_prob",))
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(common.is_int(i) for i in dense):
        raise ValueError(f"config.json: mlp_only_layers must be a list of ints, got {dense!r}")
    config["mlp_only_layers"] = list(dense)
    common.check_at_most(config, "num_experts_per_tok", "num_experts")


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5's options, with ``mlp_types`` (the mixtures' top-k weights renormalised by
    ``norm_topk_prob``)."""
    moe = qwen3_5_moe.moe_options(config) | dict(normalize=config["norm_topk_prob"])
    return qwen3_5.options(config) | dict(mlp=mlp_types(config), moe=moe)


FORMAT = qwen3_5_moe.FORMAT.derive(
    name="Qwen3-Next",
    model_types=MODEL_TYPES,
    architecture="Qwen3NextForCausalLM",
    steps=(
        drop_nulls,
        common.defaults(NEXT_DEFAULTS),
        *qwen3_5.FORMAT.steps[1:],  # Qwen3.5's, from its defaults on
        check_moe,
    ),
    options=options,
    table=table,
    prefixes=("model.", "model." + qwen3_5_moe.FUSED),
    ignored=lambda config: ("mtp.",),
)
