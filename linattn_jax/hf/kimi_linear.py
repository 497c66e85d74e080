"""Kimi Linear in Hugging Face format <-> ``LanguageModel``.

``kimi_linear`` (``KimiLinearForCausalLM``, Moonshot's Kimi-Linear-48B-A3B) stacks KDA
layers and Multi-head Latent Attention layers (``layer_types``: ``"linear_attention"``,
``"full_attention"``; three to one in the published model), each followed by a dense
SwiGLU or a DeepSeek-style mixture of experts (``mlp_layer_types``: ``"dense"``,
``"sparse"``; the first layer dense). Its conventions, each mapped to an option of ours:

* KDA (``layers.DeltaRuleAttention``, ``variant="kda"``): ``q_proj``, ``k_proj``,
  ``v_proj``, one depthwise conv over ``[q | k | v]`` (no bias, SiLU), the forget gate
  ``-exp(A_log) softplus(f_b(f_a x) + dt_bias)`` per key channel (our ``MambaGate`` of rank
  ``linear_head_dim``; ``A_log`` stored ``[1, 1, h, 1]``), ``beta = sigmoid(b_proj x)``, q
  and k L2-normalised, the output ``RMSNorm(o) * sigmoid(g_b(g_a x))`` per head
  (``output_gate_rank=linear_head_dim``, ``output_gate_activation="sigmoid"``);
* MLA (``layers.LatentAttention``): ``q_proj`` (or ``q_a_proj``, ``q_a_layernorm``,
  ``q_b_proj`` with ``q_lora_rank``), ``kv_a_proj_with_mqa`` ``[latent | k_rope]``,
  ``kv_a_layernorm`` (epsilon 1e-6, not ``rms_norm_eps``), ``kv_b_proj`` ``[k_nope | v]``
  per head; no RoPE (Kimi's MLA is NoPE); scores scaled by ``(nope + rope)^-0.5``;
* the mixture (``layers.MoE``): sigmoid scores, ``e_score_correction_bias`` for the choice
  only (our ``RouterBias``), grouped top-k (``num_expert_group`` groups scored by their two
  best, ``topk_group`` kept), the top-k weights renormalised (``moe_renormalize``) and
  times ``routed_scaling_factor``, one shared SwiGLU of ``num_shared_experts *
  moe_intermediate_size``.

The tensors are named as Moonshot's checkpoints name them, which ``transformers`` reads
and writes: the forget gate's ``f_a_proj``, ``f_b_proj``, ``A_log`` ``[1, 1, h, 1]`` and
``dt_bias`` directly under ``self_attn``; ``q_conv1d``, ``k_conv1d`` and ``v_conv1d``
(channel ranges of our one conv); each expert ``j``'s ``experts.{j}.w1`` (gate), ``w3`` (up),
``w2`` (down) under ``block_sparse_moe``. ``config.json`` is read in ``transformers``' names
or its aliases (``ALIASES``), Moonshot's ``linear_attn_config`` and
``first_k_dense_replace`` folded in. The output head is always its own ``lm_head.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from linattn_jax.hf import common, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR, Rule, rules
from linattn_jax.layers.mla import LatentAttention

MODEL_TYPES = ("kimi_linear",)
LAYER_KINDS = {"linear_attention": "kda", "full_attention": "mla"}
MLP_KINDS = {"dense": "swiglu", "sparse": "moe"}
LATENT_NORM_EPS = 1e-6  # transformers' KimiLinearRMSNorm default, for q_a / kv_a norms
# transformers' defaults (KimiLinearConfig), in its config.json names.
DEFAULTS = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
    num_hidden_layers=27, num_attention_heads=32, num_shared_experts=1,
    routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, num_expert_group=1, topk_group=1,
    num_experts_per_token=8, moe_renormalize=True, hidden_act="silu", rms_norm_eps=1e-5,
    tie_word_embeddings=False, attention_bias=False, num_experts=256, linear_head_dim=128,
    linear_num_heads=32, linear_conv_kernel_dim=4,
)  # fmt: skip
# transformers' attribute_map: the alias -> the name config.json holds.
ALIASES = dict(
    num_local_experts="num_experts", num_experts_per_tok="num_experts_per_token",
    n_group="num_expert_group", norm_topk_prob="moe_renormalize",
    n_shared_experts="num_shared_experts", max_position_embeddings="model_max_length",
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_shared_experts",
    "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "num_expert_group",
    "topk_group", "num_experts_per_token", "num_experts", "linear_head_dim",
    "linear_num_heads", "linear_conv_kernel_dim",
)  # fmt: skip

MODEL_RULES, HEAD_RULE, NORM_RULES = tables.MODEL_RULES, tables.HEAD_RULE, tables.NORM_RULES
_a = "attention."
# The checkpoint's names are Moonshot's (transformers reads and writes them so).
KDA_RULES = rules(
    ("self_attn.q_proj.weight", _a + "q_proj.kernel", LINEAR),
    ("self_attn.k_proj.weight", _a + "k_proj.kernel", LINEAR),
    ("self_attn.v_proj.weight", _a + "v_proj.kernel", LINEAR),
    # A_log [1, 1, h, 1] <-> our [h]
    ("self_attn.A_log", _a + "gate.A_log", tables.reshaped(lambda h: (1, 1, h, 1), "a_log")),
    ("self_attn.dt_bias", _a + "gate.dt_bias", COPY),
    ("self_attn.f_a_proj.weight", _a + "gate.proj.layers.0.kernel", LINEAR),
    ("self_attn.f_b_proj.weight", _a + "gate.proj.layers.1.kernel", LINEAR),
    ("self_attn.b_proj.weight", _a + "beta_proj.kernel", LINEAR),
    ("self_attn.g_a_proj.weight", _a + "g_proj.layers.0.kernel", LINEAR),
    ("self_attn.g_b_proj.weight", _a + "g_proj.layers.1.kernel", LINEAR),
    ("self_attn.o_norm.weight", _a + "output_norm.scale", COPY),
    ("self_attn.o_proj.weight", _a + "out_proj.kernel", LINEAR),
)
CONV_RULE = Rule("", (_a + "conv.kernel",), CONV)  # q_, k_, v_conv1d: channel ranges
MLA_Q_RULES = rules(("self_attn.q_proj.weight", _a + "q_proj.kernel", LINEAR))
MLA_Q_LORA_RULES = rules(
    ("self_attn.q_a_proj.weight", _a + "q_a_proj.kernel", LINEAR),
    ("self_attn.q_a_layernorm.weight", _a + "q_a_norm.scale", COPY),
    ("self_attn.q_b_proj.weight", _a + "q_b_proj.kernel", LINEAR),
)
MLA_RULES = rules(
    ("self_attn.kv_a_proj_with_mqa.weight", _a + "kv_a_proj.kernel", LINEAR),
    ("self_attn.kv_a_layernorm.weight", _a + "kv_norm.scale", COPY),
    ("self_attn.kv_b_proj.weight", _a + "kv_b_proj.kernel", LINEAR),
    ("self_attn.o_proj.weight", _a + "out_proj.kernel", LINEAR),
)
MLP = "block_sparse_moe."
DENSE_RULES = tables.under(tables.SWIGLU_RULES, MLP, "mlp.")
SHARED_RULES = tables.under(tables.SWIGLU_RULES, MLP + "shared_experts.", "mlp.shared.")
ROUTER_RULES = rules(  # under the MLP's prefix
    ("gate.weight", "mlp.router", LINEAR),
    ("gate.e_score_correction_bias", "mlp.bias", COPY),
)
EXPERT_RULES = rules(  # under block_sparse_moe.experts.{j}., slice j
    ("w1.weight", "mlp.gate", LINEAR),
    ("w2.weight", "mlp.down", LINEAR),
    ("w3.weight", "mlp.up", LINEAR),
)


def hybrid_table(
    model_rules: tuple[Rule, ...],
    kda_rules: tuple[Rule, ...],
    conv: str,
    mla_rules: Callable[[Mapping[str, Any]], tuple[Rule, ...]],
    mlp: str,
    router_rules: tuple[Rule, ...],
    expert_rules: tuple[Rule, ...],
    shared: str,
) -> Callable[[Mapping[str, Any], str], tables.Table]:
    """The table of a KDA/MLA hybrid named as Kimi Linear's or a derived type's: the
    ``model_rules``, then each layer's norms, its mixer (``kda_rules`` and the q, k, v convs
    named ``conv.format(part)``, channel ranges of our one conv; or ``mla_rules(config)``)
    and its MLP under ``mlp`` (dense SwiGLU, or ``router_rules``, ``expert_rules`` under
    ``{mlp}experts.{j}.``, the shared SwiGLU under ``shared``), then its norms."""
    router = tables.under(router_rules, mlp, "")
    dense = tables.under(tables.SWIGLU_RULES, mlp, "mlp.")
    shared_rules = tables.under(tables.SWIGLU_RULES, shared, "mlp.shared.")

    def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
        rows = [(prefix + r.hf, r) for r in model_rules]
        c = config["linear_num_heads"] * config["linear_head_dim"]  # each of q, k, v
        types = zip(config["layer_types"], config["mlp_layer_types"], strict=True)
        for i, (layer, kind) in enumerate(types):
            hf_layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
            if layer == "linear_attention":
                rows += tables.prefixed(kda_rules, hf_layer, block)
                for j, part in enumerate("qkv"):
                    name = hf_layer + conv.format(part)
                    index = (slice(None), slice(j * c, (j + 1) * c))
                    rows.append((name, CONV_RULE.at(name, [block + CONV_RULE.ours[0]], index)))
            else:
                rows += tables.prefixed(mla_rules(config), hf_layer, block)
            if kind == "dense":
                rows += tables.prefixed(dense, hf_layer, block)
            else:
                rows += tables.prefixed(router, hf_layer, block)
                n = config["num_experts"]
                rows += tables.experts(expert_rules, hf_layer, block, n, f"{mlp}experts.")
                rows += tables.prefixed(shared_rules, hf_layer, block)
            rows += tables.prefixed(NORM_RULES, hf_layer, block)
        return rows

    return table


table = hybrid_table(
    MODEL_RULES, KDA_RULES, "self_attn.{}_conv1d.weight",
    lambda config: (MLA_Q_RULES if config["q_lora_rank"] is None else MLA_Q_LORA_RULES)
    + MLA_RULES,
    MLP, ROUTER_RULES, EXPERT_RULES, MLP + "shared_experts.",
)  # fmt: skip


# ---------------------------------------------------------------------------- the config


def aliases(config: common.Config) -> None:
    """The config in ``transformers``' names (``ALIASES`` renamed)."""
    for alias, name in ALIASES.items():
        if alias in config:
            value = config.pop(alias)
            config.setdefault(name, value)


