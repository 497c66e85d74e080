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

import jax.numpy as jnp
from flax import nnx

from linattn_jax.hf import common
from linattn_jax.hf.common import Rule
from linattn_jax.layers.mamba2 import GroupedGatedRMSNorm

MODEL_TYPES = ("mamba2",)
PREFIX = "backbone."
IGNORED_PREFIXES = ()


# The weight table: model-level rows, then each layer's.
MODEL_RULES = common.rules(
    ("embeddings.weight", "embed.embedding", "copy"),
    ("norm_f.weight", "norm.scale", "copy"),
)
HEAD_RULE = common.HEAD_RULE  # untied only; no prefix
BLOCK_RULES = common.rules(("norm.weight", "attention_norm.scale", "copy"))
# A Mamba-2 mixer's rows, under its Hugging Face prefix ("mixer.", Bamba's "mamba.") and our
# "attention." (``mixer_rules``); Bamba and Nemotron-H read them too.
MIXER_RULES = common.rules(
    ("in_proj.weight", "in_proj.kernel", "linear"),
    ("conv1d.weight", "conv.kernel", "conv"),
    ("dt_bias", "dt_bias", "copy"),
    ("A_log", "A_log", "copy"),
    ("D", "D", "copy"),
    ("norm.weight", "norm.weight", "copy"),
    ("out_proj.weight", "out_proj.kernel", "linear"),
)
CONV_BIAS_RULES = common.rules(("conv1d.bias", "conv_bias", "copy"))
BIAS_RULES = common.rules(
    ("in_proj.bias", "in_proj.bias", "copy"),
    ("out_proj.bias", "out_proj.bias", "copy"),
)


def mixer_rules(hf_prefix: str, *, conv_bias: bool, bias: bool) -> tuple[Rule, ...]:
    """A mixer's rows: Hugging Face names under ``hf_prefix``, ours under ``attention.``."""
    rows = MIXER_RULES + (CONV_BIAS_RULES if conv_bias else ()) + (BIAS_RULES if bias else ())
    return tuple(r.at(hf_prefix + r.hf, ["attention." + p for p in r.ours]) for r in rows)


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, Rule]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s): ``(its full
    Hugging Face name, the Rule with our full paths)``, in the model's order."""
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    mixer = mixer_rules("mixer.", conv_bias=config["use_conv_bias"], bias=config["use_bias"])
    for i in range(config["num_hidden_layers"]):
        rows += common.prefixed(BLOCK_RULES + mixer, f"{prefix}layers.{i}.", f"blocks.{i}.")
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


# ---------------------------------------------------------------------------- the config

DEFAULTS = dict(
    layer_norm_epsilon=1e-5,
    expand=2,
    conv_kernel=4,
    n_groups=8,
    use_bias=False,
    use_conv_bias=True,
    hidden_act="silu",
    residual_in_fp32=True,
    tie_word_embeddings=False,
    time_step_limit=[0.0, math.inf],
    num_heads=128,
    head_dim=64,
    state_size=128,
)  # fmt: skip  (transformers' Mamba2Config defaults, for fields a config.json leaves out)
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "state_size",
    "n_groups", "conv_kernel", "expand",
)  # fmt: skip


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in, checked.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    config = common.with_defaults(raw, MODEL_TYPES, DEFAULTS)
    config["time_step_limit"] = time_step_limit(config["time_step_limit"])
    check_config(config)
    return config


