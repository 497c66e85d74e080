"""Qwen4-Exp text models in Hugging Face format <-> ``LanguageModel``.

``qwen4_exp_text`` (``Qwen4ExpForCausalLM``), or the text part of ``qwen4_exp``
(``Qwen4ExpForConditionalGeneration``), is Qwen3.5-MoE (``hf.qwen3_5_moe``: its Gated
DeltaNet, mixtures, zero-centred norms) whose residual stream is ``hc_count`` streams
(hyper-connections, ``layers.hyper``): each layer's two pre-norms
(``input_layernorm``, ``post_attention_layernorm``) are ``attn_hyper_connection`` and
``mlp_hyper_connection``, reading the mixer's and the MLP's input from the streams and
writing their outputs back; the final norm is ``hyper_connection_mixer``, a read-out.
Their rows, under ``layers.{i}.{attn,mlp}_hyper_connection.`` (our ``blocks.{i}.
{attention,mlp}_norm.``) and ``hyper_connection_mixer.`` (our ``norm.``):

* ``hc_norm.weight`` ``[n d]``: the streams' zero-centred RMSNorm (each stream's ``d``
  features normalised alone, ``rms_norm_eps``), our ``norm.scale``;
* ``input_mix_weight_down.weight`` ``[hc_lowrank, n d]``, ``input_mix_weight_up.weight``
  ``[n d, hc_lowrank]`` and (not the read-out's) ``block_inject_weight.weight``
  ``[n, n d]``: our ``down``, ``up`` and ``inject`` kernels (transposed).

The Gated DeltaNet's output gate is ``output_gate_type`` (``"silu"`` or ``"sigmoid"``;
null: ``hidden_act``), the routers renormalise their top-k by ``norm_topk_prob``.
Qwen4-Exp's attention layers carry the QSA indexer and its PLE layers hashed n-gram
embeddings, neither a block here: configs with either are refused by name
(``hf.unsupported``), so a Qwen4-Exp that loads has Gated DeltaNet layers only (which
``transformers`` runs without a cache: its cache needs an attention layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, qwen3_5, qwen3_5_moe, tables, unsupported
from linattn_jax.hf.tables import COPY, LINEAR, rules

MODEL_TYPES = unsupported.QWEN4_EXP[::-1]  # qwen4_exp_text, qwen4_exp
# transformers' defaults (Qwen4ExpTextConfig) of the fields Qwen3.5-MoE lacks or sets
# otherwise.
DEFAULTS = dict(
    hc_count=4, hc_lowrank=320, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
    output_gate_type=None,
)  # fmt: skip
GATE_TYPES = ("silu", "sigmoid")

READ_RULES = rules(
    ("hc_norm.weight", "norm.scale", COPY),
    ("input_mix_weight_down.weight", "down.kernel", LINEAR),
    ("input_mix_weight_up.weight", "up.kernel", LINEAR),
)
HYPER_RULES = READ_RULES + rules(("block_inject_weight.weight", "inject.kernel", LINEAR))
LAYER_HYPER_RULES = tables.under(
    HYPER_RULES, "attn_hyper_connection.", "attention_norm."
) + tables.under(HYPER_RULES, "mlp_hyper_connection.", "mlp_norm.")
MODEL_RULES = tables.MODEL_RULES[:1] + tables.under(READ_RULES, "hyper_connection_mixer.", "norm.")


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """The embedding and read-out rows, then each layer's hyper-connections, mixture (per
    expert, or fused for a ``prefix`` ending in ``qwen3_5_moe.FUSED``) and mixer."""
    fused, prefix = prefix.endswith(qwen3_5_moe.FUSED), prefix.removesuffix(qwen3_5_moe.FUSED)
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i, layer_type in enumerate(config["layer_types"]):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        rows += tables.prefixed(LAYER_HYPER_RULES, layer, block)
        rows += qwen3_5_moe.moe_rows(config, layer, block, fused)
        rows += tables.prefixed(qwen3_5.LAYER_RULES[layer_type], layer, block)
    return rows


def check_hyper(config: common.Config) -> None:
    """Checks the hyper-connections' sizes, ``norm_topk_prob`` and ``output_gate_type``."""
    common.check_ints(config, ("hc_count",), minimum=2)  # transformers: hc_count > 1
    common.check_ints(config, ("hc_lowrank",))
    common.check_bools(config, ("norm_topk_prob",))
    common.check_choice(config, "output_gate_type", (None, *GATE_TYPES))


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE's options with ``hyper_connections``, the Gated DeltaNet's output gate
    and ``norm_topk_prob``."""
    base = qwen3_5_moe.options(config)
    delta = dict(
        base["kind_options"]["gated_deltanet"],
        output_gate_activation=config["output_gate_type"] or config["hidden_act"],
    )
    return base | dict(
        kind_options=base["kind_options"] | dict(gated_deltanet=delta),
        moe=base["moe"] | dict(normalize=config["norm_topk_prob"]),
        hyper_connections=dict(streams=config["hc_count"], rank=config["hc_lowrank"]),
    )


FORMAT = qwen3_5_moe.FORMAT.derive(
    name="Qwen4-Exp",
    model_types=MODEL_TYPES,
    architecture="Qwen4ExpForCausalLM",
    steps=(
        unsupported.check,  # the QSA indexer and PLE, named
        qwen3_5.text_part("qwen4_exp", "qwen4_exp_text"),
        common.defaults(DEFAULTS, keep_none=("output_gate_type",)),
        *qwen3_5_moe.FORMAT.steps[1:],  # Qwen3.5-MoE's, from its defaults on
        check_hyper,
    ),
    options=options,
    table=table,
)
