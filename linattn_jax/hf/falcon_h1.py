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
  logits times it) is our ``logits_scaling = 1 / lm_head_multiplier``;
* attention is Llama's (GQA, no biases, RoPE on whole heads); every RMSNorm's epsilon is
  ``rms_norm_eps``; ``nn.Linear`` weights are ``[out, in]``, our kernels ``[in, out]``.

The tensors live under ``model.`` (``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import bamba, common, mamba2, tables
from linattn_jax.hf.tables import Rule

MODEL_TYPES = ("falcon_h1",)
SCALARS = (
    "embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
    "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
)  # fmt: skip


def layer_rules(config: Mapping[str, Any], i: int) -> tuple[Rule, ...]:
    """Every layer's rows: Bamba's norms and MLP, its attention, and its mixer under our
    ``parallel.`` (the grouped norm only with ``mamba_rms_norm``)."""
    mixer = tuple(
        r.at(r.hf, ["parallel." + p.removeprefix("attention.") for p in r.ours])
        for r in bamba.hybrid_mixer_rules(config)
        if config["mamba_rms_norm"] or r.hf != "mamba.norm.weight"
    )
    return bamba.BLOCK_RULES + bamba.ATTENTION_RULES + mixer


# ---------------------------------------------------------------------------- the config

# transformers' FalconH1Config defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-5, num_key_value_heads=8,
    mamba_d_ssm=1024, mamba_norm_before_gate=True, mamba_rms_norm=False, projectors_bias=False,
    lm_head_multiplier=1.0, embedding_multiplier=1.0, mlp_multipliers=[1.0, 1.0],
    key_multiplier=1.0, attention_out_multiplier=1.0, attention_in_multiplier=1.0,
    ssm_multipliers=[1.0, 1.0, 1.0, 1.0, 1.0], ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
    attention_bias=False, mlp_bias=False, **bamba.HYBRID_DEFAULTS,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "mamba_n_heads", "mamba_d_head",
    "mamba_d_ssm", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
)  # fmt: skip
BOOL_FIELDS = (
    "mamba_conv_bias", "mamba_proj_bias", "projectors_bias", "mamba_rms_norm",
    "mamba_norm_before_gate", "tie_word_embeddings",
)  # fmt: skip


def widths(config: common.Config) -> None:
    """``mamba_d_ssm`` (``mamba_expand * hidden_size`` when null), ``mamba_d_head``
    (``mamba_d_ssm / mamba_n_heads`` for ``"auto"``), ``head_dim`` (``hidden_size /
    num_attention_heads`` when absent), as ``transformers`` derives them; every layer is
    ``"hybrid"`` (``layers_block_type`` dropped)."""
    if config["mamba_d_ssm"] is None and common.is_int(config.get("hidden_size")):
        config["mamba_d_ssm"] = config["mamba_expand"] * config["hidden_size"]
    if config["mamba_d_head"] == "auto" and common.is_int(config.get("mamba_d_ssm")):
        config["mamba_d_head"] = config["mamba_d_ssm"] // config["mamba_n_heads"]
    if config.get("head_dim") is None and common.is_int(config.get("hidden_size")):
        config["head_dim"] = config["hidden_size"] // config.get("num_attention_heads", 1)
    config.pop("layers_block_type", None)


def check_sizes(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming an inconsistent width, multiplier list or bias."""
    if config["mamba_d_ssm"] != config["mamba_n_heads"] * config["mamba_d_head"]:
        raise ValueError(
            f"config.json: mamba_d_ssm ({config['mamba_d_ssm']}) must equal mamba_n_heads * "
            f"mamba_d_head ({config['mamba_n_heads'] * config['mamba_d_head']})"
        )
    common.check_divides(config, "mamba_n_groups", "mamba_n_heads")
    common.check_divides(config, "num_key_value_heads", "num_attention_heads")
    common.check_positive(config, SCALARS)
    for field, length in (("mlp_multipliers", 2), ("ssm_multipliers", 5)):
        value = config[field]
        ok = isinstance(value, list | tuple) and len(value) == length
        if not ok or not all(common.is_number(v) and 0 < v < math.inf for v in value):
            raise ValueError(
                f"config.json: {field} must list {length} finite numbers > 0, got {value!r}"
            )


def check_biases(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless ``out_proj`` and ``in_proj`` have biases alike."""
    if config["projectors_bias"] != config["mamba_proj_bias"]:
        raise ValueError(
            "config.json: projectors_bias (out_proj's bias) must equal mamba_proj_bias "
            f"(in_proj's), got {config['projectors_bias']!r} and {config['mamba_proj_bias']!r}"
        )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer attention and a Mamba-2 mixer side by side (``parallel``), with
    Falcon-H1's multipliers."""
    head_dim = config["head_dim"]
    norm = "none"
    if config["mamba_rms_norm"]:
        norm = "norm_first" if config["mamba_norm_before_gate"] else "gate_first"
    mixer = dict(
        attention="mamba2",
        norm=norm,
        projection_multipliers=tuple(float(m) for m in config["ssm_multipliers"]),
        **bamba.hybrid_mixer_options(config),
    )
    softmax = dict(
        num_heads=config["num_attention_heads"],
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
    return dict(
        num_heads=config["num_attention_heads"],
        attention="softmax",
        kind_options={"softmax": softmax},
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
        mlp_multipliers=tuple(float(m) for m in config["mlp_multipliers"]),
        embedding_multiplier=float(config["embedding_multiplier"]),
        logits_scaling=1.0 / float(config["lm_head_multiplier"]),
    )


FORMAT = bamba.FORMAT.derive(
    name="Falcon-H1",
    model_types=MODEL_TYPES,
    architecture="FalconH1ForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=("mamba_d_ssm",)),
        widths,
        bamba.hybrid_defaults,
        common.ints(INT_FIELDS),
        check_sizes,
        common.choice("hidden_act", ("silu",)),
        common.false(("attention_bias", "mlp_bias")),
        common.bools(BOOL_FIELDS),
        check_biases,
        mamba2.epsilon_and_limit("rms_norm_eps"),
        bamba.check_default_rope,
    ),
    options=options,
    table=tables.layered(bamba.MODEL_RULES, layer_rules),
)
