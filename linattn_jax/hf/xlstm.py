"""xLSTM checkpoints in Hugging Face format (``xLSTMForCausalLM``, ``model_type`` ``xlstm``:
xLSTM-7B and its shape) <-> ``LanguageModel``: the config's fields as the model's options,
and the one table of weights.

An xLSTM model is ``num_hidden_layers`` blocks of ``x + mlstm(RMSNorm(x))`` then ``x +
ffn(RMSNorm(x))`` between the embedding and a final RMSNorm (``add_out_norm``), the logits
soft-capped: our ``TransformerBlock(attention="mlstm", mlp="swiglu")`` (``layers.MLSTMLayer``,
``layers.SwiGLU``) in a ``LanguageModel(logit_soft_cap=...)``. Its conventions, each mapped
to an option of ours:

* ``qk_dim = int(hidden_size * qk_dim_factor)`` and ``v_dim = int(hidden_size *
  v_dim_factor)`` split over ``num_heads``; the input and forget gates' pre-activations
  soft-capped at ``gate_soft_cap``, the forget gate a sigmoid, the mLSTM's normaliser
  epsilon ``eps``;
* the feed-forward's hidden width is ``hidden_size * ffn_proj_factor`` rounded up to a
  multiple of ``ffn_round_up_to_multiple_of`` (``proj_up_gate``, ``proj_up``,
  ``proj_down``: our SwiGLU's ``gate_proj``, ``up_proj``, ``down_proj``);
* every norm's epsilon (the blocks' and final RMSNorms, the multi-head layer norm) is
  ``norm_eps``; the logits are ``output_logit_soft_cap * tanh(logits / cap)``;
* ``nn.Linear`` weights are ``[out, in]``, our kernels ``[in, out]`` (a transpose).

Read as written: ``weight_mode`` ``"single"``, ``use_bias`` false, ``add_out_norm`` true
(the others are refused by name). The kernel choices (``chunkwise_kernel``, ``mode``,
``chunk_size``, ``autocast_kernel_dtype``, ...) change how ``transformers`` computes, not
what: they are kept in the config and not read. The tensors live under ``backbone.``
(``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from linattn_jax.hf import common
from linattn_jax.hf.common import Rule
from linattn_jax.layers.mlstm import MultiHeadLayerNorm

MODEL_TYPES = ("xlstm",)
PREFIX = "backbone."

# The weight table: model-level rows, then each block's.
MODEL_RULES = common.rules(
    ("embeddings.weight", "embed.embedding", "copy"),
    ("out_norm.weight", "norm.scale", "copy"),
)
HEAD_RULE = Rule("lm_head.weight", ("head.kernel",), "linear")  # untied only; no prefix
BLOCK_RULES = common.rules(
    ("norm_mlstm.weight", "attention_norm.scale", "copy"),
    ("mlstm_layer.q.weight", "attention.q.kernel", "linear"),
    ("mlstm_layer.k.weight", "attention.k.kernel", "linear"),
    ("mlstm_layer.v.weight", "attention.v.kernel", "linear"),
    ("mlstm_layer.ogate_preact.weight", "attention.ogate_preact.kernel", "linear"),
    ("mlstm_layer.igate_preact.weight", "attention.igate_preact.kernel", "linear"),
    ("mlstm_layer.igate_preact.bias", "attention.igate_preact.bias", "copy"),
    ("mlstm_layer.fgate_preact.weight", "attention.fgate_preact.kernel", "linear"),
    ("mlstm_layer.fgate_preact.bias", "attention.fgate_preact.bias", "copy"),
    ("mlstm_layer.multihead_norm.weight", "attention.multihead_norm.weight", "copy"),
    ("mlstm_layer.out_proj.weight", "attention.out_proj.kernel", "linear"),
    ("norm_ffn.weight", "mlp_norm.scale", "copy"),
    ("ffn.proj_up_gate.weight", "mlp.gate_proj.kernel", "linear"),
    ("ffn.proj_up.weight", "mlp.up_proj.kernel", "linear"),
    ("ffn.proj_down.weight", "mlp.down_proj.kernel", "linear"),
)


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, Rule]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s): ``(its full
    Hugging Face name, the Rule with our full paths)``, in the model's order."""
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i in range(config["num_hidden_layers"]):
        rows += common.prefixed(BLOCK_RULES, f"{prefix}blocks.{i}.", f"blocks.{i}.")
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


