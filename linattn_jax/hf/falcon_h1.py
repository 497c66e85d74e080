"""Falcon-H1 checkpoints in Hugging Face format (``FalconH1ForCausalLM``, ``model_type``
``falcon_h1``) <-> ``LanguageModel``: the config's fields as the model's options, and the one
table of weights.

Falcon-H1 is a parallel hybrid: every layer runs softmax attention and a Mamba-2 mixer side
by side on the same normalised input and adds them (our ``"softmax"`` blocks with
``parallel={"attention": "mamba2", ...}``: ``layers.TransformerBlock``'s parallel option),
then a SwiGLU MLP. Its conventions, each mapped to an option of ours:

* the branches' multipliers, ``(attention_in_multiplier, attention_out_multiplier)`` and
  ``(ssm_in_multiplier, ssm_out_multiplier)``: the block's ``branch_multipliers``;
* ``ssm_multipliers`` (the ``mup_vector`` over ``in_proj``'s z, x, B, C and dt parts): the
  mixer's ``projection_multipliers``; ``mamba_rms_norm`` false: ``norm="none"`` (the output
  ``y * SiLU(z)``), true: the grouped norm, after the gate (``"gate_first"``) or, with
  ``mamba_norm_before_gate``, before it (``"norm_first"``); ``mamba_d_ssm`` the mixer's
  inner width (``head_dim = mamba_d_ssm / mamba_n_heads``);
* ``key_multiplier`` (the keys times it) folds into the attention's score scale,
  ``key_multiplier * head_dim ** -0.5``; ``mlp_multipliers`` are the SwiGLU's
  (``mlp_multipliers``); ``embedding_multiplier`` is ours; ``lm_head_multiplier`` (the
  logits times it) is our ``logits_scaling = 1 / lm_head_multiplier``. A saved config gives
  back the loaded one's ``key_multiplier`` and ``lm_head_multiplier`` where the model's agree
  with them to 1e-12 (the scale and the division round them);
* attention is Llama's (GQA, no biases, RoPE on whole heads); every RMSNorm's epsilon is
  ``rms_norm_eps``; ``nn.Linear`` weights are ``[out, in]``, our kernels ``[in, out]``.

The tensors live under ``model.`` (``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from linattn_jax.hf import bamba, common, mamba2
from linattn_jax.hf.common import Rule

MODEL_TYPES = ("falcon_h1",)
PREFIX = "model."
SCALARS = (
    "embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
    "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
)  # fmt: skip

# Bamba's rows: the model's, the head's and a block's norms and MLP.
MODEL_RULES, HEAD_RULE, BLOCK_RULES = bamba.MODEL_RULES, bamba.HEAD_RULE, bamba.BLOCK_RULES


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, Rule]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s): ``(its full
    Hugging Face name, the Rule with our full paths)``, in the model's order."""
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    mixer = mamba2.hybrid_mixer_rules(config)
    mixer = tuple(
        r.at(r.hf, ["parallel." + p.removeprefix("attention.") for p in r.ours])
        for r in mixer
        if config["mamba_rms_norm"] or r.hf != "mamba.norm.weight"
    )
    own = BLOCK_RULES + bamba.ATTENTION_RULES + mixer
    for i in range(config["num_hidden_layers"]):
        rows += common.prefixed(own, f"{prefix}layers.{i}.", f"blocks.{i}.")
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


# ---------------------------------------------------------------------------- the config

