"""Zamba checkpoints in Hugging Face format (``ZambaForCausalLM``, ``model_type``
``zamba``) <-> ``LanguageModel``: Mamba-1 layers plus one shared attention block
(``layers.shared``, the model's ``shared_blocks``, without adapters).

Every layer is ``x + mixer(RMSNorm(x))``, a Mamba-1 mixer (``layers.MambaMixer``,
``attention="mamba"``) whose ``in_proj`` rows interleave x and z (``x0, z0, x1, ...``:
our ``[x | z]``, reordered) and whose ``x_proj``, ``dt_proj``, ``A_log`` and ``D`` carry a
leading axis of ``n_mamba_heads``: several heads are ``MambaMixer(heads=...)``, the inner
channels in groups, each with its own ``x_proj`` and ``dt_proj`` (its own dt, B and C).
The ``"hybrid"`` layers of ``layers_block_type`` (by default every
``attn_layer_period``-th from ``attn_layer_offset``, after two Mamba layers and a hybrid
one) are uses of the one block: RMSNorm over ``[hidden, embeddings]``, attention (heads of
``attention_head_dim``, GQA, no RoPE, scores times ``(head_dim / 2) ** -0.5``), RMSNorm and
a gated MLP (``hidden_act``; ``gate_proj`` and ``up_proj``, our fused ``gate_up_proj``),
then each use's ``linear`` into the mixer's input.

``transformers`` stores the block under the first hybrid layer's ``shared_transf.``; the
later hybrid layers' copies are tied (not saved, and not read where a file has them).
Tensors under ``model.``; the head is tied unless ``tie_word_embeddings`` is false. Every
RMSNorm's epsilon is ``rms_norm_eps``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from linattn_jax.hf import common, mamba2, tables, zamba2
from linattn_jax.hf.tables import CONV, COPY, LINEAR, Conversion, Rule

MODEL_TYPES = ("zamba",)


def _interleave(x: np.ndarray) -> np.ndarray:
    """Rows ``[x | z]`` as ``x0, z0, x1, z1, ...`` (along the first axis)."""
    return x.reshape(2, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def _split_interleaved(x: np.ndarray) -> np.ndarray:
    """``_interleave``'s inverse."""
    return x.reshape(-1, 2, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


# in_proj's [2 inner, width] (rows x0, z0, ...) <-> our kernel [width, 2 inner] ([x | z])
IN_PROJ = Conversion(
    "interleaved_linear", LINEAR.hf_shape,
    lambda x, s: [_split_interleaved(x).T], lambda xs: _interleave(xs[0].T),
)  # fmt: skip
IN_PROJ_BIAS = Conversion(
    "interleaved", COPY.hf_shape,
    lambda x, s: [_split_interleaved(x)], lambda xs: _interleave(xs[0]),
)  # fmt: skip


@functools.cache
def one_head(base: Conversion) -> Conversion:
    """``base``'s tensor with a leading axis of one head (``n_mamba_heads=1``)."""
    return Conversion(
        f"one_head_{base.name}", lambda s: (1, *base.hf_shape(s)),
        lambda x, s: base.to_ours(x[0], s), lambda xs: base.to_hf(xs)[None],
    )  # fmt: skip


@functools.cache
def by_heads(heads: int) -> Conversion:
    """Our ``[inner, ...]`` stored as ``[heads, inner / heads, ...]`` (``A_log``, ``D``)."""
    return Conversion(
        f"by_{heads}_heads", lambda s: (heads, s[0][0] // heads, *s[0][1:]),
        lambda x, s: [x.reshape(-1, *x.shape[2:])],
        lambda xs: xs[0].reshape(heads, -1, *xs[0].shape[1:]),
    )  # fmt: skip


MIXER_RULES = tables.rules(
    ("in_proj.weight", "in_proj.kernel", IN_PROJ),
    ("conv1d.weight", "conv.kernel", CONV),
    ("out_proj.weight", "out_proj.kernel", LINEAR),
)
MIXER_BIAS_RULES = tables.rules(
    ("in_proj.bias", "in_proj.bias", IN_PROJ_BIAS),
    ("out_proj.bias", "out_proj.bias", COPY),
)
# Zamba2's shared block rows less its fused gate_up_proj (``mlp_rules``)
BLOCK_RULES = tuple(r for r in zamba2.BLOCK_RULES if "gate_up" not in r.hf)


def mlp_rules(config: Mapping[str, Any]) -> tuple[Rule, ...]:
    """``gate_proj`` and ``up_proj``: the two halves of our ``gate_up_proj`` kernel's
    columns."""
    h = config["intermediate_size"]
    return tuple(
        Rule(f"feed_forward.{name}.weight", ("gate_up_proj.kernel",), LINEAR, (slice(None), part))
        for name, part in [("gate_proj", slice(0, h)), ("up_proj", slice(h, 2 * h))]
    )


def mixer_rules(config: Mapping[str, Any], hf: str) -> tuple[Rule, ...]:
    """A Mamba layer's norm and mixer under ``hf`` (``""`` or ``"mamba_decoder."``)."""
    heads = config["n_mamba_heads"]
    # one head: our MambaMixer's plain projections; several: its per-head ones.
    per_head = one_head(LINEAR) if heads == 1 else tables.EXPERTS_LINEAR
    rows = MIXER_RULES + tables.rules(
        ("x_proj_weight", "x_proj.kernel", per_head),
        ("dt_proj_weight", "dt_proj.kernel", per_head),
        ("dt_proj_bias", "dt_proj.bias", by_heads(1) if heads == 1 else COPY),
        ("A_log", "A_log", by_heads(heads)),
        ("D", "D", by_heads(heads)),
    )
    rows += mamba2.CONV_BIAS_RULES if config["mamba_conv_bias"] else ()
    rows += MIXER_BIAS_RULES if config["mamba_proj_bias"] else ()
    norm = tables.rules((f"{hf}input_layernorm.weight", "attention_norm.scale", COPY))
    return norm + tables.under(rows, f"{hf}mamba.", "attention.")


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """The model's rows, each layer's mixer, the shared block under the first hybrid
    layer's ``shared_transf.`` and each use's ``linear``."""
    hybrid = config["hybrid_layer_ids"]
    rows = [(prefix + r.hf, r) for r in zamba2.MODEL_RULES]
    for i, kind in enumerate(config["layers_block_type"]):
        layer = f"{prefix}layers.{i}."
        rows += tables.prefixed(
            mixer_rules(config, "mamba_decoder." if kind == "hybrid" else ""), layer, f"blocks.{i}."
        )
        if kind != "hybrid":
            continue
        k = hybrid.index(i)
        if k == 0:
            block = BLOCK_RULES + mlp_rules(config)
            rows += tables.prefixed(block, f"{layer}shared_transf.", "shared.blocks.0.")
        out = tables.rules(("linear.weight", "out_proj.kernel", LINEAR))
        rows += tables.prefixed(out, layer, f"shared.uses.{k}.")
    return rows


def tied_copies(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The later hybrid layers' ``shared_transf.`` (tied copies of the first one's)."""
    return tuple(f"model.layers.{i}.shared_transf." for i in config["hybrid_layer_ids"][1:])


# ---------------------------------------------------------------------------- the config

# transformers' ZambaConfig defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    hidden_size=3712, intermediate_size=14848, num_hidden_layers=76, num_attention_heads=16,
    num_key_value_heads=16, n_mamba_heads=2, hidden_act="gelu", hidden_mamba_act="silu",
    rms_norm_eps=1e-5, max_position_embeddings=4096, attn_layer_period=6,
    attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
    mamba_dt_rank="auto", mamba_conv_bias=True, mamba_proj_bias=False,
    tie_word_embeddings=True,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "attention_head_dim",
    "attention_hidden_size", "n_mamba_heads", "mamba_d_state", "mamba_d_conv", "mamba_expand",
    "mamba_dt_rank",
)  # fmt: skip


def derived(config: common.Config) -> None:
    """The fields ``transformers`` derives (``attention_hidden_size``,
    ``attention_head_dim``, ``mamba_dt_rank``, ``layers_block_type`` and our
    ``hybrid_layer_ids``), as it does."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    config["attention_hidden_size"] = config.get("attention_hidden_size") or 2 * hidden
    config["attention_head_dim"] = config.get("attention_head_dim") or 2 * hidden // heads
    if config["mamba_dt_rank"] == "auto":
        config["mamba_dt_rank"] = -(-hidden // 16)
    if config.get("layers_block_type") is None:
        period, offset = config["attn_layer_period"], config["attn_layer_offset"]
        common.check_ints(config, ("attn_layer_period",))
        common.check_ints(config, ("attn_layer_offset",), minimum=0)
        config["layers_block_type"] = ["linear_attention", "linear_attention", "hybrid"] + [
            "hybrid" if i % period == offset else "linear_attention"
            for i in range(config["num_hidden_layers"] - 3)
        ]
    zamba2.derived(config)  # the layer types checked, renamed, and hybrid_layer_ids


def check(config: common.Config) -> None:
    """Raises ``ValueError`` naming a field we do not support."""
    common.check_layer_types(config, ("linear_attention", "hybrid"), "layers_block_type")
    if not config["hybrid_layer_ids"]:
        raise ValueError("config.json: layers_block_type must have a 'hybrid' layer, got none")
    if config["attention_hidden_size"] != 2 * config["hidden_size"]:
        raise ValueError(
            f"config.json: attention_hidden_size must be 2 hidden_size="
            f"{2 * config['hidden_size']}, got {config['attention_hidden_size']}"
        )
    inner, heads = config["mamba_expand"] * config["hidden_size"], config["n_mamba_heads"]
    if inner % heads:
        raise ValueError(f"config.json: n_mamba_heads={heads} must divide {inner}")
    common.check_bools(config, ("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings"))
    common.check_choice(config, "hidden_act", ("gelu", "gelu_pytorch_tanh", "silu"))
    common.check_choice(config, "hidden_mamba_act", ("silu",))
    common.check_number(config, "rms_norm_eps", 0, 1)


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer a ``MambaMixer`` block; the shared block at ``hybrid_layer_ids``."""
    head_dim = config["attention_head_dim"]
    mixer = dict(
        expand=config["mamba_expand"], state_dim=config["mamba_d_state"],
        dt_rank=config["mamba_dt_rank"], conv_size=config["mamba_d_conv"],
        use_conv_bias=config["mamba_conv_bias"], use_bias=config["mamba_proj_bias"],
        heads=config["n_mamba_heads"],
    )  # fmt: skip
    shared = dict(
        layers=tuple(config["hybrid_layer_ids"]), num_blocks=1,
        num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
        head_dim=head_dim, scale=(head_dim / 2) ** -0.5, mlp_hidden=config["intermediate_size"],
        activation=config["hidden_act"], adapter_rank=None,
        max_length=config["max_position_embeddings"],
    )  # fmt: skip
    return dict(
        num_heads=1,
        attention="mamba",
        kind_options={"mamba": mixer},
        mlp="none",
        shared_blocks=shared,
    )


FORMAT = common.ModelFormat(
    name="Zamba",
    model_types=MODEL_TYPES,
    architecture="ZambaForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        common.ints(("hidden_size", "num_attention_heads", "num_hidden_layers")),
        derived,
        common.ints(INT_FIELDS),
        common.divides("num_key_value_heads", "num_attention_heads"),
        check,
    ),
    options=options,
    table=table,
    prefixes=("model.",),
    ignored=tied_copies,
    finish=common.rms_norm_eps("rms_norm_eps"),
)
