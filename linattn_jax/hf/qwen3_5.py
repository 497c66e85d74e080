"""Qwen3.5's dense text models in Hugging Face format <-> ``LanguageModel``: the config's
fields as the model's options, and the one table of weights.

Qwen3.5 (``Qwen3_5ForCausalLM``, or the text part of ``Qwen3_5ForConditionalGeneration``)
is a hybrid: ``layer_types`` lists ``"linear_attention"`` (Gated DeltaNet) and
``"full_attention"`` (gated softmax attention) layers, three to one in the published
models. Its conventions, each mapped to an option of ours:

* every RMSNorm of the blocks, the final one and the attention's q/k norms are
  zero-centred, ``x * (1 + w)`` (``zero_centred_norm``, ``zero_centred_qk_norm``); the Gated
  DeltaNet's output norm is not (``w`` from ones), and is gated, ``norm(o) * SiLU(z)``;
* ``in_proj_qkv`` is q, k and v fused (rows ``[q | k | v]``), and so is the depthwise conv
  over them (channels in the same order): split into our ``q_proj``, ``k_proj``,
  ``v_proj``; the conv kernel ``[c, 1, k]`` is our ``[k, c]``;
* the gate is ``-exp(A_log) * softplus(in_proj_a x + dt_bias)``, beta ``sigmoid(in_proj_b x)``
  (our ``MambaGate`` and ``beta_proj``); q and k L2-normalised, q scaled by ``dk^-0.5``;
* attention's ``q_proj`` makes ``[q_h | gate_h]`` for each head in turn (our
  ``output_gate`` layout), ``attention * sigmoid(gate)`` before ``o_proj``;
* RoPE on the first ``int(head_dim * partial_rotary_factor)`` channels; the multimodal
  RoPE's three sections (``mrope_section``) read the same text positions, so for text it is
  plain RoPE;
* ``nn.Linear`` weights are ``[out, in]``, our kernels ``[in, out]`` (a transpose).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from linattn_jax.hf import common
from linattn_jax.hf.common import Rule, rules

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "softmax"}
IGNORED_PREFIXES = ("mtp.", "model.visual.")  # multi-token prediction, the vision tower
_rules = rules


# The weight table: model-level rows, then each layer's, by its layer type.
MODEL_RULES = _rules(
    ("embed_tokens.weight", "embed.embedding", "copy"),
    ("norm.weight", "norm.scale", "copy"),
)
HEAD_RULE = Rule("lm_head.weight", ("head.kernel",), "linear")  # untied only; no prefix
BLOCK_RULES = _rules(
    ("input_layernorm.weight", "attention_norm.scale", "copy"),
    ("post_attention_layernorm.weight", "mlp_norm.scale", "copy"),
    ("mlp.gate_proj.weight", "mlp.gate_proj.kernel", "linear"),
    ("mlp.up_proj.weight", "mlp.up_proj.kernel", "linear"),
    ("mlp.down_proj.weight", "mlp.down_proj.kernel", "linear"),
)
LAYER_RULES = {
    "linear_attention": _rules(
        (
            "linear_attn.in_proj_qkv.weight",
            ("attention.q_proj.kernel", "attention.k_proj.kernel", "attention.v_proj.kernel"),
            "split",
        ),
        ("linear_attn.conv1d.weight", "attention.conv.kernel", "conv"),
        ("linear_attn.in_proj_z.weight", "attention.g_proj.kernel", "linear"),
        ("linear_attn.in_proj_b.weight", "attention.beta_proj.kernel", "linear"),
        ("linear_attn.in_proj_a.weight", "attention.gate.proj.kernel", "linear"),
        ("linear_attn.A_log", "attention.gate.A_log", "copy"),
        ("linear_attn.dt_bias", "attention.gate.dt_bias", "copy"),
        ("linear_attn.norm.weight", "attention.output_norm.scale", "copy"),
        ("linear_attn.out_proj.weight", "attention.out_proj.kernel", "linear"),
    ),
    "full_attention": _rules(
        ("self_attn.q_proj.weight", "attention.q_proj.kernel", "linear"),
        ("self_attn.k_proj.weight", "attention.k_proj.kernel", "linear"),
        ("self_attn.v_proj.weight", "attention.v_proj.kernel", "linear"),
        ("self_attn.o_proj.weight", "attention.out_proj.kernel", "linear"),
        ("self_attn.q_norm.weight", "attention.q_norm.scale", "copy"),
        ("self_attn.k_norm.weight", "attention.k_norm.scale", "copy"),
    ),
}


def weight_table(config: Mapping[str, Any], prefix: str = "model.") -> list[tuple[str, Rule]]:
    """Every tensor of a checkpoint of ``config`` (``read_config``'s): ``(its full Hugging
    Face name, the Rule with our full paths)``, in the model's order."""
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i, layer_type in enumerate(config["layer_types"]):
        rows += common.prefixed(
            BLOCK_RULES + LAYER_RULES[layer_type], f"{prefix}layers.{i}.", f"blocks.{i}."
        )
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