DEFAULTS = dict(
    tie_word_embeddings=False,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    num_key_value_heads=8,
    mamba_d_ssm=1024,
    mamba_norm_before_gate=True,
    mamba_rms_norm=False,
    projectors_bias=False,
    lm_head_multiplier=1.0,
    embedding_multiplier=1.0,
    mlp_multipliers=[1.0, 1.0],
    key_multiplier=1.0,
    attention_out_multiplier=1.0,
    attention_in_multiplier=1.0,
    ssm_multipliers=[1.0, 1.0, 1.0, 1.0, 1.0],
    ssm_in_multiplier=1.0,
    ssm_out_multiplier=1.0,
    attention_bias=False,
    mlp_bias=False,
    **mamba2.HYBRID_DEFAULTS,
)  # fmt: skip  (transformers' FalconH1Config defaults, for fields a config.json leaves out)
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "mamba_n_heads", "mamba_d_head",
    "mamba_d_ssm", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
)  # fmt: skip
BOOL_FIELDS = (
    "mamba_conv_bias", "mamba_proj_bias", "projectors_bias", "mamba_rms_norm",
    "mamba_norm_before_gate", "tie_word_embeddings",
)  # fmt: skip


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in and checked.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    config = common.with_defaults(raw, MODEL_TYPES, DEFAULTS, keep_none=("mamba_d_ssm",))
    if config["mamba_d_ssm"] is None and common.is_int(config.get("hidden_size")):
        config["mamba_d_ssm"] = config["mamba_expand"] * config["hidden_size"]
    if config["mamba_d_head"] == "auto" and common.is_int(config.get("mamba_d_ssm")):
        config["mamba_d_head"] = config["mamba_d_ssm"] // config["mamba_n_heads"]
    if config.get("head_dim") is None and common.is_int(config.get("hidden_size")):
        config["head_dim"] = config["hidden_size"] // config.get("num_attention_heads", 1)
    mamba2.hybrid_defaults(config)
    config.pop("layers_block_type", None)  # every layer is "hybrid"
    check_config(config)
    return config


