"""Nemotron-H checkpoints in Hugging Face format (``NemotronHForCausalLM``, ``model_type``
``nemotron_h``), its dense layer types, <-> ``LanguageModel``: the config's fields as the
model's options, and the one table of weights.

Every Nemotron-H layer is ``x + mixer(RMSNorm(x))`` with one mixer per layer type
(``layers_block_type``, or the legacy ``hybrid_override_pattern`` string ``"M-M*-"``):

* ``"linear_attention"`` (``M``): a Mamba-2 mixer (``hf.mamba2``'s rows under ``mixer.``),
  our ``"mamba2"`` block with ``mlp="none"``; ``in_proj``/``out_proj`` biases are
  ``use_bias``, ``dt`` is clipped below at ``time_step_min`` (not ``time_step_limit``);
* ``"full_attention"`` (``*``): GQA softmax attention without positional encoding (no
  RoPE) and without biases, our ``"softmax"`` block with ``mlp="none"``;
* ``"mlp"`` (``-``): a squared-ReLU MLP (``up_proj``, ``down_proj``), our ``"mlp"`` block
  with ``mlp="relu2"`` (its norm is our ``mlp_norm``);
* ``"moe"`` (``E``): refused by name until the mixture-of-experts layers land.

Every RMSNorm's epsilon is ``layer_norm_epsilon``. The tensors live under ``backbone.`` (as
``transformers`` saves them; ``model.``, its module names, is read too), ``lm_head.weight``
apart (untied only); multi-token-prediction heads (``mtp.``) are not read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from linattn_jax.hf import common, mamba2

MODEL_TYPES = ("nemotron_h",)
PREFIX = "backbone."  # as transformers writes it; it reads "model." too
LAYER_KINDS = {"linear_attention": "mamba2", "full_attention": "softmax", "mlp": "mlp"}
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}

MODEL_RULES = common.rules(
    ("embeddings.weight", "embed.embedding", "copy"),
    ("norm_f.weight", "norm.scale", "copy"),
)
HEAD_RULE = mamba2.HEAD_RULE
ATTENTION_RULES = common.rules(
    ("norm.weight", "attention_norm.scale", "copy"),
    ("mixer.q_proj.weight", "attention.q_proj.kernel", "linear"),
    ("mixer.k_proj.weight", "attention.k_proj.kernel", "linear"),
    ("mixer.v_proj.weight", "attention.v_proj.kernel", "linear"),
    ("mixer.o_proj.weight", "attention.out_proj.kernel", "linear"),
)
MLP_RULES = common.rules(
    ("norm.weight", "mlp_norm.scale", "copy"),
    ("mixer.up_proj.weight", "mlp.up_proj.kernel", "linear"),
    ("mixer.down_proj.weight", "mlp.down_proj.kernel", "linear"),
)


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, common.Rule]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s): ``(its full
    Hugging Face name, the Rule with our full paths)``, in the model's order."""
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    mamba = mamba2.BLOCK_RULES + mamba2.mixer_rules(
        "mixer.", conv_bias=config["use_conv_bias"], bias=config["use_bias"]
    )
    own = {"linear_attention": mamba, "full_attention": ATTENTION_RULES, "mlp": MLP_RULES}
    for i, layer_type in enumerate(config["layers_block_type"]):
        rows += common.prefixed(own[layer_type], f"{prefix}layers.{i}.", f"blocks.{i}.")
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


# ---------------------------------------------------------------------------- the config

