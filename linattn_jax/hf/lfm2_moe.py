"""LFM2-MoE checkpoints (``Lfm2MoeForCausalLM``, ``model_type`` ``lfm2_moe``): LFM2
(``hf.lfm2``: its gated short convolutions and QK-normed attention by ``layer_types``,
which must be given) whose MLPs past the first ``num_dense_layers`` are mixtures of SwiGLU
experts (``layers.MoE``).

The first layers' SwiGLU is ``intermediate_size`` wide (no ``block_auto_adjust_ff_dim``
rule here); a mixture has ``num_experts`` experts of ``moe_intermediate_size``, chosen
``num_experts_per_tok`` per token on ``sigmoid(router logits)`` plus ``expert_bias`` (with
``use_expert_bias``: our ``score_bias``, for the choice only), weighted by their sigmoid
scores, over their sum plus 1e-6 with ``norm_topk_prob`` (our ``normalize_eps``) and times
``routed_scaling_factor``.
The file holds each expert's ``w1``, ``w3``, ``w2`` under ``feed_forward.experts.{j}.``,
the router as ``feed_forward.gate.weight``; ``transformers``' memory layout (the experts
fused: ``feed_forward.experts.gate_up_proj``, ``down_proj``) is read too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, experts, lfm2, rope, tables
from linattn_jax.hf.tables import COPY, LINEAR

# transformers' Lfm2MoeConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=128_000, norm_eps=1e-5, tie_word_embeddings=True, conv_bias=False,
    conv_L_cache=3, num_dense_layers=2, num_experts_per_tok=4, num_experts=32,
    use_expert_bias=True, routed_scaling_factor=1.0, norm_topk_prob=True,
)  # fmt: skip

ROUTER_RULES = tables.rules(("feed_forward.gate.weight", "mlp.router", LINEAR))
BIAS_RULES = tables.rules(("feed_forward.expert_bias", "mlp.bias", COPY))
EXPERT_RULES = tables.rules(  # under feed_forward.experts.{j}., slice j of ours
    ("w1.weight", "mlp.gate", LINEAR),
    ("w3.weight", "mlp.up", LINEAR),
    ("w2.weight", "mlp.down", LINEAR),
)
FUSED_RULES = tables.rules(
    ("feed_forward.experts.gate_up_proj", ("mlp.gate", "mlp.up"), tables.EXPERTS_GATE_UP),
    ("feed_forward.experts.down_proj", "mlp.down", tables.EXPERTS_LINEAR),
)


def is_moe(config: Mapping[str, Any], i: int) -> bool:
    return i >= config["num_dense_layers"]


def mlp_rules(config: Mapping[str, Any], i: int, fused: bool) -> tuple[tables.Rule, ...]:
    """Layer ``i``'s MLP rows: LFM2's SwiGLU, or the router (and bias) and each expert's
    (``fused``: all experts' in two tensors)."""
    if not is_moe(config, i):
        return lfm2.MLP_RULES
    rows = ROUTER_RULES + (BIAS_RULES if config["use_expert_bias"] else ())
    if fused:
        return rows + FUSED_RULES
    return rows + tuple(
        r.at(f"feed_forward.experts.{j}.{r.hf}", r.ours, j)
        for j in range(config["num_experts"])
        for r in EXPERT_RULES
    )


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """LFM2's table with ``mlp_rules``' MLPs, the experts fused for a ``prefix`` ending in
    ``experts.FUSED``."""
    fused, prefix = prefix.endswith(experts.FUSED), prefix.removesuffix(experts.FUSED)
    return lfm2.table(lambda config, i: mlp_rules(config, i, fused))(config, prefix)


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """LFM2's layers, the MLPs from ``num_dense_layers`` on mixtures."""
    moe = dict(
        num_experts=config["num_experts"], top_k=config["num_experts_per_tok"],
        hidden=config["moe_intermediate_size"], score="sigmoid",
        normalize=config["norm_topk_prob"], normalize_eps=1e-6,
        scaling=float(config["routed_scaling_factor"]),
        score_bias=config["use_expert_bias"],
    )  # fmt: skip
    layers = range(config["num_hidden_layers"])
    mlp = experts.layout([is_moe(config, i) for i in layers])
    return lfm2.mixer_options(config) | dict(mlp=mlp, moe=moe)


FORMAT = lfm2.FORMAT.derive(
    name="LFM2-MoE",
    model_types=("lfm2_moe",),
    architecture="Lfm2MoeForCausalLM",
    steps=(
        lfm2.legacy({"tie_embedding": "tie_word_embeddings"}),
        common.defaults(DEFAULTS),
        *lfm2.CHECKS,
        common.ints(("moe_intermediate_size", "num_experts", "num_experts_per_tok")),
        common.ints(("num_dense_layers",), minimum=0),
        common.at_most("num_experts_per_tok", "num_experts"),
        common.bools(("use_expert_bias", "norm_topk_prob")),
        common.positive(("routed_scaling_factor",)),
        lambda config: common.check_layer_types(config, tuple(lfm2.LAYER_KINDS)),
        rope.parameters(1_000_000.0),
    ),
    options=options,
    table=table,
    prefixes=("model.", "model." + experts.FUSED),
)
