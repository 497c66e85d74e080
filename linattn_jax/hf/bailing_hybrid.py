"""Bailing-hybrid checkpoints (``BailingHybridForCausalLM``, ``model_type``
``bailing_hybrid``: inclusionAI's Ling 3) <-> ``LanguageModel``.

Ling 3 is Kimi Linear's hybrid (``hf.kimi_linear``: KDA and MLA layers by ``layer_types``,
by default MLA every ``layer_group_size``-th; a dense SwiGLU on the first
``first_k_dense_replace`` layers, DeepSeek's grouped sigmoid mixture after, with
``num_shared_experts`` as one shared SwiGLU; the output head never tied) with these
differences, each an option of ours:

* KDA's forget gate is one matrix ``f_proj`` (``gate_rank=0``) and, with
  ``kda_safe_gate`` (the default), bounded: ``kda_lower_bound * sigmoid(exp(A_log) (f_proj
  x + dt_bias))`` (``gate_lower_bound``); its output gate ``g_proj`` is one matrix, its
  gated norm ``RMSNorm(o) * sigmoid(g_proj x)``; its heads and head width are
  ``linear_num_heads`` and ``linear_head_dim`` (else ``num_attention_heads`` and
  ``head_dim``);
* MLA has RoPE on ``qk_rope_head_dim`` channels of interleaved pairs (``hf.deepseek_v3``'s
  reading) and each head's output times ``sigmoid(g_proj x)`` (``head_gate``);
* the experts' SwiGLU clipping (``expert_swiglu_limit_list``,
  ``share_expert_swiglu_limit_list``) is not modelled: only zero limits (none) load.

The tensors are named as Ling's checkpoints name them, which ``transformers`` writes:
``model.word_embeddings``, each layer's mixer under ``attention.`` (``dense`` its output
projection; KDA's ``f_proj``, ``A_log``, ``dt_bias`` there; its ``q_conv1d``, ``k_conv1d``,
``v_conv1d`` channel ranges of our one conv), the router's ``mlp.gate.expert_bias`` and the
experts per expert (``mlp.experts.{j}.{gate,up,down}_proj``); or as ``transformers`` holds
them in memory (``RENAMES``, one stacked ``conv1d``, the experts fused). The
multi-token-prediction layers after ``num_hidden_layers`` are not read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, deepseek_v3, kimi_linear, rope, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR, Rule, rules

MODEL_TYPES = ("bailing_hybrid",)
# transformers' BailingHybridConfig defaults, in its config.json names.
DEFAULTS = dict(
    vocab_size=157184, hidden_size=2560, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=42, num_attention_heads=32, num_experts=512, num_experts_per_token=8,
    num_shared_experts=1, num_expert_group=8, topk_group=4, routed_scaling_factor=2.5,
    moe_renormalize=True, first_k_dense_replace=2, hidden_act="silu", model_max_length=262144,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    head_dim=128, short_conv_kernel_size=4, layer_group_size=6, kda_safe_gate=True,
    kda_lower_bound=-5.0, num_nextn_predict_layers=1,
)  # fmt: skip
# transformers' attribute_map beyond Kimi Linear's: the alias -> the name config.json holds.
ALIASES = dict(
    num_mtp_layers="num_nextn_predict_layers", swiglu_limits="expert_swiglu_limit_list",
    swiglu_limits_shared="share_expert_swiglu_limit_list",
)  # fmt: skip
LIMITS = ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list")

MODEL_RULES = rules(
    ("word_embeddings.weight", "embed.embedding", COPY),
    ("norm.weight", "norm.scale", COPY),
)
_a = "attention."
KDA_RULES = rules(
    ("attention.q_proj.weight", _a + "q_proj.kernel", LINEAR),
    ("attention.k_proj.weight", _a + "k_proj.kernel", LINEAR),
    ("attention.v_proj.weight", _a + "v_proj.kernel", LINEAR),
    ("attention.A_log", _a + "gate.A_log", COPY),
    ("attention.dt_bias", _a + "gate.dt_bias", COPY),
    ("attention.f_proj.weight", _a + "gate.proj.kernel", LINEAR),
    ("attention.b_proj.weight", _a + "beta_proj.kernel", LINEAR),
    ("attention.g_proj.weight", _a + "g_proj.kernel", LINEAR),
    ("attention.o_norm.weight", _a + "output_norm.scale", COPY),
    ("attention.dense.weight", _a + "out_proj.kernel", LINEAR),
)
HEAD_GATE_RULES = rules(("attention.g_proj.weight", _a + "g_proj.kernel", LINEAR))
ROUTER_RULES = rules(  # under mlp.
    ("gate.weight", "mlp.router", LINEAR),
    ("gate.expert_bias", "mlp.bias", COPY),
)


def mla_rules(config: Mapping[str, Any]) -> tuple[Rule, ...]:
    """DeepSeek-V3's MLA rows (interleaved rope rows) under Ling's names, and the head gate."""
    rename = lambda name: name.replace("self_attn.", _a).replace("o_proj.", "dense.")
    rows = deepseek_v3.attention_rules(dict(config, rope_interleave=True))
    return tuple(dataclasses.replace(r, hf=rename(r.hf)) for r in rows) + HEAD_GATE_RULES


saved_table = kimi_linear.hybrid_table(
    MODEL_RULES, KDA_RULES, "attention.{}_conv1d.weight", mla_rules, "mlp.", ROUTER_RULES,
    tables.EXPERT_RULES, "mlp.shared_experts.",
)  # fmt: skip
MEMORY = "#memory"  # a prefix ending so names the in-memory names' table
# transformers' renaming on load (its conversion_mapping), saved -> in memory
RENAMES = (
    (r"\.word_embeddings\.", ".embed_tokens."),
    (r"\.attention\.", ".self_attn."),
    (r"self_attn\.(f_proj|dt_bias|A_log)", r"self_attn.forget_gate.\1"),
    (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
    (r"\.mlp\.gate\.expert_bias", ".mlp.gate.e_score_correction_bias"),
)
_LAYER = re.compile(r"(.*layers\.(\d+)\.)(.*)")


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """Every tensor, in the model's order: the saved names, or for a ``prefix`` ending in
    ``MEMORY`` those ``transformers`` holds in memory (``RENAMES``; the q, k, v convs
    stacked in one ``conv1d``, the experts fused)."""
    if not prefix.endswith(MEMORY):
        return saved_table(config, prefix)
    rows = []
    for name, rule in saved_table(config, prefix.removesuffix(MEMORY)):
        m = _LAYER.match(name)
        layer, block, rest = (m[1], f"blocks.{m[2]}.", m[3]) if m else ("", "", name)
        if rest == "attention.q_conv1d.weight":
            fused = tables.rules(("self_attn.conv1d.weight", _a + "conv.kernel", CONV))
            rows += tables.prefixed(fused, layer, block)
        elif rest == "mlp.experts.0.gate_proj.weight":
            rows += tables.prefixed(tables.FUSED_EXPERT_RULES, layer, block)
        elif not rest.startswith(("attention.k_conv1d", "attention.v_conv1d", "mlp.experts.")):
            for pattern, replacement in RENAMES:
                name = re.sub(pattern, replacement, name)
            rows.append((name, rule.at(name, rule.ours)))
    return rows


# ---------------------------------------------------------------------------- the config


def aliases(config: common.Config) -> None:
    """The config in the names ``config.json`` holds (Kimi Linear's and ``ALIASES``)."""
    kimi_linear.aliases(config)
    for alias, name in ALIASES.items():
        if alias in config:
            config.setdefault(name, config.pop(alias))


def layers(config: common.Config) -> None:
    """The KDA sizes, ``layer_types`` and ``mlp_layer_types`` as ``transformers`` derives
    them (where absent), then Kimi Linear's checks of the layout and sizes."""
    config.setdefault("linear_head_dim", config["head_dim"])
    config.setdefault("linear_num_heads", config["num_attention_heads"])
    config.setdefault("linear_conv_kernel_dim", config["short_conv_kernel_size"])
    common.check_ints(config, ("num_hidden_layers", "layer_group_size"))
    n, group = config["num_hidden_layers"], config["layer_group_size"]
    if config.get("layer_types") is None:
        config["layer_types"] = [
            "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)
        ]
    kimi_linear.layers(config)
    common.check_ints(config, ("num_nextn_predict_layers",), minimum=0)


def check(config: common.Config) -> None:
    """Kimi Linear's checks, the bounded gate's and RoPE's fields, zero SwiGLU limits."""
    # transformers' MLA reads no num_key_value_heads (its default, 32, is in the files)
    kimi_linear.check_rest(dict(config, num_key_value_heads=config["num_attention_heads"]))
    common.check_bools(config, ("kda_safe_gate",))
    bound = config["kda_lower_bound"]
    if config["kda_safe_gate"] and not (common.is_number(bound) and bound < 0):
        raise ValueError(f"config.json: kda_lower_bound must be a number < 0, got {bound!r}")
    if config["qk_rope_head_dim"] % 2:
        raise ValueError(
            f"config.json: qk_rope_head_dim must be even, got {config['qk_rope_head_dim']}"
        )
    for field in LIMITS:
        limits = config.get(field)
        if limits is not None and any(x != 0 for x in limits):
            raise ValueError(
                f"config.json: {field} must be all zero (the clipped SwiGLU is not modelled), "
                f"got {limits!r}"
            )
    config["max_position_embeddings"] = config["model_max_length"]  # rope.parameters reads it


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Kimi Linear's options, KDA's gates full-rank (bounded with ``kda_safe_gate``), MLA
    with interleaved RoPE and a head gate."""
    dk = config["linear_head_dim"]
    kimi = kimi_linear.options(config)
    kda = dict(
        kimi["kind_options"]["kda"], gate_rank=0, output_gate_rank=None,
        gate_lower_bound=float(config["kda_lower_bound"]) if config["kda_safe_gate"] else None,
        head_dim=dk, value_head_dim=dk,
    )  # fmt: skip
    mla = dict(deepseek_v3.mla_options(config), head_gate=True)
    return kimi | dict(kind_options=dict(kda=kda, mla=mla))


def mtp(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The multi-token-prediction layers' names (not read)."""
    n = config["num_hidden_layers"]
    return tuple(f"model.layers.{n + k}." for k in range(config["num_nextn_predict_layers"]))


FORMAT = kimi_linear.FORMAT.derive(
    name="Bailing-hybrid",
    model_types=MODEL_TYPES,
    architecture="BailingHybridForCausalLM",
    steps=(
        aliases,
        common.defaults(DEFAULTS, keep_none=("q_lora_rank",)),
        layers,
        check,
        rope.parameters(6e6),
    ),
    options=options,
    table=table,
    prefixes=("model.", "model." + MEMORY),
    ignored=mtp,
)
