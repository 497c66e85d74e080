"""Nemotron-H checkpoints in Hugging Face format (``NemotronHForCausalLM``, ``model_type``
``nemotron_h``), its dense layer types, <-> ``LanguageModel``: the config's fields as the
model's options, and the one table of weights.

Every Nemotron-H layer is ``x + mixer(RMSNorm(x))`` with one mixer per layer type
(``layers_block_type``, or the legacy ``hybrid_override_pattern`` string ``"M-M*-"``):

* ``"linear_attention"`` (``M``): a Mamba-2 mixer (``hf.mamba2``'s rows under ``mixer.``),
  our ``"mamba2"`` block with ``mlp="none"``; ``in_proj``/``out_proj`` biases are
  ``use_bias``, ``dt`` is clipped below at ``time_step_min`` (not ``time_step_limit``);
* ``"full_attention"`` (``*``): GQA softmax attention without positional encoding (no
  RoPE) and without biases, our ``"softmax"`` block with ``mlp="none"``;
* ``"mlp"`` (``-``): a squared-ReLU MLP (``up_proj``, ``down_proj``), our ``"mlp"`` block
  with ``mlp="relu2"`` (its norm is our ``mlp_norm``);
* ``"moe"`` (``E``): a mixture of squared-ReLU experts (``layers.MoE`` with
  ``activation="relu2"``: DeepSeek-V3's router, sigmoid scores, ``e_score_correction_bias``
  for the choice only, ``topk_group`` of ``n_group`` groups, ``norm_topk_prob``,
  ``routed_scaling_factor``) plus one shared squared-ReLU MLP of
  ``moe_shared_expert_intermediate_size``; our ``"mlp"`` block with ``mlp="moe"``. The
  experts are read per expert (``mixer.experts.{j}.``, as saved) or fused (``transformers``'
  memory layout); with ``moe_latent_size`` the experts run between ``fc1_latent_proj`` and
  ``fc2_latent_proj`` (``MoE(latent=...)``).

Every RMSNorm's epsilon is ``layer_norm_epsilon``. The tensors live under ``backbone.`` (as
``transformers`` saves them; ``model.``, its module names, is read too), ``lm_head.weight``
apart (untied only); multi-token-prediction heads (``mtp.``) are not read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, experts, mamba2, tables
from linattn_jax.hf.tables import COPY, EXPERTS_LINEAR, LINEAR, Rule

MODEL_TYPES = ("nemotron_h",)
LAYER_KINDS = {
    "linear_attention": "mamba2",
    "full_attention": "softmax",
    "mlp": "mlp",
    "moe": "mlp",
}
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}

MODEL_RULES = mamba2.MODEL_RULES
ATTENTION_RULES = tables.rules(
    ("norm.weight", "attention_norm.scale", COPY),
    ("mixer.q_proj.weight", "attention.q_proj.kernel", LINEAR),
    ("mixer.k_proj.weight", "attention.k_proj.kernel", LINEAR),
    ("mixer.v_proj.weight", "attention.v_proj.kernel", LINEAR),
    ("mixer.o_proj.weight", "attention.out_proj.kernel", LINEAR),
)
MLP_RULES = tables.rules(
    ("norm.weight", "mlp_norm.scale", COPY),
    ("mixer.up_proj.weight", "mlp.up_proj.kernel", LINEAR),
    ("mixer.down_proj.weight", "mlp.down_proj.kernel", LINEAR),
)

MOE_RULES = tables.rules(
    ("norm.weight", "mlp_norm.scale", COPY),
    ("mixer.gate.weight", "mlp.router", LINEAR),
    ("mixer.gate.e_score_correction_bias", "mlp.bias", COPY),
    ("mixer.shared_experts.up_proj.weight", "mlp.shared.up_proj.kernel", LINEAR),
    ("mixer.shared_experts.down_proj.weight", "mlp.shared.down_proj.kernel", LINEAR),
)
LATENT_RULES = tables.rules(
    ("mixer.fc1_latent_proj.weight", "mlp.latent_in.kernel", LINEAR),
    ("mixer.fc2_latent_proj.weight", "mlp.latent_out.kernel", LINEAR),
)
EXPERT_RULES = tables.rules(
    ("up_proj.weight", "mlp.up", LINEAR), ("down_proj.weight", "mlp.down", LINEAR)
)
# transformers' memory layout: [e, hidden, width] and [e, width, hidden], nn.Linear's each.
FUSED_EXPERT_RULES = tables.rules(
    ("mixer.experts.up_proj", "mlp.up", EXPERTS_LINEAR),
    ("mixer.experts.down_proj", "mlp.down", EXPERTS_LINEAR),
)


def layer_rules(config: Mapping[str, Any], i: int, fused: bool = False) -> tuple[Rule, ...]:
    """Layer ``i``'s rows, by its type: Mamba-2's, attention's, the MLP's or the mixture's
    (its experts per expert, or ``fused``)."""
    layer_type = config["layers_block_type"][i]
    if layer_type == "linear_attention":
        return mamba2.BLOCK_RULES + mamba2.mixer_rules(
            "mixer.", conv_bias=config["use_conv_bias"], bias=config["use_bias"]
        )
    if layer_type == "moe":
        rules = MOE_RULES + (LATENT_RULES if config["moe_latent_size"] is not None else ())
        if fused:
            return rules + FUSED_EXPERT_RULES
        n = config["n_routed_experts"]
        each = [
            r.at(f"mixer.experts.{j}.{r.hf}", r.ours, j) for j in range(n) for r in EXPERT_RULES
        ]
        return rules + tuple(each)
    return ATTENTION_RULES if layer_type == "full_attention" else MLP_RULES


# ---------------------------------------------------------------------------- the config

# transformers' NemotronHConfig defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    tie_word_embeddings=False, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    attention_bias=False, sliding_window=None, intermediate_size=21504, mlp_hidden_act="relu2",
    mlp_bias=False, ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64,
    mamba_hidden_act="silu", n_groups=8, conv_kernel=4, time_step_min=0.001, use_conv_bias=True,
    use_bias=False, layer_norm_epsilon=1e-5, n_routed_experts=8, moe_intermediate_size=7688,
    moe_shared_expert_intermediate_size=7688, moe_latent_size=None, num_experts_per_tok=2,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
)  # fmt: skip
# Old names transformers still reads.
LEGACY = dict(
    mamba_n_groups="n_groups",
    mamba_d_conv="conv_kernel",
    mamba_dt_min="time_step_min",
    mamba_conv_bias="use_conv_bias",
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups",
    "conv_kernel", "n_routed_experts", "moe_intermediate_size",
    "moe_shared_expert_intermediate_size", "num_experts_per_tok", "n_group", "topk_group",
)  # fmt: skip
SUPPORTED = dict(
    mamba_hidden_act="silu", mlp_hidden_act="relu2", attention_bias=False, mlp_bias=False
)


def legacy_names(config: common.Config) -> None:
    """Null fields left to their defaults; the legacy names read as ``transformers`` reads
    them; ``hybrid_override_pattern`` (``"M-M*-"``) as ``layers_block_type``, whose length
    is the depth."""
    for field in [k for k, v in config.items() if v is None and k in DEFAULTS]:
        del config[field]
    for old, new in LEGACY.items():
        if old in config:
            config[new] = config.pop(old)
    pattern = config.pop("hybrid_override_pattern", None)
    if config.get("layers_block_type") is None and isinstance(pattern, str):
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise ValueError(
                f"config.json: hybrid_override_pattern must use {sorted(PATTERN)}, got {unknown}"
            )
        config["layers_block_type"] = [PATTERN[c] for c in pattern]
    config.pop("num_hidden_layers", None)  # transformers: the length of layers_block_type


def check_layers(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless ``layers_block_type`` lists known layer types."""
    types = config.get("layers_block_type")
    if not isinstance(types, list) or not types:
        raise ValueError(
            f"config.json: layers_block_type must be a list of layer types, got {types!r}"
        )
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(
            f"config.json: layers_block_type must be in {sorted(LAYER_KINDS)}, got {unknown}"
        )


