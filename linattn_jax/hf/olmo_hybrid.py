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
[``linear_attn.conv1d.weight``, the three stacked]        ``attention.conv.kernel``
                                                          ``[K, 2 h dk + hv dv]``
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

import jax.numpy as jnp

from linattn_jax.hf import common
from linattn_jax.layers.delta import DeltaRuleAttention
from linattn_jax.layers.norms import GatedRMSNorm

MODEL_TYPES = ("olmo_hybrid",)
PREFIX = "model."
MEMORY = "#memory"  # a prefix ending so names the in-memory names' table
LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "softmax"}
OUTPUT_NORM_EPS = 1e-5  # the Gated DeltaNet's o_norm (transformers fixes it)
DEFAULTS = dict(
    vocab_size=100352,
    hidden_size=3840,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=30,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    linear_conv_kernel_dim=4,
    linear_allow_neg_eigval=True,
)  # transformers' OlmoHybridConfig defaults, for the fields a config.json leaves out
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)  # fmt: skip
UNCHECKED = ("architectures", "dtype", "torch_dtype", "transformers_version")

MODEL_RULES, HEAD_RULE = common.MODEL_RULES, common.HEAD_RULE
MLP_RULES = common.rules(
    ("mlp.gate_proj.weight", "mlp.gate_proj.kernel", "linear"),
    ("mlp.up_proj.weight", "mlp.up_proj.kernel", "linear"),
    ("mlp.down_proj.weight", "mlp.down_proj.kernel", "linear"),
)
DELTA_RULES = common.rules(
    ("linear_attn.q_proj.weight", "attention.q_proj.kernel", "linear"),
    ("linear_attn.k_proj.weight", "attention.k_proj.kernel", "linear"),
    ("linear_attn.v_proj.weight", "attention.v_proj.kernel", "linear"),
    ("linear_attn.a_proj.weight", "attention.gate.proj.kernel", "linear"),
    ("linear_attn.b_proj.weight", "attention.beta_proj.kernel", "linear"),
    ("linear_attn.g_proj.weight", "attention.g_proj.kernel", "linear"),
    ("linear_attn.A_log", "attention.gate.A_log", "copy"),
    ("linear_attn.dt_bias", "attention.gate.dt_bias", "copy"),
    ("linear_attn.o_norm.weight", "attention.output_norm.scale", "copy"),
    ("linear_attn.o_proj.weight", "attention.out_proj.kernel", "linear"),
)
SOFTMAX_RULES = common.ATTENTION_RULES + common.rules(
    ("self_attn.q_norm.weight", "attention.q_norm.scale", "copy"),
    ("self_attn.k_norm.weight", "attention.k_norm.scale", "copy"),
)
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


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, Any]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s), in the model's
    order: the saved names, or the in-memory ones for a ``prefix`` ending in ``MEMORY``."""
    memory, prefix = prefix.endswith(MEMORY), prefix.removesuffix(MEMORY)
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = "attention.conv.kernel"
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i, layer_type in enumerate(config["layer_types"]):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        norms = common.rules(
            *((m if memory else s, ours, "copy") for s, m, ours in NORMS[layer_type])
        )
        rows += common.prefixed(norms, layer, block)
        if layer_type == "full_attention":
            rows += common.prefixed(SOFTMAX_RULES, layer, block)
        else:
            rows += common.prefixed(DELTA_RULES, layer, block)
            if memory:
                rows += common.prefixed(
                    common.rules(("linear_attn.conv1d.weight", conv, "conv")), layer, block
                )
            else:
                cuts = {"q": (0, key), "k": (key, 2 * key), "v": (2 * key, 2 * key + value)}
                for part, (start, stop) in cuts.items():
                    rule = common.rules((f"linear_attn.{part}_conv1d.weight", conv, "conv"))
                    index = (slice(None), slice(start, stop))
                    rows += common.prefixed(rule, layer, block, index)
        rows += common.prefixed(MLP_RULES, layer, block)
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in, checked.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    config = common.with_defaults(raw, MODEL_TYPES, DEFAULTS)
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
    common.check_ints(config, INT_FIELDS)
    common.check_divides(config, "num_key_value_heads", "num_attention_heads")
    common.check_divides(config, "num_attention_heads", "hidden_size")
    common.check_divides(config, "linear_num_key_heads", "linear_num_value_heads")
    n = config["num_hidden_layers"]
    if config.get("layer_types") is None:  # transformers' default: full every fourth layer
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        config["layer_types"] = types
    common.check_layer_types(config, LAYER_KINDS)
    common.check_unsupported(config, {"hidden_act": "silu", "attention_bias": False})
    common.check_bools(config, ("tie_word_embeddings", "linear_allow_neg_eigval"))
    if not common.is_number(config["rms_norm_eps"]):
        raise ValueError(
            f"config.json: rms_norm_eps must be a number, got {config['rms_norm_eps']!r}"
        )
    rope = common.rope_parameters(config, None)
    theta = rope["rope_theta"]
    if rope["rope_type"] != "default" or not (theta is None or common.is_number(theta)):
        raise ValueError(
            "config.json: rope_parameters must have rope_type 'default' and a number (or null: "
            f"no RoPE) rope_theta, got {rope!r}"
        )
    config["rope_parameters"] = rope
    config.pop("rope_theta", None)
    return config


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``normalize_config`` config
    (the norms' epsilon is set by ``finish``)."""
    heads = config["num_attention_heads"]
    theta = config["rope_parameters"]["rope_theta"]
    rope = dict(rope=False) if theta is None else dict(rope=True, rope_theta=float(theta))
    return common.language_model_options(
        config,
        dtype,
        param_dtype,
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


def config_from_model(model) -> dict[str, Any]:
    """The ``olmo_hybrid`` config of a ``LanguageModel`` in OLMo-Hybrid's form.

    Raises:
      ValueError: a model not of that form (scanned layers, kinds other than
        ``gated_deltanet`` and ``softmax``, blocks or layers of another form, layers of one
        kind with different sizes), naming what differs.
    """
    common.check_unrolled(model)
    fields: dict[str, Any] = {}
    types, width = [], model.embed.features
    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where, a = f"blocks[{i}]", block.attention
        if kind not in LAYER_KINDS.values():
            raise ValueError(
                f"{where}: OLMo-Hybrid has gated_deltanet and softmax layers, got {kind!r}"
            )
        if type(block.mlp).__name__ != "SwiGLU" or block.conv is not None or block.normed_residual:
            raise ValueError(f"{where}: OLMo-Hybrid's blocks have a SwiGLU MLP, plain residuals")
        if (block.attention_residual, block.mlp_residual) != ((1.0, 1.0), (1.0, 1.0)):
            raise ValueError(f"{where}: OLMo-Hybrid's residuals have no factors")
        if block.attention_norm.zero_centred or block.mlp_norm.zero_centred:
            raise ValueError(f"{where}: OLMo-Hybrid's RMSNorms are not zero-centred")
        common.agree(fields, "intermediate_size", block.mlp.gate_proj.out_features, where)
        for norm in (block.attention_norm, block.mlp_norm, model.norm):
            common.agree(fields, "rms_norm_eps", norm.epsilon, where)
        if kind == "gated_deltanet":
            ok = not block.post_norm and a.variant == "gated_deltanet" and a.conv is not None
            ok = ok and a.g_proj is not None and isinstance(a.output_norm, GatedRMSNorm)
            if not ok or a.output_norm.epsilon != OUTPUT_NORM_EPS:
                raise ValueError(
                    f"{where}: OLMo-Hybrid's Gated DeltaNet blocks are pre-norm, with a short "
                    f"convolution, an output gate and the gated norm's epsilon {OUTPUT_NORM_EPS}"
                )
            for field, value in (
                ("linear_num_key_heads", a.num_heads),
                ("linear_num_value_heads", a.num_v_heads),
                ("linear_key_head_dim", a.key_dim),
                ("linear_value_head_dim", a.value_dim),
                ("linear_conv_kernel_dim", a.conv.size),
                ("linear_allow_neg_eigval", a.beta_max == 2.0),
            ):
                common.agree(fields, field, value, where)
            types.append("linear_attention")
            continue
        olmo = block.post_norm and a.qk_norm_over_heads and not a.output_gate
        olmo = olmo and a.sliding_window is None and a.head_dim * a.num_heads == width
        olmo = olmo and a.rotary_dim in (None, a.head_dim)
        if not olmo:
            raise ValueError(
                f"{where}: OLMo-Hybrid's attention blocks are post-norm, with a QK-norm over all "
                "heads, hidden_size / num_attention_heads channels per head, RoPE over the "
                "whole head or none, and no output gate or sliding window"
            )
        common.agree(fields, "num_attention_heads", a.num_heads, where)
        common.agree(fields, "num_key_value_heads", a.num_kv_heads, where)
        common.agree(fields, "rope_theta", None if a.rotary_dim is None else a.rope_theta, where)
        common.agree(fields, "rms_norm_eps", a.q_norm.epsilon, where)
        types.append("full_attention")
    if "linear_num_key_heads" not in fields or "num_attention_heads" not in fields:
        raise ValueError("OLMo-Hybrid needs gated_deltanet and softmax layers")
    theta = fields.pop("rope_theta")
    return {
        "architectures": ["OlmoHybridForCausalLM"],
        "model_type": "olmo_hybrid",
        **common.model_fields(model),
        "layer_types": types,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        **fields,
    }


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: ``config_from_model``'s fields
    over ``config``'s others.

    Raises:
      ValueError: ``config_from_model``'s, or a field of ``config`` that describes another
        model (named).
    """
    derived = config_from_model(model)
    if config is None:  # the model knows no special tokens (transformers' defaults are ids
        # of OLMo's vocabulary, outside a smaller one's)
        derived |= dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    config = None if config is None else normalize_config(config)
    return normalize_config(common.merge_for_save(derived, config, UNCHECKED))


FORMAT = common.ModelFormat(
    name="OLMo-Hybrid",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=(PREFIX, PREFIX + MEMORY),
    ignored_prefixes=common.tied_head_ignored,
    finish=finish,
)