def layers(config: common.Config) -> None:
    """Moonshot's ``linear_attn_config`` and ``first_k_dense_replace`` folded in as
    ``transformers`` folds them: the KDA sizes, ``layer_types`` (else every 4th layer from
    the 5th MLA) and ``mlp_layer_types`` (else the first dense), checked."""
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    linear = config.pop("linear_attn_config", None) or {}
    if not isinstance(linear, Mapping):
        raise ValueError(f"config.json: linear_attn_config must be a dict, got {linear!r}")
    for ours, theirs in (
        ("linear_head_dim", "head_dim"),
        ("linear_num_heads", "num_heads"),
        ("linear_conv_kernel_dim", "short_conv_kernel_size"),
    ):
        if theirs in linear:
            config[ours] = linear[theirs]
    common.check_ints(config, INT_FIELDS)
    n = config["num_hidden_layers"]
    if config.get("layer_types") is None:
        if "full_attn_layers" in linear and "kda_layers" in linear:
            types_ = [None] * n
            for kind, layers in (("full_attention", "full_attn_layers"),
                                 ("linear_attention", "kda_layers")):  # fmt: skip
                for j in linear[layers]:  # 1-indexed
                    if not common.is_int(j) or not 1 <= j <= n:
                        raise ValueError(f"config.json: linear_attn_config.{layers}: bad {j!r}")
                    types_[j - 1] = kind
            config["layer_types"] = types_
        else:
            config["layer_types"] = [
                "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)
            ]
    first_dense = config.pop("first_k_dense_replace", 1)
    if config.get("mlp_layer_types") is None:
        if not common.is_int(first_dense) or first_dense < 0:
            raise ValueError(
                f"config.json: first_k_dense_replace must be an int >= 0, got {first_dense!r}"
            )
        config["mlp_layer_types"] = ["dense" if i < first_dense else "sparse" for i in range(n)]
    for field, allowed in (("layer_types", LAYER_KINDS), ("mlp_layer_types", MLP_KINDS)):
        value = config[field]
        if not isinstance(value, list) or len(value) != n or not set(value) <= set(allowed):
            raise ValueError(
                f"config.json: {field} must list num_hidden_layers={n} of {sorted(allowed)}, "
                f"got {value!r}"
            )