def check_rest(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming a field we do not support."""
    if config.get("sliding_window") is not None:
        raise ValueError(
            f"config.json: sliding_window must be null, got {config['sliding_window']!r}"
        )
    common.check_bools(config, ("use_conv_bias", "use_bias", "tie_word_embeddings"))
    low = config["time_step_min"]
    if not common.is_number(low) or low < 0:
        raise ValueError(f"config.json: time_step_min must be a number >= 0, got {low!r}")
    common.check_number(config, "layer_norm_epsilon", 0, 1)
    common.check_bools(config, ("norm_topk_prob",))
    if config["moe_latent_size"] is not None:
        common.check_ints(config, ("moe_latent_size",))
    common.check_positive(config, ("routed_scaling_factor",))
    common.check_divides(config, "n_group", "n_routed_experts")
    common.check_at_most(config, "topk_group", "n_group")
    common.check_at_most(config, "num_experts_per_tok", "n_routed_experts")


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """A block per layer type: a Mamba-2 mixer, attention without RoPE, a squared-ReLU MLP
    or a mixture of them; the depth is ``layers_block_type``'s length."""
    mixer = mamba2.mixer_options(
        head_dim=config["mamba_head_dim"],
        state_dim=config["ssm_state_size"],
        n_groups=config["n_groups"],
        conv_size=config["conv_kernel"],
        use_conv_bias=config["use_conv_bias"],
        use_bias=config["use_bias"],
        time_step_limit=(config["time_step_min"], math.inf),
        norm_eps=config["layer_norm_epsilon"],
    )
    return dict(
        depth=len(config["layers_block_type"]),
        num_heads=config["num_attention_heads"],
        attention=[LAYER_KINDS[t] for t in config["layers_block_type"]],
        kind_options={
            "mamba2": dict(num_heads=config["mamba_num_heads"], mlp="none", **mixer),
            "softmax": dict(
                num_heads=config["num_attention_heads"],
                num_kv_heads=config["num_key_value_heads"],
                head_dim=config["head_dim"],
                mlp="none",
            ),
        },
        mlp_hidden=config["intermediate_size"],
        **mixture(config),
    )


def mixture(config: Mapping[str, Any]) -> dict[str, Any]:
    """``mlp="relu2"``, or with ``"moe"`` layers each layer's MLP kind and ``moe``, the
    mixture's options."""
    types = config["layers_block_type"]
    if "moe" not in types:
        return dict(mlp="relu2")
    moe = dict(
        num_experts=config["n_routed_experts"], top_k=config["num_experts_per_tok"],
        hidden=config["moe_intermediate_size"], score="sigmoid",
        normalize=config["norm_topk_prob"], scaling=float(config["routed_scaling_factor"]),
        score_bias=True, num_groups=config["n_group"], top_k_groups=config["topk_group"],
        shared_hidden=config["moe_shared_expert_intermediate_size"], activation="relu2",
        latent=config["moe_latent_size"] or 0,
    )  # fmt: skip
    return dict(mlp=["moe" if t == "moe" else "relu2" for t in types], moe=moe)


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """Mamba-2's table over ``layers_block_type``'s layers (the experts fused for a
    ``prefix`` ending in ``experts.FUSED``)."""
    fused, prefix = prefix.endswith(experts.FUSED), prefix.removesuffix(experts.FUSED)
    depth = dict(config, num_hidden_layers=len(config["layers_block_type"]))
    rules = lambda config, i: layer_rules(config, i, fused)
    return tables.layered(MODEL_RULES, rules)(depth, prefix)


FORMAT = mamba2.FORMAT.derive(
    name="Nemotron-H",
    model_types=MODEL_TYPES,
    architecture="NemotronHForCausalLM",
    steps=(
        legacy_names,
        common.defaults(DEFAULTS),
        common.ints(INT_FIELDS),
        check_layers,
        common.divides("n_groups", "mamba_num_heads"),
        common.divides("num_key_value_heads", "num_attention_heads"),
        common.unsupported(SUPPORTED),
        check_rest,
    ),
    options=options,
    table=table,
    # as transformers writes it; it reads "model." too, and holds the experts fused
    prefixes=(mamba2.PREFIX, "model.", "model." + experts.FUSED),
    ignored=lambda config: ("mtp.",),
    ties_head=False,  # NemotronHForCausalLM ties nothing, whatever the config says
)
