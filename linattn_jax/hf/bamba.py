"""Bamba checkpoints in Hugging Face format (``BambaForCausalLM``, ``model_type`` ``bamba``)
<-> ``LanguageModel``: the config's fields as the model's options, and the one table of
weights.

Bamba is a hybrid of Mamba-2 mixers (``"linear_attention"`` layers, our ``"mamba2"``) and
softmax attention (the layers in ``attn_layer_indices``, our ``"softmax"``), every layer
followed by a SwiGLU MLP. Its conventions, each mapped to an option of ours:

* the mixer is Mamba-2's (``hf.mamba2``'s rows under ``mamba.``; its options
  ``mamba_n_heads``, ``mamba_d_head``, ``mamba_d_state``, ``mamba_n_groups``,
  ``mamba_d_conv``, ``mamba_conv_bias``, ``mamba_proj_bias``, ``time_step_limit``);
* attention is Llama's: GQA, no biases, RoPE (``rotate_half``) on the first half of each
  head (``partial_rotary_factor`` 0.5, which ``transformers`` fixes), ``head_dim = hidden_size
  / num_attention_heads``;
* every RMSNorm's epsilon (the blocks', the final one and the mixers' gated norms) is
  ``rms_norm_eps``; ``nn.Linear`` weights are ``[out, in]``, our kernels ``[in, out]``.

The tensors live under ``model.`` (``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from linattn_jax.hf import mamba2
from linattn_jax.hf.qwen3_5 import Rule

MODEL_TYPES = ("bamba",)
PREFIX = "model."
IGNORED_PREFIXES = ()
LAYER_KINDS = {"linear_attention": "mamba2", "full_attention": "softmax"}
PARTIAL_ROTARY_FACTOR = 0.5  # transformers' BambaConfig fixes it


def _rules(*rows) -> tuple[Rule, ...]:
    return tuple(Rule(hf, (ours,), how) for hf, ours, how in rows)


MODEL_RULES = _rules(
    ("embed_tokens.weight", "embed.embedding", "copy"),
    ("final_layernorm.weight", "norm.scale", "copy"),
)
HEAD_RULE = mamba2.HEAD_RULE
BLOCK_RULES = _rules(
    ("input_layernorm.weight", "attention_norm.scale", "copy"),
    ("pre_ff_layernorm.weight", "mlp_norm.scale", "copy"),
    ("feed_forward.gate_proj.weight", "mlp.gate_proj.kernel", "linear"),
    ("feed_forward.up_proj.weight", "mlp.up_proj.kernel", "linear"),
    ("feed_forward.down_proj.weight", "mlp.down_proj.kernel", "linear"),
)
ATTENTION_RULES = _rules(
    ("self_attn.q_proj.weight", "attention.q_proj.kernel", "linear"),
    ("self_attn.k_proj.weight", "attention.k_proj.kernel", "linear"),
    ("self_attn.v_proj.weight", "attention.v_proj.kernel", "linear"),
    ("self_attn.o_proj.weight", "attention.out_proj.kernel", "linear"),
)


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, Rule]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s): ``(its full
    Hugging Face name, the Rule with our full paths)``, in the model's order."""
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    mixer = mamba2.mixer_rules(
        "mamba.", conv_bias=config["mamba_conv_bias"], bias=config["mamba_proj_bias"]
    )
    for i, layer_type in enumerate(config["layer_types"]):
        own = mixer if layer_type == "linear_attention" else ATTENTION_RULES
        for rule in BLOCK_RULES + own:
            ours = tuple(f"blocks.{i}.{path}" for path in rule.ours)
            rows.append((f"{prefix}layers.{i}.{rule.hf}", Rule(rule.hf, ours, rule.how)))
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


# ---------------------------------------------------------------------------- the config