def check_rest(config: common.Config) -> None:
    """Raises ``ValueError`` naming a field we do not support: MLA's, the mixture's."""
    q = config["q_lora_rank"]
    if q is not None and (not common.is_int(q) or q < 1):
        raise ValueError(f"config.json: q_lora_rank must be null or an int >= 1, got {q!r}")
    common.check_unsupported(
        config, {"hidden_act": "silu", "attention_bias": False, "pretraining_tp": 1}
    )
    if config["num_key_value_heads"] != config["num_attention_heads"]:
        raise ValueError(
            f"config.json: num_key_value_heads={config['num_key_value_heads']} must equal "
            f"num_attention_heads={config['num_attention_heads']} (MLA's heads all read one "
            "latent)"
        )
    common.check_divides(config, "num_expert_group", "num_experts")
    common.check_at_most(config, "topk_group", "num_expert_group")
    chosen = config["topk_group"] * config["num_experts"] // config["num_expert_group"]
    if config["num_experts_per_token"] > chosen:
        raise ValueError(
            f"config.json: num_experts_per_token={config['num_experts_per_token']} must be <= "
            f"the {chosen} experts of topk_group={config['topk_group']} groups"
        )
    common.check_bools(config, ("tie_word_embeddings", "moe_renormalize"))
    common.check_number(config, "rms_norm_eps", 0, 1)
    common.check_number(config, "routed_scaling_factor", 0, float("inf"))


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """KDA and MLA by ``layer_types``, SwiGLU and DeepSeek's mixture by
    ``mlp_layer_types``."""
    dk = config["linear_head_dim"]
    return dict(
        num_heads=config["num_attention_heads"],
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options={
            "kda": dict(
                num_heads=config["linear_num_heads"],
                head_dim=dk,
                value_head_dim=dk,
                conv_size=config["linear_conv_kernel_dim"],
                gate_rank=dk,
                output_gate_rank=dk,
                output_gate_activation="sigmoid",
            ),
            "mla": dict(
                num_heads=config["num_attention_heads"],
                kv_lora_rank=config["kv_lora_rank"],
                q_lora_rank=config["q_lora_rank"],
                qk_nope_head_dim=config["qk_nope_head_dim"],
                qk_rope_head_dim=config["qk_rope_head_dim"],
                v_head_dim=config["v_head_dim"],
                rope=False,
            ),
        },  # fmt: skip
        mlp=[MLP_KINDS[t] for t in config["mlp_layer_types"]],
        mlp_hidden=config["intermediate_size"],
        moe=dict(
            num_experts=config["num_experts"],
            top_k=config["num_experts_per_token"],
            hidden=config["moe_intermediate_size"],
            score="sigmoid",
            normalize=config["moe_renormalize"],
            scaling=float(config["routed_scaling_factor"]),
            score_bias=True,
            num_groups=config["num_expert_group"],
            top_k_groups=config["topk_group"],
            shared_hidden=config["num_shared_experts"] * config["moe_intermediate_size"],
        ),
    )


def finish(model, config: Mapping[str, Any]) -> None:
    """The blocks', the final and KDA's gated norms' epsilon ``rms_norm_eps``; MLA's
    latents' 1e-6."""
    latent = set()
    for _, node in nnx.iter_graph(model):
        if isinstance(node, LatentAttention):
            latent.update(id(n) for n in (node.kv_norm, node.q_a_norm) if n is not None)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.RMSNorm):
            node.epsilon = LATENT_NORM_EPS if id(node) in latent else float(config["rms_norm_eps"])


FORMAT = common.ModelFormat(
    name="Kimi Linear",
    model_types=MODEL_TYPES,
    architecture="KimiLinearForCausalLM",
    steps=(aliases, common.defaults(DEFAULTS), layers, check_rest),
    options=options,
    table=table,
    ties_head=False,  # KimiLinearForCausalLM ties nothing, whatever the config says
    finish=finish,
)
