"""OLMo-Hybrid checkpoints in Hugging Face format (``OlmoHybridForCausalLM``, ``model_type``
``olmo_hybrid``) <-> ``LanguageModel``.

OLMo-Hybrid is dense: Gated DeltaNet layers (``"linear_attention"`` in ``layer_types``, our
``"gated_deltanet"``) and OLMo 3's softmax attention (``"full_attention"``, our
``"softmax"``), every layer with a SwiGLU MLP. Its conventions, each an option of ours:

* the Gated DeltaNet layers are pre-norm Llama blocks; the layer (``layers.
  DeltaRuleAttention``) has separate q, k, v, a, b and g projections, a short convolution
  with SiLU on q, k and v, L2-normalised q and k, ``beta = 2 sigmoid(b)`` with
  ``linear_allow_neg_eigval`` (``allow_negative_eigenvalues``), ``g = -exp(A_log)
  softplus(a + dt_bias)``, and the gated RMSNorm per value head with epsilon 1e-5 (FLA's);
* the attention layers are OLMo 2's post-norm blocks (``post_norm=True``: ``x +
  norm(attn(x))``, ``x + norm(mlp(x))``), with one RMSNorm over all of q's heads and one over
  all of k's (``qk_norm_over_heads``), GQA, no biases, and RoPE over the whole head, or none
  (NoPE) when ``rope_parameters`` has no ``rope_theta``, as the released checkpoints;
* every other RMSNorm's epsilon is ``rms_norm_eps``.

The weights, under ``model.layers.{i}.`` (ours under ``blocks.{i}.``), as ``transformers``
saves them (OLMo-core's names), or as it holds them in memory (in brackets; both are read):

========================================================  ===================================
Hugging Face                                              ours
========================================================  ===================================
``attention_layer_norm.weight`` [``input_layernorm``]     ``attention_norm.scale`` (DeltaNet)
``feedforward_layer_norm.weight``
[``post_attention_layernorm``]                            ``mlp_norm.scale`` (DeltaNet),
                                                          ``attention_norm.scale`` (softmax)
``post_feedforward_layernorm.weight``                     ``mlp_norm.scale`` (softmax)
``linear_attn.{q,k,v}_proj.weight``                       ``attention.{q,k,v}_proj.kernel``
``linear_attn.{q,k,v}_conv1d.weight`` ``[c, 1, K]``
[``linear_attn.conv1d.weight``, the three stacked;        ``attention.conv.kernel``
read too: ``transformers``' save in equal thirds]         ``[K, 2 h dk + hv dv]``
``linear_attn.a_proj.weight``, ``b_proj``, ``g_proj``     ``attention.gate.proj``,
                                                          ``beta_proj``, ``g_proj``
``linear_attn.A_log``, ``dt_bias``                        ``attention.gate.A_log``, ``dt_bias``
``linear_attn.o_norm.weight``, ``o_proj.weight``          ``attention.output_norm.scale``,
                                                          ``out_proj.kernel``
``self_attn.{q,k,v,o}_proj.weight``                       ``attention.{q,k,v,out}_proj.kernel``
``self_attn.q_norm.weight``, ``k_norm``                   ``attention.q_norm.scale``, ``k_norm``
``mlp.{gate,up,down}_proj.weight``                        ``mlp.{gate,up,down}_proj.kernel``
========================================================  ===================================

with ``model.embed_tokens.weight``, ``model.norm.weight`` and (untied) ``lm_head.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR
from linattn_jax.layers.delta import DeltaRuleAttention

MODEL_TYPES = ("olmo_hybrid",)
PREFIX = "model."
MEMORY = "#memory"  # a prefix ending so names the in-memory names' table
THIRDS = "#thirds"  # ... the table of the conv saved in equal thirds (transformers' save)
LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "softmax"}
OUTPUT_NORM_EPS = 1e-5  # the Gated DeltaNet's o_norm (transformers fixes it)
# transformers' OlmoHybridConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=30, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)  # fmt: skip

MODEL_RULES, MLP_RULES = tables.MODEL_RULES, tables.MLP_RULES
DELTA_RULES = tables.rules(
    ("linear_attn.q_proj.weight", "attention.q_proj.kernel", LINEAR),
    ("linear_attn.k_proj.weight", "attention.k_proj.kernel", LINEAR),
    ("linear_attn.v_proj.weight", "attention.v_proj.kernel", LINEAR),
    ("linear_attn.a_proj.weight", "attention.gate.proj.kernel", LINEAR),
    ("linear_attn.b_proj.weight", "attention.beta_proj.kernel", LINEAR),
    ("linear_attn.g_proj.weight", "attention.g_proj.kernel", LINEAR),
    ("linear_attn.A_log", "attention.gate.A_log", COPY),
    ("linear_attn.dt_bias", "attention.gate.dt_bias", COPY),
    ("linear_attn.o_norm.weight", "attention.output_norm.scale", COPY),
    ("linear_attn.o_proj.weight", "attention.out_proj.kernel", LINEAR),
)
SOFTMAX_RULES = tables.ATTENTION_RULES + tables.QK_NORM_RULES
# (saved name, in-memory name) of each block norm: ours by the layer's type
NORMS = {
    "linear_attention": (
        ("attention_layer_norm.weight", "input_layernorm.weight", "attention_norm.scale"),
        ("feedforward_layer_norm.weight", "post_attention_layernorm.weight", "mlp_norm.scale"),
    ),
    "full_attention": (
        ("feedforward_layer_norm.weight", "post_attention_layernorm.weight",
         "attention_norm.scale"),
        ("post_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
         "mlp_norm.scale"),
    ),
}  # fmt: skip


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """Every tensor, in the model's order: the saved names, or the in-memory ones for a
    ``prefix`` ending in ``MEMORY``; the q, k and v convs cut at the true key and value
    widths (written), or in ``transformers``' equal thirds for a ``prefix`` ending in
    ``THIRDS`` (its save of unequal widths; read, as it reads either by joining them)."""
    memory, prefix = prefix.endswith(MEMORY), prefix.removesuffix(MEMORY)
    thirds, prefix = prefix.endswith(THIRDS), prefix.removesuffix(THIRDS)
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = "attention.conv.kernel"
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i, layer_type in enumerate(config["layer_types"]):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        norms = tables.rules(
            *((m if memory else s, ours, COPY) for s, m, ours in NORMS[layer_type])
        )
        rows += tables.prefixed(norms, layer, block)
        if layer_type == "full_attention":
            rows += tables.prefixed(SOFTMAX_RULES, layer, block)
        else:
            rows += tables.prefixed(DELTA_RULES, layer, block)
            if memory:
                fused = tables.rules(("linear_attn.conv1d.weight", conv, CONV))
                rows += tables.prefixed(fused, layer, block)
            else:
                cuts = {"q": (0, key), "k": (key, 2 * key), "v": (2 * key, 2 * key + value)}
                if thirds:  # torch.chunk's: the first two ceil(c / 3) wide
                    third = -(-(2 * key + value) // 3)
                    cuts = {"q": (0, third), "k": (third, 2 * third), "v": (2 * third, None)}
                for part, (start, stop) in cuts.items():
                    rule = tables.rules((f"linear_attn.{part}_conv1d.weight", conv, CONV))
                    index = (slice(None), slice(start, stop))
                    rows += tables.prefixed(rule, layer, block, index)
        rows += tables.prefixed(MLP_RULES, layer, block)
    return rows


def sizes(config: common.Config) -> None:
    """The heads' counts (``num_attention_heads``) and widths (keys ``0.75 * hidden_size``
    over the key heads, values twice the keys) where null, as ``transformers`` derives
    them."""
    heads = config.get("num_attention_heads")
    for field in ("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        if config.get(field) is None:
            config[field] = heads
    if config.get("linear_key_head_dim") is None and common.is_int(config.get("hidden_size")):
        if common.is_int(config["linear_num_key_heads"]) and config["linear_num_key_heads"] > 0:
            hidden = config["hidden_size"]
            config["linear_key_head_dim"] = int(0.75 * hidden / config["linear_num_key_heads"])
    if config.get("linear_value_head_dim") is None and common.is_int(
        config.get("linear_key_head_dim")
    ):
        config["linear_value_head_dim"] = 2 * config["linear_key_head_dim"]


def layers(config: common.Config) -> None:
    """``layer_types`` (``transformers``' default: full every fourth layer, the last one at
    least) checked."""
    n = config["num_hidden_layers"]
    if config.get("layer_types") is None:
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        config["layer_types"] = types
    common.check_layer_types(config, LAYER_KINDS)


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Gated DeltaNet and post-normed softmax attention (QK-norm over all heads) by
    ``layer_types``, each with a SwiGLU MLP."""
    heads = config["num_attention_heads"]
    theta = config["rope_parameters"]["rope_theta"]
    rope = dict(rope=False) if theta is None else dict(rope=True, rope_theta=float(theta))
    return dict(
        num_heads=heads,
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options={
            "gated_deltanet": dict(
                num_heads=config["linear_num_key_heads"],
                num_v_heads=config["linear_num_value_heads"],
                head_dim=config["linear_key_head_dim"],
                value_head_dim=config["linear_value_head_dim"],
                conv_size=config["linear_conv_kernel_dim"],
                allow_negative_eigenvalues=config["linear_allow_neg_eigval"],
            ),
            "softmax": dict(
                num_kv_heads=config["num_key_value_heads"],
                head_dim=config["hidden_size"] // heads,
                qk_norm=True,
                qk_norm_over_heads=True,
                post_norm=True,
                **rope,
            ),
        },
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
    )