def _check_list(config, field: str, length: int) -> None:
    value = config[field]
    ok = isinstance(value, list | tuple) and len(value) == length
    if not ok or not all(common.is_number(v) and 0 < v < math.inf for v in value):
        raise ValueError(
            f"config.json: {field} must list {length} finite numbers > 0, got {value!r}"
        )


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` that is missing, of the wrong
    type, or that we do not support."""
    common.check_ints(config, INT_FIELDS)
    if config["mamba_d_ssm"] != config["mamba_n_heads"] * config["mamba_d_head"]:
        raise ValueError(
            f"config.json: mamba_d_ssm ({config['mamba_d_ssm']}) must equal mamba_n_heads * "
            f"mamba_d_head ({config['mamba_n_heads'] * config['mamba_d_head']})"
        )
    common.check_divides(config, "mamba_n_groups", "mamba_n_heads")
    common.check_divides(config, "num_key_value_heads", "num_attention_heads")
    common.check_positive(config, SCALARS)
    _check_list(config, "mlp_multipliers", 2)
    _check_list(config, "ssm_multipliers", 5)
    common.check_choice(config, "hidden_act", ("silu",))
    common.check_false(config, ("attention_bias", "mlp_bias"))
    common.check_bools(config, BOOL_FIELDS)
    if config["projectors_bias"] != config["mamba_proj_bias"]:
        raise ValueError(
            "config.json: projectors_bias (out_proj's bias) must equal mamba_proj_bias "
            f"(in_proj's), got {config['projectors_bias']!r} and {config['mamba_proj_bias']!r}"
        )
    mamba2.check_epsilon_and_limit(config["rms_norm_eps"], config["time_step_limit"])
    if config["rope_parameters"]["rope_type"] != "default":
        raise ValueError(
            f"config.json: rope_parameters must have rope_type 'default', got "
            f"{config['rope_parameters']!r}"
        )


def _norm(config: Mapping[str, Any]) -> str:
    if not config["mamba_rms_norm"]:
        return "none"
    return "norm_first" if config["mamba_norm_before_gate"] else "gate_first"


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``normalize_config`` config:
    the computation in ``dtype``, the parameters in ``param_dtype`` (None: ``dtype``). The
    RMSNorms' epsilon is set on the built model (``finish``)."""
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    mixer = dict(
        attention="mamba2",
        norm=_norm(config),
        projection_multipliers=tuple(float(m) for m in config["ssm_multipliers"]),
        **mamba2.hybrid_mixer_options(config),
    )
    softmax = dict(
        num_heads=heads,
        num_kv_heads=config["num_key_value_heads"],
        head_dim=head_dim,
        scale=float(config["key_multiplier"]) * head_dim**-0.5,
        rope=True,
        rope_theta=float(config["rope_parameters"]["rope_theta"]),
        parallel=mixer,
        branch_multipliers=(
            (float(config["attention_in_multiplier"]), float(config["attention_out_multiplier"])),
            (float(config["ssm_in_multiplier"]), float(config["ssm_out_multiplier"])),
        ),
    )
    return common.language_model_options(
        config,
        dtype,
        param_dtype,
        num_heads=heads,
        attention="softmax",
        kind_options={"softmax": softmax},
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
        mlp_multipliers=tuple(float(m) for m in config["mlp_multipliers"]),
        embedding_multiplier=float(config["embedding_multiplier"]),
        logits_scaling=1.0 / float(config["lm_head_multiplier"]),
    )


finish = bamba.finish  # the blocks' and the final RMSNorm's epsilon: rms_norm_eps


def config_from_model(model) -> dict[str, Any]:
    """The ``falcon_h1`` config of a ``LanguageModel`` in Falcon-H1's form (its dimensions
    and multipliers read from the layers).

    Raises:
      ValueError: a model not of that form (scanned layers, a block that is not softmax
        attention beside a Mamba-2 mixer with a SwiGLU MLP, attention other than Llama's,
        layers with different sizes), naming what differs.
    """
    common.check_unrolled(model)
    fields: dict[str, Any] = {}
    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where, a, m = f"blocks[{i}]", block.attention, block.parallel
        if kind != "softmax" or type(m).__name__ != "Mamba2Mixer":
            raise ValueError(
                f"{where}: Falcon-H1's blocks are softmax attention with a parallel mamba2 mixer"
            )
        if type(block.mlp).__name__ != "SwiGLU" or block.conv is not None:
            raise ValueError(f"{where}: Falcon-H1's blocks have a SwiGLU MLP and no short_conv")
        if block.attention_norm.zero_centred or block.residual_multiplier != 1.0:
            raise ValueError(f"{where}: Falcon-H1's RMSNorms are plain, its residual adds unscaled")
        llama = a.rotary_dim == a.head_dim and not a.output_gate and a.q_norm is None
        if not llama or a.sliding_window is not None:
            raise ValueError(
                f"{where}: Falcon-H1's attention has RoPE on whole heads, no output gate, "
                "QK-norm or sliding window"
            )
        scale = a.head_dim**-0.5 if a.scale is None else a.scale
        (in_1, out_1), (in_2, out_2) = block.branch_multipliers
        for field, value in (
            ("num_attention_heads", a.num_heads),
            ("num_key_value_heads", a.num_kv_heads),
            ("head_dim", a.head_dim),
            ("rope_theta", a.rope_theta),
            ("key_multiplier", scale * a.head_dim**0.5),
            ("attention_in_multiplier", in_1),
            ("attention_out_multiplier", out_1),
            ("ssm_in_multiplier", in_2),
            ("ssm_out_multiplier", out_2),
            ("intermediate_size", block.mlp.gate_proj.out_features),
            ("mlp_multipliers", list(block.mlp.multipliers)),
            ("ssm_multipliers", list(m.projection_multipliers or (1.0,) * 5)),
            ("mamba_rms_norm", m.norm is not None),
            ("mamba_norm_before_gate", m.norm is None or not m.norm.gate_first),
        ):
            common.agree(fields, field, value, where)
        mamba2.agree_hybrid_mixer(fields, m, where)
    theta = fields.pop("rope_theta")
    return {
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        **common.model_fields(model),
        "mamba_d_ssm": fields["mamba_n_heads"] * fields["mamba_d_head"],
        "projectors_bias": fields["mamba_proj_bias"],
        "rms_norm_eps": mamba2.one_epsilon(model),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "embedding_multiplier": model.embedding_multiplier,
        "lm_head_multiplier": 1.0 / model.logits_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        **fields,
    }


ROUNDED = ("key_multiplier", "lm_head_multiplier")  # recomputed from a product or a quotient


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: ``config_from_model``'s fields
    over ``config``'s others (``eos_token_id``, ``max_position_embeddings``, ...).

    Raises:
      ValueError: ``config_from_model``'s, or a field of ``config`` that describes another
        model (named).
    """
    derived = config_from_model(model)
    for field in ROUNDED if config is not None else ():
        given = config.get(field)
        if common.is_number(given) and abs(derived[field] - given) <= 1e-12 * abs(given):
            derived[field] = given
    merged = common.merge_for_save(derived, config, mamba2.UNCHECKED)
    return normalize_config(merged)


FORMAT = common.ModelFormat(
    name="Falcon-H1",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=(PREFIX,),
    ignored_prefixes=common.tied_head_ignored,
    finish=finish,
)
