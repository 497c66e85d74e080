"""Mamba-2 checkpoints in Hugging Face format (``Mamba2ForCausalLM``, ``model_type``
``mamba2``) <-> ``LanguageModel``: the config's fields as the model's options, and the one
table of weights.

A Mamba-2 model is ``num_hidden_layers`` blocks of ``x + mixer(RMSNorm(x))`` (no MLP: our
blocks with ``mlp="none"``) between the embedding and a final RMSNorm, every mixer our
``layers.Mamba2Mixer`` (``attention="mamba2"``). Its conventions, each mapped to an option
of ours:

* ``in_proj`` makes ``[z | x | B | C | dt]`` (``intermediate_size``, the same, ``n_groups *
  state_size`` twice, ``num_heads``) as our ``in_proj``; the depthwise ``conv1d`` over
  ``[x | B | C]`` is ``[c, 1, k]``, our ``conv.kernel`` ``[k, c]``, its bias our
  ``conv_bias``;
* ``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)`` clipped to ``time_step_limit``;
  ``D`` the skip; ``norm`` the gated RMSNorm over ``n_groups`` groups (the gate first);
* every RMSNorm's epsilon is ``layer_norm_epsilon``;
* ``nn.Linear`` weights are ``[out, in]``, our kernels ``[in, out]`` (a transpose).

The tensors live under ``backbone.`` (``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR, Rule

MODEL_TYPES = ("mamba2",)
PREFIX = "backbone."

# The weight table: model-level rows, then each layer's.
MODEL_RULES = tables.rules(
    ("embeddings.weight", "embed.embedding", COPY),
    ("norm_f.weight", "norm.scale", COPY),
)
BLOCK_RULES = tables.rules(("norm.weight", "attention_norm.scale", COPY))
# A Mamba-2 mixer's rows, under its Hugging Face prefix ("mixer.", Bamba's "mamba.") and our
# "attention." (``mixer_rules``); Bamba and Nemotron-H read them too.
MIXER_RULES = tables.rules(
    ("in_proj.weight", "in_proj.kernel", LINEAR),
    ("conv1d.weight", "conv.kernel", CONV),
    ("dt_bias", "dt_bias", COPY),
    ("A_log", "A_log", COPY),
    ("D", "D", COPY),
    ("norm.weight", "norm.weight", COPY),
    ("out_proj.weight", "out_proj.kernel", LINEAR),
)
CONV_BIAS_RULES = tables.rules(("conv1d.bias", "conv_bias", COPY))
BIAS_RULES = tables.rules(
    ("in_proj.bias", "in_proj.bias", COPY),
    ("out_proj.bias", "out_proj.bias", COPY),
)


def mixer_rules(hf_prefix: str, *, conv_bias: bool, bias: bool) -> tuple[Rule, ...]:
    """A mixer's rows: Hugging Face names under ``hf_prefix``, ours under ``attention.``."""
    rows = MIXER_RULES + (CONV_BIAS_RULES if conv_bias else ()) + (BIAS_RULES if bias else ())
    return tables.under(rows, hf_prefix, "attention.")


def layer_rules(config: Mapping[str, Any], i: int) -> tuple[Rule, ...]:
    """Layer ``i``'s rows: its norm and its mixer."""
    return BLOCK_RULES + mixer_rules(
        "mixer.", conv_bias=config["use_conv_bias"], bias=config["use_bias"]
    )


# ---------------------------------------------------------------------------- the config

# transformers' Mamba2Config defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    layer_norm_epsilon=1e-5, expand=2, conv_kernel=4, n_groups=8, use_bias=False,
    use_conv_bias=True, hidden_act="silu", residual_in_fp32=True, tie_word_embeddings=False,
    time_step_limit=[0.0, math.inf], num_heads=128, head_dim=64, state_size=128,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size",
    "n_groups", "conv_kernel", "expand",
)  # fmt: skip


def decode_time_step_limit(config: common.Config) -> None:
    """``config.json``'s ``time_step_limit`` as a list of floats: ``transformers`` writes an
    infinite bound as ``{"__float__": "Infinity"}``; anything else is left for the checks."""
    value = config["time_step_limit"]
    if isinstance(value, list | tuple):
        decode = lambda x: (
            float(x["__float__"]) if isinstance(x, Mapping) and "__float__" in x else x
        )
        config["time_step_limit"] = [decode(x) for x in value]


def inner_width(expand: str, heads: str, head_dim: str) -> common.Step:
    """The step checking that the mixer's inner width ``hidden_size * config[expand]`` is
    ``config[heads] * config[head_dim]`` (the fields' names: Mamba-2's or a hybrid's)."""

    def step(config: common.Config) -> None:
        inner = config["hidden_size"] * config[expand]
        if inner != config[heads] * config[head_dim]:
            raise ValueError(
                f"config.json: hidden_size * {expand} ({inner}) must equal {heads} * {head_dim} "
                f"({config[heads] * config[head_dim]})"
            )

    return step


def epsilon_and_limit(eps_field: str) -> common.Step:
    """The step checking the norms' epsilon ``config[eps_field]`` (a number in (0, 1)) and
    ``time_step_limit`` (``[low, high]``, ``0 <= low <= high``): the mixer's own checks,
    which the hybrids make too."""

    def step(config: common.Config) -> None:
        common.check_number(config, eps_field, 0, 1)
        limit = config["time_step_limit"]
        ok = len(limit) == 2 and all(common.is_number(x) for x in limit)
        if not ok or not 0 <= limit[0] <= limit[1]:
            raise ValueError(
                "config.json: time_step_limit must be [low, high] with 0 <= low <= high, got "
                f"{limit!r}"
            )

    return step


def mixer_options(*, time_step_limit, norm_eps, **sizes) -> dict[str, Any]:
    """``Mamba2Mixer``'s options (``kind_options["mamba2"]``), the limits and epsilon as
    floats."""
    low, high = time_step_limit
    return dict(**sizes, time_step_limit=(float(low), float(high)), norm_eps=float(norm_eps))


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer a ``Mamba2Mixer`` block without an MLP."""
    return dict(
        num_heads=config["num_heads"],
        attention="mamba2",
        kind_options={
            "mamba2": mixer_options(
                head_dim=config["head_dim"],
                state_dim=config["state_size"],
                n_groups=config["n_groups"],
                conv_size=config["conv_kernel"],
                use_conv_bias=config["use_conv_bias"],
                use_bias=config["use_bias"],
                time_step_limit=config["time_step_limit"],
                norm_eps=config["layer_norm_epsilon"],
            )
        },
        mlp="none",
    )


FORMAT = common.ModelFormat(
    name="Mamba-2",
    model_types=MODEL_TYPES,
    architecture="Mamba2ForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        decode_time_step_limit,
        common.ints(INT_FIELDS),
        inner_width("expand", "num_heads", "head_dim"),
        common.divides("n_groups", "num_heads"),
        common.choice("hidden_act", ("silu",)),
        common.bools(("use_bias", "use_conv_bias", "tie_word_embeddings", "residual_in_fp32")),
        epsilon_and_limit("layer_norm_epsilon"),
    ),
    options=options,
    table=tables.layered(MODEL_RULES, layer_rules),
    prefixes=(PREFIX,),
    # The blocks' and the final RMSNorm's (the mixers' gated norms take it as norm_eps).
    finish=common.rms_norm_eps("layer_norm_epsilon"),
)