DEFAULTS = dict(
    tie_word_embeddings=False,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    attention_bias=False,
    sliding_window=None,
    intermediate_size=21504,
    mlp_hidden_act="relu2",
    mlp_bias=False,
    ssm_state_size=128,
    mamba_num_heads=128,
    mamba_head_dim=64,
    mamba_hidden_act="silu",
    n_groups=8,
    conv_kernel=4,
    time_step_min=0.001,
    use_conv_bias=True,
    use_bias=False,
    layer_norm_epsilon=1e-5,
)  # fmt: skip  (transformers' NemotronHConfig defaults, for fields a config.json leaves out)
LEGACY = dict(
    mamba_n_groups="n_groups",
    mamba_d_conv="conv_kernel",
    mamba_dt_min="time_step_min",
    mamba_conv_bias="use_conv_bias",
)  # fmt: skip  (old names transformers still reads)
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups",
    "conv_kernel",
)  # fmt: skip
SUPPORTED = dict(
    mamba_hidden_act="silu", mlp_hidden_act="relu2", attention_bias=False, mlp_bias=False
)


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in (and its legacy
    names and ``hybrid_override_pattern`` read as ``transformers`` reads them), checked.

    Raises:
      ValueError: an unknown ``model_type``, a ``moe`` layer, or a field missing, of the
        wrong type or unsupported, named.
    """
    common.check_model_type(raw, MODEL_TYPES)
    config = {k: v for k, v in raw.items() if v is not None or k not in DEFAULTS}
    for old, new in LEGACY.items():
        if old in config:
            config[new] = config.pop(old)
    config = {**DEFAULTS, **config}
    pattern = config.pop("hybrid_override_pattern", None)
    if config.get("layers_block_type") is None and isinstance(pattern, str):
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise ValueError(
                f"config.json: hybrid_override_pattern must use {sorted(PATTERN)}, got {unknown}"
            )
        config["layers_block_type"] = [PATTERN[c] for c in pattern]
    config.pop("num_hidden_layers", None)  # transformers: the length of layers_block_type
    check_config(config)
    return config


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` that is missing, of the wrong
    type, or that we do not support."""
    common.check_ints(config, INT_FIELDS)
    types = config.get("layers_block_type")
    if not isinstance(types, list) or not types:
        raise ValueError(
            f"config.json: layers_block_type must be a list of layer types, got {types!r}"
        )
    if "moe" in types:
        raise ValueError(
            "config.json: layers_block_type has 'moe' layers, which are not supported yet "
            "(the mixture-of-experts MLP is another issue); dense layer types: "
            f"{sorted(LAYER_KINDS)}"
        )
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(
            f"config.json: layers_block_type must be in {sorted(LAYER_KINDS)}, got {unknown}"
        )
    common.check_divides(config, "n_groups", "mamba_num_heads")
    common.check_divides(config, "num_key_value_heads", "num_attention_heads")
    common.check_unsupported(config, SUPPORTED)
    if config.get("sliding_window") is not None:
        raise ValueError(
            f"config.json: sliding_window must be null, got {config['sliding_window']!r}"
        )
    common.check_bools(config, ("use_conv_bias", "use_bias", "tie_word_embeddings"))
    low = config["time_step_min"]
    if not common.is_number(low) or low < 0:
        raise ValueError(f"config.json: time_step_min must be a number >= 0, got {low!r}")
    eps = config["layer_norm_epsilon"]
    if not common.is_number(eps) or not 0 < eps < 1:
        raise ValueError(f"config.json: layer_norm_epsilon must be a number in (0, 1), got {eps!r}")


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``normalize_config`` config:
    the computation in ``dtype``, the parameters in ``param_dtype`` (None: ``dtype``); the
    norms' epsilon is set on the built model (``finish``)."""
    heads = config["num_attention_heads"]
    return dict(
        vocab_size=config["vocab_size"],
        width=config["hidden_size"],
        depth=len(config["layers_block_type"]),
        num_heads=heads,
        attention=[LAYER_KINDS[t] for t in config["layers_block_type"]],
        kind_options={
            "mamba2": dict(
                num_heads=config["mamba_num_heads"],
                mlp="none",
                **mamba2.mixer_options(
                    head_dim=config["mamba_head_dim"],
                    state_dim=config["ssm_state_size"],
                    n_groups=config["n_groups"],
                    conv_size=config["conv_kernel"],
                    use_conv_bias=config["use_conv_bias"],
                    use_bias=config["use_bias"],
                    time_step_limit=(config["time_step_min"], math.inf),
                    norm_eps=config["layer_norm_epsilon"],
                ),
            ),
            "softmax": dict(
                num_heads=heads,
                num_kv_heads=config["num_key_value_heads"],
                head_dim=config["head_dim"],
                mlp="none",
            ),
        },
        tie_embeddings=config["tie_word_embeddings"],
        mlp="relu2",
        mlp_hidden=config["intermediate_size"],
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
    )


