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

from linattn_jax.hf import common, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR, SPLIT, rules

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
LAYER_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "softmax"}
IGNORED_PREFIXES = ("mtp.", "model.visual.")  # multi-token prediction, the vision tower

# The weight table: model-level rows, then each layer's, by its layer type.
MODEL_RULES = tables.MODEL_RULES
HEAD_RULE = tables.HEAD_RULE  # untied only; no prefix
BLOCK_RULES = tables.NORM_RULES + tables.MLP_RULES
LAYER_RULES = {
    "linear_attention": rules(
        (
            "linear_attn.in_proj_qkv.weight",
            ("attention.q_proj.kernel", "attention.k_proj.kernel", "attention.v_proj.kernel"),
            SPLIT,
        ),
        ("linear_attn.conv1d.weight", "attention.conv.kernel", CONV),
        ("linear_attn.in_proj_z.weight", "attention.g_proj.kernel", LINEAR),
        ("linear_attn.in_proj_b.weight", "attention.beta_proj.kernel", LINEAR),
        ("linear_attn.in_proj_a.weight", "attention.gate.proj.kernel", LINEAR),
        ("linear_attn.A_log", "attention.gate.A_log", COPY),
        ("linear_attn.dt_bias", "attention.gate.dt_bias", COPY),
        ("linear_attn.norm.weight", "attention.output_norm.scale", COPY),
        ("linear_attn.out_proj.weight", "attention.out_proj.kernel", LINEAR),
    ),
    "full_attention": tables.ATTENTION_RULES + tables.QK_NORM_RULES,
}


def layer_rules(config: Mapping[str, Any], i: int) -> tuple[tables.Rule, ...]:
    """Layer ``i``'s rows: its norms, its MLP and its layer type's mixer."""
    return BLOCK_RULES + LAYER_RULES[config["layer_types"][i]]


# ---------------------------------------------------------------------------- the config


def text_part(multimodal: str, text: str) -> common.Step:
    """The step reading a ``multimodal`` config as its ``text_config`` (with the top-level
    ``tie_word_embeddings``, which ``transformers`` ties by, and the top-level
    ``eos_token_id``, ``dtype`` and the like where the text part has none), of model type
    ``text``."""

    def step(config: common.Config) -> None:
        if config.get("model_type") != multimodal:
            return
        raw, part = dict(config), config.get("text_config")
        if not isinstance(part, Mapping):
            raise ValueError(f"config.json: a {multimodal} config needs a text_config (a dict)")
        config.clear()
        config.update(part)
        # transformers ties the image-text model's embeddings by its own (top-level) field.
        config["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
        for field in ("eos_token_id", "bos_token_id", "pad_token_id", "dtype", "torch_dtype"):
            if config.get(field) is None and raw.get(field) is not None:
                config[field] = raw[field]
        config["model_type"] = text

    return step


# transformers' defaults when absent (head_dim's is not hidden_size / num_attention_heads).
DEFAULTS = dict(
    tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu", linear_conv_kernel_dim=4,
    head_dim=256,
)  # fmt: skip


def layer_types(config: common.Config) -> None:
    """Fills in ``layer_types`` when absent: every ``full_attention_interval``-th layer (4th)
    full attention."""
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


def rope(config: common.Config) -> None:
    """Folds a legacy ``rope_scaling`` (which replaces ``rope_parameters``, as in
    ``transformers``) and the top-level ``rope_theta`` and ``partial_rotary_factor`` into
    one ``rope_parameters`` dict, the one place read."""
    field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    given = config.get(field) or {}
    if not isinstance(given, Mapping):
        raise ValueError(f"config.json: {field} must be a dict, got {given!r}")
    nested = sorted(set(given) & set(LAYER_KINDS))
    if nested:  # transformers' Qwen3.5 reads one flat dict (rope_parameters["rope_type"])
        raise ValueError(
            f"config.json: {field} must be one dict for every layer, got one per layer type "
            f"({nested})"
        )
    parameters = dict(given)
    config.pop("rope_scaling", None)
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    parameters.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    parameters.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    config["rope_parameters"] = parameters


INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads",
)  # fmt: skip


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` (its sizes checked) that is
    missing, of the wrong type, or that we do not support."""
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
    common.check_divides(config, "num_key_value_heads", "num_attention_heads")
    common.check_divides(config, "linear_num_key_heads", "linear_num_value_heads")
    common.check_choice(config, "hidden_act", ("silu",))
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
    common.check_number(config, "rms_norm_eps", 0, 1)
    parameters = config["rope_parameters"]
    if parameters["rope_type"] != "default":
        raise ValueError(
            "config.json: rope_parameters.rope_type must be 'default', got "
            f"{parameters['rope_type']!r}"
        )
    theta, factor = parameters["rope_theta"], parameters["partial_rotary_factor"]
    if not common.is_number(theta) or not theta > 0:
        raise ValueError(f"config.json: rope_parameters.rope_theta must be > 0, got {theta!r}")
    rotary = int(config["head_dim"] * factor) if common.is_number(factor) else 0
    if not common.is_number(factor) or rotary < 2 or rotary % 2 or not 0 < factor <= 1:
        raise ValueError(
            f"config.json: rope_parameters.partial_rotary_factor must be in (0, 1] and rotate an "
            f"even number >= 2 of head_dim={config['head_dim']} channels, got {factor!r}"
        )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """``LanguageModel``'s options of a normalised config (``ModelFormat.options``)."""
    parameters = config["rope_parameters"]
    return dict(
        num_heads=config["num_attention_heads"],
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options={
            "softmax": dict(
                num_heads=config["num_attention_heads"],
                num_kv_heads=config["num_key_value_heads"],
                head_dim=config["head_dim"],
                rope=True,
                rope_theta=float(parameters["rope_theta"]),
                partial_rotary_factor=float(parameters["partial_rotary_factor"]),
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


# What the derived types (Qwen3.5-MoE, Qwen3-Next) share: the config's reading after its
# defaults, less the size checks.
LAYOUT_STEPS = (layer_types, rope)

FORMAT = common.ModelFormat(
    name="Qwen3.5",
    model_types=MODEL_TYPES,
    architecture="Qwen3_5ForCausalLM",
    steps=(
        text_part("qwen3_5", "qwen3_5_text"),
        common.defaults(DEFAULTS, keep_none=True),
        *LAYOUT_STEPS,
        common.ints(INT_FIELDS),
        check_config,
    ),
    options=options,
    table=tables.layered(MODEL_RULES, layer_rules),
    prefixes=("model.", "model.language_model."),  # qwen3_5_text, qwen3_5 (multimodal)
    ignored=lambda config: IGNORED_PREFIXES,
    # The blocks', the final, q/k and gated norms (the layers' default is Qwen3.5's 1e-6).
    finish=common.rms_norm_eps("rms_norm_eps"),
)
