"""Mamba checkpoints in Hugging Face format (``MambaForCausalLM``, ``model_type`` ``mamba``)
<-> ``LanguageModel``: the config's fields as the model's options, and the one table of
weights.

A Mamba model is ``num_hidden_layers`` blocks of ``x + mixer(RMSNorm(x))`` (no MLP: our
blocks with ``mlp="none"``) between the embedding and a final RMSNorm (Mamba-2's frame,
``hf.mamba2``'s model and block rows), every mixer our ``layers.MambaMixer``
(``attention="mamba"``, ``ops.selective``). Its conventions, each mapped to an option of
ours:

* ``in_proj`` makes ``[x | z]`` (``intermediate_size`` each, ``expand * hidden_size``) as
  our ``in_proj``; the depthwise ``conv1d`` over x is ``[inner, 1, k]``, our
  ``conv.kernel`` ``[k, inner]``, its bias our ``conv_bias``;
* ``x_proj`` makes ``[dt | B | C]`` (``time_step_rank``, ``"auto"``: ``ceil(hidden_size /
  16)``; ``state_size`` twice), ``dt = softplus(dt_proj(dt))`` with ``dt_proj``'s bias;
* ``A = -exp(A_log)`` ``[inner, state_size]``; ``D`` the skip; the output gated by
  ``SiLU(z)``;
* every RMSNorm's epsilon is ``layer_norm_epsilon``; the head is tied by default;
* ``nn.Linear`` weights are ``[out, in]``, our kernels ``[in, out]`` (a transpose).

``use_mambapy`` and ``use_associative_scan`` choose how ``transformers`` runs the same scan;
the ``time_step_*`` and ``initializer_range`` fields only initialise. The tensors live
under ``backbone.`` (``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, mamba2, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR, Rule

MODEL_TYPES = ("mamba",)

# A Mamba-1 mixer's rows, under its Hugging Face prefix ("mixer.", Jamba's "mamba.") and
# our "attention." (``mixer_rules``).
MIXER_RULES = tables.rules(
    ("in_proj.weight", "in_proj.kernel", LINEAR),
    ("conv1d.weight", "conv.kernel", CONV),
    ("x_proj.weight", "x_proj.kernel", LINEAR),
    ("dt_proj.weight", "dt_proj.kernel", LINEAR),
    ("dt_proj.bias", "dt_proj.bias", COPY),
    ("A_log", "A_log", COPY),
    ("D", "D", COPY),
    ("out_proj.weight", "out_proj.kernel", LINEAR),
)


def mixer_rules(hf_prefix: str, *, conv_bias: bool, bias: bool) -> tuple[Rule, ...]:
    """A mixer's rows: Hugging Face names under ``hf_prefix``, ours under ``attention.``."""
    rows = MIXER_RULES + (mamba2.CONV_BIAS_RULES if conv_bias else ())
    rows += mamba2.BIAS_RULES if bias else ()
    return tables.under(rows, hf_prefix, "attention.")


def layer_rules(config: Mapping[str, Any], i: int) -> tuple[Rule, ...]:
    """Layer ``i``'s rows: its norm and its mixer."""
    return mamba2.BLOCK_RULES + mixer_rules(
        "mixer.", conv_bias=config["use_conv_bias"], bias=config["use_bias"]
    )


# transformers' MambaConfig defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    hidden_size=768, state_size=16, num_hidden_layers=32, layer_norm_epsilon=1e-5,
    expand=2, conv_kernel=4, use_bias=False, use_conv_bias=True, hidden_act="silu",
    residual_in_fp32=True, time_step_rank="auto", tie_word_embeddings=True,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "state_size", "expand", "conv_kernel",
    "time_step_rank",
)  # fmt: skip


def time_step_rank(config: common.Config) -> None:
    """``time_step_rank`` ``"auto"`` as ``transformers`` derives it, ``ceil(hidden_size /
    16)``, and ``intermediate_size`` as ``expand * hidden_size`` (``transformers`` derives
    it whatever ``config.json`` says)."""
    if config["time_step_rank"] == "auto" and common.is_int(config["hidden_size"]):
        config["time_step_rank"] = math.ceil(config["hidden_size"] / 16)
    if common.is_int(config["hidden_size"]) and common.is_int(config["expand"]):
        config["intermediate_size"] = config["expand"] * config["hidden_size"]


def mixer_options(config: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """``MambaMixer``'s options (``kind_options["mamba"]``) of a checked config."""
    return dict(
        expand=config["expand"],
        state_dim=config["state_size"],
        dt_rank=config["time_step_rank"],
        conv_size=config["conv_kernel"],
        use_conv_bias=config["use_conv_bias"],
        use_bias=config["use_bias"],
        **extra,
    )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer a ``MambaMixer`` block without an MLP."""
    return dict(
        num_heads=1, attention="mamba", kind_options={"mamba": mixer_options(config)}, mlp="none"
    )


FORMAT = common.ModelFormat(
    name="Mamba",
    model_types=MODEL_TYPES,
    architecture="MambaForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        time_step_rank,
        common.ints(INT_FIELDS),
        common.choice("hidden_act", ("silu",)),
        common.bools(("use_bias", "use_conv_bias", "tie_word_embeddings", "residual_in_fp32")),
        lambda config: common.check_number(config, "layer_norm_epsilon", 0, 1),
    ),
    options=options,
    table=tables.layered(mamba2.MODEL_RULES, layer_rules),
    prefixes=(mamba2.PREFIX,),
    finish=common.rms_norm_eps("layer_norm_epsilon"),
)