def finish(model, config: Mapping[str, Any]) -> None:
    """Sets the blocks' and the final RMSNorm's epsilon to ``layer_norm_epsilon``."""
    common.set_rms_norm_epsilon(model, config["layer_norm_epsilon"])


def config_from_model(model) -> dict[str, Any]:
    """The ``nemotron_h`` config of a ``LanguageModel`` in Nemotron-H's form.

    Raises:
      ValueError: a model not of that form (scanned layers; a kind other than ``mamba2``,
        ``softmax`` and ``mlp``; a mixer block with an MLP, an MLP other than squared ReLU;
        attention with RoPE, QK-norm, an output gate or a sliding window; layers of one
        kind with different sizes), naming what differs.
    """
    common.check_unrolled(model)
    fields: dict[str, Any] = {}
    renamed = {
        "num_heads": "mamba_num_heads", "head_dim": "mamba_head_dim",
        "state_size": "ssm_state_size", "n_groups": "n_groups", "conv_kernel": "conv_kernel",
        "use_conv_bias": "use_conv_bias", "use_bias": "use_bias",
    }  # fmt: skip
    kinds = {kind: layer for layer, kind in LAYER_KINDS.items()}
    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where = f"blocks[{i}]"
        if kind not in kinds:
            raise ValueError(f"{where}: Nemotron-H has {sorted(kinds)} layers, got {kind!r}")
        if block.conv is not None:
            raise ValueError(f"{where}: Nemotron-H's blocks have no short_conv")
        norm = block.mlp_norm if kind == "mlp" else block.attention_norm
        if norm.zero_centred:
            raise ValueError(f"{where}: Nemotron-H's RMSNorms are not zero-centred")
        if kind == "mlp":
            if type(block.mlp).__name__ != "ReLU2MLP":
                raise ValueError(f"{where}: Nemotron-H's MLP layers are squared ReLU (relu2)")
            common.agree(fields, "intermediate_size", block.mlp.up_proj.out_features, where)
            continue
        if block.mlp is not None:
            raise ValueError(f"{where}: Nemotron-H's mixer layers have no MLP (mlp='none')")
        a = block.attention
        if kind == "mamba2":
            mixer = mamba2.mixer_fields(a)
            low, high = mixer.pop("time_step_limit")
            if high != math.inf:
                raise ValueError(
                    f"{where}: Nemotron-H clips dt only below (time_step_limit high inf)"
                )
            common.agree(fields, "time_step_min", low, where)
            for field, value in mixer.items():
                common.agree(fields, renamed[field], value, where)
            continue
        if a.rotary_dim is not None or a.output_gate or a.q_norm is not None:
            raise ValueError(f"{where}: Nemotron-H's attention has no RoPE, output gate or QK-norm")
        if a.sliding_window is not None:
            raise ValueError(f"{where}: Nemotron-H's attention has no sliding window")
        common.agree(fields, "num_attention_heads", a.num_heads, where)
        common.agree(fields, "num_key_value_heads", a.num_kv_heads, where)
        common.agree(fields, "head_dim", a.head_dim, where)
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed.features,
        "layers_block_type": [kinds[k] for k in model.layout],
        "layer_norm_epsilon": mamba2.one_epsilon(model),
        "tie_word_embeddings": model.head is None,
        "dtype": jnp.dtype(model.embed.embedding[...].dtype).name,
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
    return normalize_config(common.merge_for_save(derived, config, mamba2.UNCHECKED))


FORMAT = common.ModelFormat(
    name="Nemotron-H",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=(PREFIX, "model."),
    ignored_prefixes=lambda config: ("mtp.",) + common.tied_head_ignored(config),
    finish=finish,
)