def time_step_limit(value) -> Any:
    """``config.json``'s ``time_step_limit`` as a list of floats: ``transformers`` writes an
    infinite bound as ``{"__float__": "Infinity"}``; anything else is left for the checks."""
    if not isinstance(value, list | tuple):
        return value
    decode = lambda x: float(x["__float__"]) if isinstance(x, Mapping) and "__float__" in x else x
    return [decode(x) for x in value]


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` that is missing, of the wrong
    type, or that we do not support."""
    common.check_ints(config, INT_FIELDS)
    check_inner_width(config, "expand", "num_heads", "head_dim")
    common.check_divides(config, "n_groups", "num_heads")
    common.check_choice(config, "hidden_act", ("silu",))
    common.check_bools(
        config, ("use_bias", "use_conv_bias", "tie_word_embeddings", "residual_in_fp32")
    )
    check_epsilon_and_limit(config["layer_norm_epsilon"], config["time_step_limit"])


def check_inner_width(config: Mapping[str, Any], expand: str, heads: str, head_dim: str) -> None:
    """Raises ``ValueError`` unless the mixer's inner width ``hidden_size * config[expand]``
    is ``config[heads] * config[head_dim]`` (the fields' names: Mamba-2's or a hybrid's)."""
    inner = config["hidden_size"] * config[expand]
    if inner != config[heads] * config[head_dim]:
        raise ValueError(
            f"config.json: hidden_size * {expand} ({inner}) must equal {heads} * {head_dim} "
            f"({config[heads] * config[head_dim]})"
        )


def check_epsilon_and_limit(eps, limit) -> None:
    """Raises ``ValueError`` unless ``eps`` (the norms' epsilon, ``layer_norm_epsilon``) is a
    number in (0, 1) and ``limit`` (``time_step_limit``) is ``[low, high]``, ``0 <= low <=
    high``: the mixer's own checks, which the hybrids' configs make under other names."""
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise ValueError(f"config.json: layer_norm_epsilon must be a number in (0, 1), got {eps!r}")
    ok = len(limit) == 2 and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in limit
    )
    if not ok or not 0 <= limit[0] <= limit[1]:
        raise ValueError(
            f"config.json: time_step_limit must be [low, high] with 0 <= low <= high, got {limit!r}"
        )


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``normalize_config`` config:
    the computation in ``dtype``, the parameters in ``param_dtype`` (None: ``dtype``). The
    blocks' and the final RMSNorm's epsilon is not an option: ``finish`` sets it on the
    built model."""
    return common.language_model_options(
        config,
        dtype,
        param_dtype,
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


def mixer_options(*, time_step_limit, norm_eps, **sizes) -> dict[str, Any]:
    """``Mamba2Mixer``'s options (``kind_options["mamba2"]``), the limits and epsilon as
    floats."""
    low, high = time_step_limit
    return dict(**sizes, time_step_limit=(float(low), float(high)), norm_eps=float(norm_eps))


def mixer_fields(mixer) -> dict[str, Any]:
    """A ``Mamba2Mixer``'s sizes and options under Mamba-2's config names."""
    return {
        "num_heads": mixer.num_heads,
        "head_dim": mixer.head_dim,
        "state_size": mixer.state_dim,
        "n_groups": mixer.n_groups,
        "conv_kernel": mixer.conv.size,
        "use_conv_bias": mixer.conv_bias is not None,
        "use_bias": mixer.in_proj.use_bias,
        "time_step_limit": list(mixer.time_step_limit),
    }


# ------------------------------------------- the hybrids' mixers (Bamba, Granite-4.0-H, Falcon-H1)

# Their config's names of the mixer's fields (Bamba's), by ``mixer_fields``' names.
HYBRID_FIELDS = {
    "num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "state_size": "mamba_d_state",
    "n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv",
    "use_conv_bias": "mamba_conv_bias", "use_bias": "mamba_proj_bias",
    "time_step_limit": "time_step_limit",
}  # fmt: skip


# transformers' defaults of the mixer's fields, alike in Bamba's, Granite-4.0-H's and
# Falcon-H1's configs (``"auto"``: ``auto_head_dim``, or Falcon-H1's own).
HYBRID_DEFAULTS = dict(
    mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256,
    mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False,
    time_step_limit=[0.0, math.inf],
)  # fmt: skip


def hybrid_mixer_rules(config: Mapping[str, Any]) -> tuple[Rule, ...]:
    """A hybrid's mixer rows (``mixer_rules`` under ``mamba.``) for its config's biases."""
    bias = config["mamba_proj_bias"]
    return mixer_rules("mamba.", conv_bias=config["mamba_conv_bias"], bias=bias)


def hybrid_defaults(config: dict[str, Any]) -> None:
    """Fills in, in place, what ``transformers`` derives alike for a hybrid's config:
    ``num_key_value_heads`` (``num_attention_heads`` when absent), ``time_step_limit``
    decoded (``time_step_limit``), ``rope_parameters``' ``rope_type`` (``"default"``) and
    ``rope_theta`` (the top-level ``rope_theta``, else 10000)."""
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config.get("num_attention_heads")
    config["time_step_limit"] = time_step_limit(config["time_step_limit"])
    config["rope_parameters"] = common.rope_parameters(config, 10000.0)


def auto_head_dim(config: dict[str, Any]) -> None:
    """Fills in, in place, a ``mamba_d_head`` of ``"auto"`` as Bamba and Granite-4.0-H do:
    ``mamba_expand * hidden_size // mamba_n_heads`` (left for the checks where
    ``hidden_size`` is not an int)."""
    if config["mamba_d_head"] == "auto" and common.is_int(config.get("hidden_size")):
        heads = config["mamba_n_heads"]
        config["mamba_d_head"] = config["mamba_expand"] * config["hidden_size"] // heads


def hybrid_mixer_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """A hybrid's ``Mamba2Mixer`` options (``num_heads`` and ``mixer_options``), its norms'
    epsilon ``rms_norm_eps``."""
    return dict(
        num_heads=config["mamba_n_heads"],
        **mixer_options(
            head_dim=config["mamba_d_head"],
            state_dim=config["mamba_d_state"],
            n_groups=config["mamba_n_groups"],
            conv_size=config["mamba_d_conv"],
            use_conv_bias=config["mamba_conv_bias"],
            use_bias=config["mamba_proj_bias"],
            time_step_limit=config["time_step_limit"],
            norm_eps=config["rms_norm_eps"],
        ),
    )


def agree_hybrid_mixer(fields: dict[str, Any], mixer, where: str) -> None:
    """``common.agree`` on each of ``mixer``'s fields under the hybrids' names."""
    for field, value in mixer_fields(mixer).items():
        common.agree(fields, HYBRID_FIELDS[field], value, where)


def hybrid_expand(fields: Mapping[str, Any], width: int, name: str) -> int:
    """``mamba_expand`` of the fields a hybrid read from its mixers: their inner width over
    ``width``.

    Raises:
      ValueError: no mixer was read (``name`` needs one) or an inner width not a multiple
        of ``width``.
    """
    heads = fields.get("mamba_n_heads")
    if heads is None:
        raise ValueError(f"{name} needs at least one mamba2 layer")
    inner = heads * fields["mamba_d_head"]
    if inner % width:
        raise ValueError(f"mamba heads * head_dim={inner} must be a multiple of the width {width}")
    return inner // width


def one_epsilon(model) -> float:
    """The one epsilon of every RMSNorm of ``model`` (the blocks', the final and the mixers'
    gated norms), as these model types have.

    Raises:
      ValueError: norms with different epsilons (named), e.g. a model built from
        ``model_options`` without ``finish``.
    """
    found = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.RMSNorm | GroupedGatedRMSNorm):
            found.setdefault(float(node.epsilon), ".".join(map(str, path)))
    if len(found) > 1:
        where = ", ".join(f"{p} {eps:g}" for eps, p in found.items())
        raise ValueError(
            f"the model's RMSNorms have different epsilons ({where}); the config has one (a "
            "model built from model_options takes it from its module's finish(model, config))"
        )
    return next(iter(found))


def finish(model, config: Mapping[str, Any]) -> None:
    """Sets the blocks' and the final RMSNorm's epsilon to ``layer_norm_epsilon`` (the
    layers take no epsilon option; the mixers' gated norms take it as ``norm_eps``)."""
    common.set_rms_norm_epsilon(model, config["layer_norm_epsilon"])


def config_from_model(model) -> dict[str, Any]:
    """The ``mamba2`` config of a ``LanguageModel`` in Mamba-2's form (its dimensions read
    from the layers).

    Raises:
      ValueError: a model not of that form (scanned layers, a kind other than ``mamba2``,
        an MLP or a short convolution in a block, zero-centred norms, layers of different
        sizes), naming what differs.
    """
    common.check_unrolled(model)
    fields: dict[str, Any] = {}
    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where = f"blocks[{i}]"
        if kind != "mamba2":
            raise ValueError(f"{where}: Mamba-2 models have only mamba2 layers, got {kind!r}")
        if block.mlp is not None or block.conv is not None:
            raise ValueError(
                f"{where}: Mamba-2's blocks have no MLP (mlp='none') and no short_conv"
            )
        if block.attention_norm.zero_centred:
            raise ValueError(f"{where}: Mamba-2's RMSNorms are not zero-centred")
        for field, value in mixer_fields(block.attention).items():
            common.agree(fields, field, value, where)
    width = model.embed.features
    inner = fields["num_heads"] * fields["head_dim"]
    if inner % width:
        raise ValueError(f"num_heads * head_dim={inner} must be a multiple of the width {width}")
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        **common.model_fields(model),
        "expand": inner // width,
        "layer_norm_epsilon": one_epsilon(model),
        "hidden_act": "silu",
        **fields,
    }


UNCHECKED = ("architectures", "dtype", "model_type")  # save_pretrained writes the model's


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: ``config_from_model``'s fields
    over ``config``'s others (``eos_token_id``, ``chunk_size``, ...).

    Raises:
      ValueError: ``config_from_model``'s, or a field of ``config`` that describes another
        model (named).
    """
    return normalize_config(common.merge_for_save(config_from_model(model), config, UNCHECKED))


FORMAT = common.ModelFormat(
    name="Mamba-2",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=(PREFIX,),
    ignored_prefixes=common.tied_head_ignored,
    finish=finish,
)