DEFAULTS = dict(
    tie_word_embeddings=False,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    attn_layer_indices=None,
    mamba_n_heads=128,
    mamba_d_head="auto",
    mamba_n_groups=1,
    mamba_d_state=256,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_conv_bias=True,
    mamba_proj_bias=False,
    time_step_limit=[0.0, math.inf],
    attention_bias=False,
    mlp_bias=False,
)  # fmt: skip  (transformers' BambaConfig defaults, for fields a config.json leaves out)
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "mamba_n_heads", "mamba_d_head",
    "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
)  # fmt: skip


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in and
    ``layer_types`` derived from ``attn_layer_indices``, checked.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    if raw.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type must be one of {MODEL_TYPES}, got {raw.get('model_type')!r}"
        )
    config = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k not in DEFAULTS}}
    if config.get("num_key_value_heads") is None:  # transformers' backward compatibility
        config["num_key_value_heads"] = config.get("num_attention_heads")
    if config["mamba_d_head"] == "auto" and mamba2._is_int(config.get("hidden_size")):
        heads = config["mamba_n_heads"]
        config["mamba_d_head"] = config["mamba_expand"] * config["hidden_size"] // heads
    config["time_step_limit"] = list(config["time_step_limit"])
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
    config["rope_parameters"] = rope
    check_config(config)
    indices = config["attn_layer_indices"] or []
    config["layer_types"] = [
        "full_attention" if i in indices else "linear_attention"
        for i in range(config["num_hidden_layers"])
    ]
    return config


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` that is missing, of the wrong
    type, or that we do not support."""
    for field in INT_FIELDS:
        value = config.get(field)
        if not mamba2._is_int(value) or value < 1:
            raise ValueError(f"config.json: {field} must be an int >= 1, got {value!r}")
    inner = config["hidden_size"] * config["mamba_expand"]
    if inner != config["mamba_n_heads"] * config["mamba_d_head"]:
        raise ValueError(
            f"config.json: hidden_size * mamba_expand ({inner}) must equal mamba_n_heads * "
            f"mamba_d_head ({config['mamba_n_heads'] * config['mamba_d_head']})"
        )
    for field, heads in [
        ("mamba_n_groups", "mamba_n_heads"),
        ("num_key_value_heads", "num_attention_heads"),
        ("num_attention_heads", "hidden_size"),
    ]:
        if config[heads] % config[field]:
            raise ValueError(
                f"config.json: {field}={config[field]} must divide {heads}={config[heads]}"
            )
    indices = config["attn_layer_indices"]
    n = config["num_hidden_layers"]
    if indices is not None and (
        not isinstance(indices, list) or not all(mamba2._is_int(i) and 0 <= i < n for i in indices)
    ):
        raise ValueError(
            f"config.json: attn_layer_indices must list layer indices below num_hidden_layers="
            f"{n}, got {indices!r}"
        )
    if config["hidden_act"] != "silu":
        raise ValueError(f"config.json: hidden_act must be 'silu', got {config['hidden_act']!r}")
    for field in ("attention_bias", "mlp_bias"):
        if config[field] is not False:
            raise ValueError(f"config.json: {field} must be false, got {config[field]!r}")
    for field in ("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings"):
        if not isinstance(config[field], bool):
            raise ValueError(f"config.json: {field} must be true or false, got {config[field]!r}")
    mamba2.check_config(
        dict(
            vocab_size=1,
            hidden_size=1,
            num_hidden_layers=1,
            num_heads=1,
            head_dim=1,
            state_size=1,
            n_groups=1,
            conv_kernel=1,
            expand=1,
            hidden_act="silu",
            use_bias=False,
            use_conv_bias=False,
            tie_word_embeddings=False,
            residual_in_fp32=True,
            layer_norm_epsilon=config["rms_norm_eps"],
            time_step_limit=config["time_step_limit"],
        )
    )  # fmt: skip  (its epsilon and time-step checks, under Mamba-2's names)
    rope = config["rope_parameters"]
    if rope["rope_type"] != "default" or rope["partial_rotary_factor"] != PARTIAL_ROTARY_FACTOR:
        raise ValueError(
            f"config.json: rope_parameters must have rope_type 'default' and "
            f"partial_rotary_factor {PARTIAL_ROTARY_FACTOR}, got {rope!r}"
        )


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``normalize_config`` config:
    the computation in ``dtype``, the parameters in ``param_dtype`` (None: ``dtype``). The
    blocks' and the final RMSNorm's epsilon is set on the built model (``set_norm_eps``)."""
    heads = config["num_attention_heads"]
    return dict(
        vocab_size=config["vocab_size"],
        width=config["hidden_size"],
        depth=config["num_hidden_layers"],
        num_heads=heads,
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options={
            "mamba2": dict(
                num_heads=config["mamba_n_heads"],
                **mamba2.mixer_options(
                    head_dim=config["mamba_d_head"],
                    state_dim=config["mamba_d_state"],
                    n_groups=config["mamba_n_groups"],
                    conv_size=config["mamba_d_conv"],
                    use_conv_bias=config["mamba_conv_bias"],
                    use_bias=config["mamba_proj_bias"],
                    time_step_limit=config["time_step_limit"],
                    norm_eps=config["rms_norm_eps"],
                ),
            ),
            "softmax": dict(
                num_heads=heads,
                num_kv_heads=config["num_key_value_heads"],
                head_dim=config["hidden_size"] // heads,
                rope=True,
                rope_theta=float(config["rope_parameters"]["rope_theta"]),
                partial_rotary_factor=PARTIAL_ROTARY_FACTOR,
            ),
        },
        tie_embeddings=config["tie_word_embeddings"],
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
    )


def set_norm_eps(model, config: Mapping[str, Any]) -> None:
    """Sets the blocks' and the final RMSNorm's epsilon to ``rms_norm_eps``."""
    eps = float(config["rms_norm_eps"])
    model.norm.epsilon = eps
    for block in model.blocks:
        block.attention_norm.epsilon = block.mlp_norm.epsilon = eps