# ---------------------------------------------------------------------------- the config

DEFAULTS = dict(
    vocab_size=50304,
    hidden_size=4096,
    num_hidden_layers=32,
    num_heads=8,
    use_bias=False,
    norm_reduction_force_float32=True,
    tie_word_embeddings=False,
    add_out_norm=True,
    norm_eps=1e-6,
    qk_dim_factor=0.5,
    v_dim_factor=1.0,
    eps=1e-6,
    ffn_proj_factor=2.667,
    ffn_round_up_to_multiple_of=64,
    gate_soft_cap=15.0,
    output_logit_soft_cap=30.0,
    weight_mode="single",
)  # fmt: skip  (transformers' xLSTMConfig defaults, for fields a config.json leaves out)
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "ffn_round_up_to_multiple_of",
)  # fmt: skip
SUPPORTED = {"weight_mode": "single", "use_bias": False, "add_out_norm": True}


def round_up(x: float, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple``, as ``transformers`` rounds (a float
    floor division)."""
    return int(((x + multiple - 1) // multiple) * multiple)


def sizes(config: Mapping[str, Any]) -> dict[str, int]:
    """``(qk_dim, v_dim, ffn_hidden)`` of a config, as ``transformers``' layers form them."""
    width = config["hidden_size"]
    return dict(
        qk_dim=int(width * config["qk_dim_factor"]),
        v_dim=int(width * config["v_dim_factor"]),
        ffn_hidden=round_up(
            width * config["ffn_proj_factor"], config["ffn_round_up_to_multiple_of"]
        ),
    )


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in, checked.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    config = common.with_defaults(raw, MODEL_TYPES, DEFAULTS)
    for ours, alias in [("hidden_size", "embedding_dim"), ("num_hidden_layers", "num_blocks")]:
        if config.get(alias) is not None and config[alias] != config[ours]:
            raise ValueError(
                f"config.json: {alias}={config[alias]} must equal {ours}={config[ours]}"
            )
        config[alias] = config[ours]
    check_config(config)
    return config


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` that is missing, of the wrong
    type, or that we do not support."""
    common.check_ints(config, INT_FIELDS)
    common.check_unsupported(config, SUPPORTED)
    common.check_bools(config, ("tie_word_embeddings", "norm_reduction_force_float32"))
    for field in ("qk_dim_factor", "v_dim_factor", "ffn_proj_factor"):
        if not common.is_number(config[field]) or not config[field] > 0:
            raise ValueError(f"config.json: {field} must be a number > 0, got {config[field]!r}")
    for field in ("norm_eps", "eps"):
        value = config[field]
        if not common.is_number(value) or not 0 <= value < 1:
            raise ValueError(f"config.json: {field} must be a number in [0, 1), got {value!r}")
    for field in ("gate_soft_cap", "output_logit_soft_cap"):
        value = config[field]
        if value is not None and (not common.is_number(value) or not value > 0):
            raise ValueError(f"config.json: {field} must be a number > 0 or null, got {value!r}")
    dims = sizes(config)
    for field in ("qk_dim", "v_dim"):
        if dims[field] < 1 or dims[field] % config["num_heads"]:
            raise ValueError(
                f"config.json: num_heads={config['num_heads']} must divide {field}="
                f"{dims[field]} (hidden_size * {field}_factor)"
            )
    if dims["ffn_hidden"] < 1:
        raise ValueError(f"config.json: the feed-forward's width {dims['ffn_hidden']} is < 1")


def _cap(value) -> float | None:
    return None if value is None else float(value)


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
        attention="mlstm",
        kind_options={
            "mlstm": dict(
                qk_dim_factor=float(config["qk_dim_factor"]),
                v_dim_factor=float(config["v_dim_factor"]),
                gate_soft_cap=_cap(config["gate_soft_cap"]),
                norm_eps=float(config["norm_eps"]),
                eps=float(config["eps"]),
            )
        },
        mlp="swiglu",
        mlp_hidden=sizes(config)["ffn_hidden"],
        logit_soft_cap=_cap(config["output_logit_soft_cap"]),
    )


def finish(model, config: Mapping[str, Any]) -> None:
    """Sets the blocks' and the final RMSNorm's epsilon to ``norm_eps`` (the blocks take no
    epsilon option; the multi-head norms take it as ``norm_eps``)."""
    common.set_rms_norm_epsilon(model, config["norm_eps"])


def one_epsilon(model) -> float:
    """The one epsilon of every norm of ``model``, as xLSTM has.

    Raises:
      ValueError: norms with different epsilons (named).
    """
    found = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.RMSNorm | MultiHeadLayerNorm):
            found.setdefault(float(node.epsilon), ".".join(map(str, path)))
    if len(found) > 1:
        where = ", ".join(f"{p} {eps:g}" for eps, p in found.items())
        raise ValueError(
            f"the model's norms have different epsilons ({where}); xLSTM's config has one "
            "(norm_eps; a model built from model_options takes it from finish(model, config))"
        )
    return next(iter(found))


def config_from_model(model) -> dict[str, Any]:
    """The ``xlstm`` config of a ``LanguageModel`` in xLSTM's form (its dimensions read from
    the layers; the size factors as exact ratios, the feed-forward's width rounded to a
    multiple of itself).

    Raises:
      ValueError: a model not of that form (scanned layers, a kind other than ``mlstm``,
        an MLP other than SwiGLU, a short convolution, zero-centred norms, biases, layers
        of different sizes), naming what differs.
    """
    common.check_unrolled(model)
    fields: dict[str, Any] = {}
    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where = f"blocks[{i}]"
        layer = block.attention
        if kind != "mlstm":
            raise ValueError(f"{where}: xLSTM models have only mlstm layers, got {kind!r}")
        if type(block.mlp).__name__ != "SwiGLU" or block.conv is not None:
            raise ValueError(f"{where}: xLSTM's blocks have a SwiGLU MLP and no short_conv")
        if block.attention_norm.zero_centred or layer.q.use_bias:
            raise ValueError(f"{where}: xLSTM's norms are not zero-centred, its layers unbiased")
        for field, value in [
            ("num_heads", layer.num_heads),
            ("qk_dim", layer.qk_dim),
            ("v_dim", layer.v_dim),
            ("ffn_hidden", block.mlp.gate_proj.out_features),
            ("gate_soft_cap", layer.gate_soft_cap),
            ("eps", layer.eps),
        ]:
            common.agree(fields, field, value, where)
    width = model.embed.features
    return {
        "architectures": ["xLSTMForCausalLM"],
        "model_type": "xlstm",
        **common.model_fields(model),
        "embedding_dim": width,
        "num_blocks": model.depth,
        "num_heads": fields["num_heads"],
        "qk_dim_factor": fields["qk_dim"] / width,
        "v_dim_factor": fields["v_dim"] / width,
        "ffn_proj_factor": fields["ffn_hidden"] / width,
        "ffn_round_up_to_multiple_of": fields["ffn_hidden"],
        "gate_soft_cap": fields["gate_soft_cap"],
        "output_logit_soft_cap": model.logit_soft_cap,
        "norm_eps": one_epsilon(model),
        "eps": fields["eps"],
        "use_bias": False,
        "add_out_norm": True,
        "weight_mode": "single",
        "_sizes": {k: fields[k] for k in ("qk_dim", "v_dim", "ffn_hidden")},
    }


UNCHECKED = ("architectures", "dtype", "model_type")  # save_pretrained writes the model's
# Fields whose values a config may state differently for the same sizes (compared through
# ``sizes``, not as written).
SIZE_FIELDS = ("qk_dim_factor", "v_dim_factor", "ffn_proj_factor", "ffn_round_up_to_multiple_of")


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: ``config_from_model``'s fields
    over ``config``'s others (``chunk_size``, ``pad_token_id``, ...); a ``config``'s size
    factors are kept when they give the model's sizes.

    Raises:
      ValueError: ``config_from_model``'s, or a field of ``config`` that describes another
        model (named).
    """
    derived = config_from_model(model)
    have = derived.pop("_sizes")
    if config is not None:
        merged = {**DEFAULTS, **config, "hidden_size": derived["hidden_size"]}
        stated = sizes(merged)
        for field, value in have.items():
            if stated[field] != value:
                raise ValueError(f"config gives {field}={stated[field]}, but the model has {value}")
        for field in SIZE_FIELDS:
            derived.pop(field)
    return normalize_config(common.merge_for_save(derived, config, UNCHECKED))


FORMAT = common.ModelFormat(
    name="xLSTM",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=(PREFIX,),
    ignored_prefixes=common.tied_head_ignored,
    finish=finish,
)
