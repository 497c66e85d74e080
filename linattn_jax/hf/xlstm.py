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

from linattn_jax.hf import common, tables
from linattn_jax.hf.tables import COPY, LINEAR

MODEL_TYPES = ("xlstm",)
PREFIX = "backbone."

# The weight table: model-level rows, then each block's.
MODEL_RULES = tables.rules(
    ("embeddings.weight", "embed.embedding", COPY),
    ("out_norm.weight", "norm.scale", COPY),
)
HEAD_RULE = tables.HEAD_RULE  # always its own (ties_head=False); no prefix
BLOCK_RULES = tables.rules(
    ("norm_mlstm.weight", "attention_norm.scale", COPY),
    ("mlstm_layer.q.weight", "attention.q.kernel", LINEAR),
    ("mlstm_layer.k.weight", "attention.k.kernel", LINEAR),
    ("mlstm_layer.v.weight", "attention.v.kernel", LINEAR),
    ("mlstm_layer.ogate_preact.weight", "attention.ogate_preact.kernel", LINEAR),
    ("mlstm_layer.igate_preact.weight", "attention.igate_preact.kernel", LINEAR),
    ("mlstm_layer.igate_preact.bias", "attention.igate_preact.bias", COPY),
    ("mlstm_layer.fgate_preact.weight", "attention.fgate_preact.kernel", LINEAR),
    ("mlstm_layer.fgate_preact.bias", "attention.fgate_preact.bias", COPY),
    ("mlstm_layer.multihead_norm.weight", "attention.multihead_norm.weight", COPY),
    ("mlstm_layer.out_proj.weight", "attention.out_proj.kernel", LINEAR),
    ("norm_ffn.weight", "mlp_norm.scale", COPY),
    ("ffn.proj_up_gate.weight", "mlp.gate_proj.kernel", LINEAR),
    ("ffn.proj_up.weight", "mlp.up_proj.kernel", LINEAR),
    ("ffn.proj_down.weight", "mlp.down_proj.kernel", LINEAR),
)

# ---------------------------------------------------------------------------- the config

# transformers' xLSTMConfig defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=50304, hidden_size=4096, num_hidden_layers=32, num_heads=8, use_bias=False,
    norm_reduction_force_float32=True, tie_word_embeddings=False, add_out_norm=True,
    norm_eps=1e-6, qk_dim_factor=0.5, v_dim_factor=1.0, eps=1e-6, ffn_proj_factor=2.667,
    ffn_round_up_to_multiple_of=64, gate_soft_cap=15.0, output_logit_soft_cap=30.0,
    weight_mode="single",
)  # fmt: skip
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


def aliases(config: common.Config) -> None:
    """``embedding_dim`` and ``num_blocks``, ``transformers``' other names of
    ``hidden_size`` and ``num_hidden_layers``: equal to them, written alike."""
    for ours, alias in [("hidden_size", "embedding_dim"), ("num_hidden_layers", "num_blocks")]:
        if config.get(alias) is not None and config[alias] != config[ours]:
            raise ValueError(
                f"config.json: {alias}={config[alias]} must equal {ours}={config[ours]}"
            )
        config[alias] = config[ours]


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


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer an mLSTM block with a SwiGLU MLP; the logits soft-capped."""
    return dict(
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


FORMAT = common.ModelFormat(
    name="xLSTM",
    model_types=MODEL_TYPES,
    architecture="xLSTMForCausalLM",
    steps=(common.defaults(DEFAULTS), aliases, check_config),
    options=options,
    table=tables.layered(MODEL_RULES, lambda config, i: BLOCK_RULES, layers="blocks."),
    prefixes=(PREFIX,),
    ties_head=False,  # xLSTMForCausalLM ties nothing, whatever the config says
    # The blocks' and the final RMSNorm's (the multi-head norms take it as norm_eps).
    finish=common.rms_norm_eps("norm_eps"),
)