def finish(model, config: Mapping[str, Any]) -> None:
    """Every RMSNorm's epsilon ``rms_norm_eps``, the Gated DeltaNet's gated norm's 1e-5."""
    eps = float(config["rms_norm_eps"])
    model.norm.epsilon = eps
    for block in model.blocks:
        block.attention_norm.epsilon = block.mlp_norm.epsilon = eps
        a = block.attention
        if isinstance(a, DeltaRuleAttention):
            a.output_norm.epsilon = OUTPUT_NORM_EPS
        else:
            a.q_norm.epsilon = a.k_norm.epsilon = eps


FORMAT = common.ModelFormat(
    name="OLMo-Hybrid",
    model_types=MODEL_TYPES,
    architecture="OlmoHybridForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        sizes,
        common.ints(INT_FIELDS),
        common.divides("num_key_value_heads", "num_attention_heads"),
        common.divides("num_attention_heads", "hidden_size"),
        common.divides("linear_num_key_heads", "linear_num_value_heads"),
        layers,
        common.unsupported({"hidden_act": "silu", "attention_bias": False}),
        common.bools(("tie_word_embeddings", "linear_allow_neg_eigval")),
        common.numbers(("rms_norm_eps",)),
        common.plain_rope(None, allow_null=True),
    ),
    options=options,
    table=table,
    prefixes=(PREFIX, PREFIX + MEMORY, PREFIX + THIRDS),
    finish=finish,
)