# ---------------------------------------------------------------------------- the config


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents as the text model's config, checked: a ``qwen3_5_text``
    config, or a ``qwen3_5`` one's ``text_config`` (with the top-level
    ``tie_word_embeddings``, which ``transformers`` ties by, and the top-level
    ``eos_token_id`` and ``dtype`` where the text part has none); ``layer_types`` filled in
    (every 4th layer full attention) when absent.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported (``check_config``), named.
    """
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type must be one of {MODEL_TYPES}, got {model_type!r}"
        )
    config = dict(raw)
    if model_type == "qwen3_5":
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError("config.json: a qwen3_5 config needs a text_config (a dict)")
        config = dict(text)
        # transformers ties the image-text model's embeddings by its own (top-level) field.
        config["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
        for field in ("eos_token_id", "bos_token_id", "pad_token_id", "dtype", "torch_dtype"):
            if config.get(field) is None and raw.get(field) is not None:
                config[field] = raw[field]
        config["model_type"] = "qwen3_5_text"
    config.setdefault("tie_word_embeddings", False)
    config.setdefault("rms_norm_eps", 1e-6)
    config.setdefault("hidden_act", "silu")
    config.setdefault("linear_conv_kernel_dim", 4)
    # transformers' default when absent, not hidden_size / num_attention_heads.
    config.setdefault("head_dim", 256)
    if config.get("layer_types") is None and common.is_int(config.get("num_hidden_layers")):
        interval = config.get("full_attention_interval", 4)
        if not common.is_int(interval) or interval < 1:
            raise ValueError(
                f"config.json: full_attention_interval must be an int >= 1, got {interval!r}"
            )
        config["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(config["num_hidden_layers"])
        ]
    # transformers' order: a legacy rope_scaling replaces rope_parameters.
    field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(field) or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"config.json: {field} must be a dict, got {rope!r}")
    nested = sorted(set(rope) & set(LAYER_KINDS))
    if nested:  # transformers' Qwen3.5 reads one flat dict (rope_parameters["rope_type"])
        raise ValueError(
            f"config.json: {field} must be one dict for every layer, got one per layer type "
            f"({nested})"
        )
    rope = dict(rope)
    config.pop("rope_scaling", None)  # folded into rope_parameters, the one place read
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    config["rope_parameters"] = rope
    check_config(config)
    return config


INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads",
)  # fmt: skip


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` (``read_config``'s form) that is
    missing, of the wrong type, or that we do not support."""
    common.check_ints(config, INT_FIELDS)
    layer_types = config["layer_types"]
    if not isinstance(layer_types, list) or len(layer_types) != config["num_hidden_layers"]:
        raise ValueError(
            f"config.json: layer_types must list num_hidden_layers={config['num_hidden_layers']}"
            f" layer types, got {layer_types!r}"
        )
    unknown = sorted(set(layer_types) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(
            f"config.json: layer_types must be in {sorted(LAYER_KINDS)}, got {unknown}"
        )
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError(
            f"config.json: num_key_value_heads={config['num_key_value_heads']} must divide "
            f"num_attention_heads={config['num_attention_heads']}"
        )
    if config["linear_num_value_heads"] % config["linear_num_key_heads"]:
        raise ValueError(
            f"config.json: linear_num_key_heads={config['linear_num_key_heads']} must divide "
            f"linear_num_value_heads={config['linear_num_value_heads']}"
        )
    if config["hidden_act"] != "silu":
        raise ValueError(f"config.json: hidden_act must be 'silu', got {config['hidden_act']!r}")
    if config.get("attention_bias", False) is not False:
        raise ValueError(
            f"config.json: attention_bias must be false (Qwen3.5 has no biases), got "
            f"{config['attention_bias']!r}"
        )
    if config.get("attn_output_gate", True) is not True:  # transformers gates regardless
        raise ValueError(
            f"config.json: attn_output_gate must be true (Qwen3.5's attention is gated), got "
            f"{config['attn_output_gate']!r}"
        )
    common.check_bools(config, ("tie_word_embeddings",))
    eps = config["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise ValueError(f"config.json: rms_norm_eps must be a number in (0, 1), got {eps!r}")
    rope = config["rope_parameters"]
    if rope["rope_type"] != "default":
        raise ValueError(
            f"config.json: rope_parameters.rope_type must be 'default', got {rope['rope_type']!r}"
        )
    theta, factor = rope["rope_theta"], rope["partial_rotary_factor"]
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ValueError(f"config.json: rope_parameters.rope_theta must be > 0, got {theta!r}")
    rotary = int(config["head_dim"] * factor) if isinstance(factor, int | float) else 0
    if isinstance(factor, bool) or rotary < 2 or rotary % 2 or not 0 < factor <= 1:
        raise ValueError(
            f"config.json: rope_parameters.partial_rotary_factor must be in (0, 1] and rotate an "
            f"even number >= 2 of head_dim={config['head_dim']} channels, got {factor!r}"
        )


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``read_config`` config: the
    computation in ``dtype``, the parameters in ``param_dtype`` (None: ``dtype``)."""
    rope = config["rope_parameters"]
    return common.language_model_options(
        config,
        dtype,
        param_dtype,
        num_heads=config["num_attention_heads"],
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options={
            "softmax": dict(
                num_heads=config["num_attention_heads"],
                num_kv_heads=config["num_key_value_heads"],
                head_dim=config["head_dim"],
                rope=True,
                rope_theta=float(rope["rope_theta"]),
                partial_rotary_factor=float(rope["partial_rotary_factor"]),
                qk_norm=True,
                zero_centred_qk_norm=True,
                output_gate=True,
            ),
            "gated_deltanet": dict(
                num_heads=config["linear_num_key_heads"],
                num_v_heads=config["linear_num_value_heads"],
                head_dim=config["linear_key_head_dim"],
                value_head_dim=config["linear_value_head_dim"],
                conv_size=config["linear_conv_kernel_dim"],
            ),
        },
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
        zero_centred_norm=True,
    )


# The sizes of a kind that a layout lacks (its config.json must still hold them): any valid.
ABSENT_KIND_SIZES = dict(
    num_attention_heads=1, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
    linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)  # fmt: skip


def config_from_model(model) -> dict[str, Any]:
    """The ``qwen3_5_text`` config of a ``LanguageModel`` in Qwen3.5's form (the dimensions
    read from its layers; a layout without one of the kinds leaves that kind's sizes out,
    ``ABSENT_KIND_SIZES`` fills them).

    Raises:
      ValueError: a model that is not of that form (scanned layers, a kind other than
        ``gated_deltanet`` and ``softmax``, an MLP other than SwiGLU, norms not zero-centred,
        attention without its output gate, QK-norm or RoPE, layers of one kind with
        different sizes), naming what differs.
    """
    common.check_unrolled(model)
    kinds = {kind: layer for layer, kind in LAYER_KINDS.items()}
    fields: dict[str, Any] = {}

    def agree(field, value, where):
        common.agree(fields, field, value, where)

    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where = f"blocks[{i}]"
        if kind not in kinds:
            raise ValueError(
                f"{where}: Qwen3.5 has gated_deltanet and softmax layers, got {kind!r}"
            )
        if type(block.mlp).__name__ != "SwiGLU" or block.conv is not None:
            raise ValueError(f"{where}: Qwen3.5's blocks have a SwiGLU MLP and no short_conv")
        for norm in (block.attention_norm, block.mlp_norm):
            if not norm.zero_centred:
                raise ValueError(
                    f"{where}: Qwen3.5's RMSNorms are zero-centred (zero_centred_norm)"
                )
        agree("intermediate_size", block.mlp.gate_proj.out_features, where)
        agree("rms_norm_eps", block.attention_norm.epsilon, where)
        a = block.attention
        if kind == "softmax":
            if not (a.output_gate and a.q_norm is not None and a.q_norm.zero_centred):
                raise ValueError(
                    f"{where}: Qwen3.5's attention has output_gate=True, qk_norm=True and "
                    "zero_centred_qk_norm=True"
                )
            if a.rotary_dim is None or a.sliding_window is not None:
                raise ValueError(f"{where}: Qwen3.5's attention has RoPE and no sliding window")
            agree("num_attention_heads", a.num_heads, where)
            agree("num_key_value_heads", a.num_kv_heads, where)
            agree("head_dim", a.head_dim, where)
            agree("rotary_dim", a.rotary_dim, where)
            agree("rope_theta", a.rope_theta, where)
        else:
            if a.variant != "gated_deltanet" or a.g_proj is None or a.conv is None:
                raise ValueError(f"{where}: Qwen3.5's linear layers are gated DeltaNet with a conv")
            if a.beta_max != 1.0:
                raise ValueError(f"{where}: Qwen3.5 has beta in [0, 1] (no negative eigenvalues)")
            agree("linear_num_key_heads", a.num_heads, where)
            agree("linear_num_value_heads", a.num_v_heads, where)
            agree("linear_key_head_dim", a.key_dim, where)
            agree("linear_value_head_dim", a.value_dim, where)
            agree("linear_conv_kernel_dim", a.conv.size, where)
    if not model.norm.zero_centred:
        raise ValueError("norm: Qwen3.5's final RMSNorm is zero-centred (zero_centred_norm)")
    head_dim = fields.get("head_dim", 0)
    rotary = fields.pop("rotary_dim", None)
    factor = None if rotary is None else rotary / head_dim
    if factor is not None and int(head_dim * factor) != rotary:
        raise ValueError(f"rotary_dim={rotary} is no partial_rotary_factor of head_dim={head_dim}")
    dtype = jnp.dtype(model.embed.embedding[...].dtype).name
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed.features,
        "num_hidden_layers": model.depth,
        "layer_types": [kinds[kind] for kind in model.layout],
        "tie_word_embeddings": model.head is None,
        "hidden_act": "silu",
        "attention_bias": False,
        "dtype": dtype,
        **fields,
    }
    if rotary is not None:  # attention layers: their RoPE (else nothing the model uses)
        theta = config.pop("rope_theta")
        config["rope_parameters"] = dict(
            rope_type="default", rope_theta=theta, partial_rotary_factor=factor
        )
    return config


UNCHECKED = ("architectures", "dtype", "model_type")  # save_pretrained writes the model's


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: ``config_from_model``'s fields
    over ``config``'s others (``eos_token_id``, ``max_position_embeddings``, a layout's
    absent kind's sizes, ...), compared on what the model uses: RoPE's ``rope_theta`` and
    ``partial_rotary_factor`` only where the model has attention layers, the factor by the
    channels it rotates (``int(head_dim * factor)``: 0.3 of 16 is the model's 4).

    Raises:
      ValueError: ``config_from_model``'s, or a field of ``config`` that describes another
        model (named).
    """
    derived = config_from_model(model)
    rope = derived.pop("rope_parameters", None)
    merged = {**ABSENT_KIND_SIZES, **common.merge_for_save(derived, config, UNCHECKED)}
    given = merged.get("rope_parameters") or {}
    if not isinstance(given, Mapping):
        raise ValueError(f"config['rope_parameters'] must be a dict, got {given!r}")
    given = dict(given)
    if rope is not None:
        theta = given.get("rope_theta", merged.get("rope_theta"))
        if theta is not None and float(theta) != float(rope["rope_theta"]):
            raise ValueError(
                f"config['rope_parameters']['rope_theta']={theta}, but the model has "
                f"{rope['rope_theta']}"
            )
        head_dim, rotary = (
            merged["head_dim"],
            round(rope["partial_rotary_factor"] * merged["head_dim"]),
        )
        factor = given.get("partial_rotary_factor", merged.get("partial_rotary_factor"))
        if factor is None or not common.is_number(factor):
            factor = rope["partial_rotary_factor"]
        elif int(head_dim * factor) != rotary:
            raise ValueError(
                f"config['rope_parameters']['partial_rotary_factor']={factor} rotates "
                f"{int(head_dim * factor)} of head_dim={head_dim} channels, but the model "
                f"rotates {rotary}"
            )
        given.update(rope_theta=rope["rope_theta"], partial_rotary_factor=factor)
        given.setdefault("rope_type", "default")
    if given:
        merged["rope_parameters"] = given  # mrope_section and the like kept
    return normalize_config(merged)


def _finish(model, config: Mapping[str, Any]) -> None:
    # The blocks', the final, q/k and gated norms (the layers' default is Qwen3.5's 1e-6).
    common.set_rms_norm_epsilon(model, config["rms_norm_eps"])


FORMAT = common.ModelFormat(
    name="Qwen3.5",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=("model.", "model.language_model."),  # qwen3_5_text, qwen3_5 (multimodal)
    ignored_prefixes=lambda config: IGNORED_PREFIXES + common.tied_head_ignored(config),
    finish=_finish,
)
