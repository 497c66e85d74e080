"""Zamba2 checkpoints in Hugging Face format (``Zamba2ForCausalLM``, ``model_type``
``zamba2``) <-> ``LanguageModel``: Mamba-2 layers plus shared transformer blocks
(``layers.shared``, the model's ``shared_blocks``).

Every layer is ``x + mixer(RMSNorm(x))``, a Mamba-2 mixer (``hf.mamba2``'s rows under
``mamba.``; ``in_proj``/``out_proj`` biases ``add_bias_linear``, a convolution bias always,
``dt`` clipped below at ``time_step_min``, the gated norm's epsilon 1e-5). The ``"hybrid"``
layers of ``layers_block_type`` (``hybrid_layer_ids``) are uses of ``num_mem_blocks``
shared blocks in turn, each an attention over ``[hidden, embeddings]`` (heads of
``2 hidden_size / num_attention_heads``, GQA, scores times ``(head_dim / 2) ** -0.5``,
RoPE with ``use_mem_rope``) and a gated MLP (``hidden_act``, biases ``add_bias_linear``),
each use with its adapters (``adapter_rank``: the MLP's always, q/k/v's with
``use_shared_attention_adapter``) and its ``linear`` into the mixer's input.

``transformers`` stores shared block ``b`` (and the adapters of its uses, by use) under
the ``b``-th hybrid layer's ``shared_transformer.``; the later hybrid layers' copies are
tied (not saved, and not read where a file has them). Tensors under ``model.``; the head
is tied unless ``tie_word_embeddings`` is false. Every RMSNorm's epsilon but the mixers'
is ``rms_norm_eps``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, mamba2, tables
from linattn_jax.hf.tables import COPY, LINEAR

MODEL_TYPES = ("zamba2",)
LEGACY_TYPES = {"mamba": "linear_attention"}  # as transformers remaps the old name
MIXER_NORM_EPS = 1e-5  # transformers' Zamba2RMSNormGated, whatever rms_norm_eps

MODEL_RULES = tables.rules(
    ("embed_tokens.weight", "embed.embedding", COPY),
    ("final_layernorm.weight", "norm.scale", COPY),
)
BLOCK_RULES = tables.rules(
    ("input_layernorm.weight", "input_norm.scale", COPY),
    ("self_attn.q_proj.weight", "q_proj.kernel", LINEAR),
    ("self_attn.k_proj.weight", "k_proj.kernel", LINEAR),
    ("self_attn.v_proj.weight", "v_proj.kernel", LINEAR),
    ("self_attn.o_proj.weight", "out_proj.kernel", LINEAR),
    ("pre_ff_layernorm.weight", "mlp_norm.scale", COPY),
    ("feed_forward.gate_up_proj.weight", "gate_up_proj.kernel", LINEAR),
    ("feed_forward.down_proj.weight", "down_proj.kernel", LINEAR),
)
BLOCK_BIAS_RULES = tables.rules(
    ("feed_forward.gate_up_proj.bias", "gate_up_proj.bias", COPY),
    ("feed_forward.down_proj.bias", "down_proj.bias", COPY),
)


def adapter_rules(hf: str, ours: str) -> tuple[tables.Rule, ...]:
    """An adapter's two ``nn.Linear`` (``{hf}.0``, ``{hf}.1``) as our ``down`` and ``up``."""
    return tables.rules(
        (f"{hf}.0.weight", f"{ours}.down.kernel", LINEAR),
        (f"{hf}.1.weight", f"{ours}.up.kernel", LINEAR),
    )


def use_rules(config: Mapping[str, Any], k: int) -> tuple[tables.Rule, ...]:
    """Use ``k``'s adapters, under its block's ``shared_transformer.`` and our
    ``shared.uses.{k}.``."""
    rows = adapter_rules(f"feed_forward.gate_up_proj_adapter_list.{k}", "mlp_adapter")
    if config["use_shared_attention_adapter"]:
        for x in "qkv":
            rows += adapter_rules(f"self_attn.linear_{x}_adapter_list.{k}", f"{x}_adapter")
    return rows


def mixer_rules(config: Mapping[str, Any], hf: str) -> tuple[tables.Rule, ...]:
    """A Mamba-2 layer's norm and mixer under ``hf`` (``""`` or ``"mamba_decoder."``)."""
    norm = tables.rules((f"{hf}input_layernorm.weight", "attention_norm.scale", COPY))
    return norm + mamba2.mixer_rules(f"{hf}mamba.", conv_bias=True, bias=config["add_bias_linear"])


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """The model's rows, each layer's mixer, each shared block's under its first use's
    ``shared_transformer.``, each use's adapters there and its ``linear``."""
    hybrid, n = config["hybrid_layer_ids"], config["num_mem_blocks"]
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i, kind in enumerate(config["layers_block_type"]):
        layer = f"{prefix}layers.{i}."
        rows += tables.prefixed(
            mixer_rules(config, "mamba_decoder." if kind == "hybrid" else ""), layer, f"blocks.{i}."
        )
        if kind != "hybrid":
            continue
        k = hybrid.index(i)
        shared = f"{prefix}layers.{hybrid[k % n]}.shared_transformer."
        if k < n:
            bias = BLOCK_BIAS_RULES if config["add_bias_linear"] else ()
            rows += tables.prefixed(BLOCK_RULES + bias, shared, f"shared.blocks.{k}.")
        rows += tables.prefixed(use_rules(config, k), shared, f"shared.uses.{k}.")
        out = tables.rules(("linear.weight", "out_proj.kernel", LINEAR))
        rows += tables.prefixed(out, layer, f"shared.uses.{k}.")
    return rows


def tied_copies(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The later hybrid layers' ``shared_transformer.`` (tied copies of the first ones')."""
    hybrid = config["hybrid_layer_ids"][config["num_mem_blocks"] :]
    return tuple(f"model.layers.{i}.shared_transformer." for i in hybrid)


# ---------------------------------------------------------------------------- the config

# transformers' Zamba2Config defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    hidden_size=2560, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
    time_step_min=0.001, n_mamba_heads=8, add_bias_linear=False, hidden_act="gelu",
    num_attention_heads=32, num_mem_blocks=1, use_shared_attention_adapter=False,
    adapter_rank=128, use_mem_rope=False, rms_norm_eps=1e-5, use_long_context=False,
    tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "mamba_d_state", "mamba_d_conv",
    "mamba_expand", "mamba_ngroups", "n_mamba_heads", "num_attention_heads",
    "num_key_value_heads", "num_mem_blocks", "adapter_rank", "intermediate_size",
)  # fmt: skip


def derived(config: common.Config) -> None:
    """The fields ``transformers`` derives (``intermediate_size``, ``num_key_value_heads``,
    the layer types' new names, ``hybrid_layer_ids``, the heads' widths), as it does."""
    config["intermediate_size"] = config.get("intermediate_size") or 4 * config["hidden_size"]
    heads = config["num_attention_heads"]
    config["num_key_value_heads"] = config.get("num_key_value_heads") or heads
    types = config.get("layers_block_type")
    if not isinstance(types, list) or not types:
        raise ValueError(
            f"config.json: layers_block_type must be a list of layer types, got {types!r}"
        )
    config["layers_block_type"] = [LEGACY_TYPES.get(t, t) for t in types]
    config["hybrid_layer_ids"] = [
        i for i, t in enumerate(config["layers_block_type"]) if t == "hybrid"
    ]


def widths(config: common.Config) -> None:
    """``attention_head_dim`` (``2 hidden_size / num_attention_heads``) and
    ``mamba_headdim`` (``mamba_expand hidden_size / n_mamba_heads``), checked whole."""
    hidden = config["hidden_size"]
    for field, total, heads in [
        ("attention_head_dim", 2 * hidden, "num_attention_heads"),
        ("mamba_headdim", config["mamba_expand"] * hidden, "n_mamba_heads"),
    ]:
        if total % config[heads]:
            raise ValueError(f"config.json: {heads}={config[heads]} must divide {total}")
        config[field] = total // config[heads]
    config["attention_hidden_size"] = 2 * hidden


def check(config: common.Config) -> None:
    """Raises ``ValueError`` naming a field we do not support."""
    common.check_layer_types(config, ("linear_attention", "hybrid"), "layers_block_type")
    if len(config["hybrid_layer_ids"]) < config["num_mem_blocks"]:
        raise ValueError(
            f"config.json: layers_block_type must have at least num_mem_blocks="
            f"{config['num_mem_blocks']} 'hybrid' layers, got {len(config['hybrid_layer_ids'])}"
        )
    common.check_bools(config, (
        "add_bias_linear", "use_shared_attention_adapter", "use_mem_rope", "tie_word_embeddings",
    ))  # fmt: skip
    common.check_unsupported(config, {"use_long_context": False})
    if config["use_shared_attention_adapter"]:  # transformers' k and v adapters: all heads
        kv, heads = config["num_key_value_heads"], config["num_attention_heads"]
        if kv != heads:
            raise ValueError(
                f"config.json: use_shared_attention_adapter needs num_key_value_heads="
                f"num_attention_heads={heads}, got {kv}"
            )
    common.check_choice(config, "hidden_act", ("gelu", "gelu_pytorch_tanh", "silu"))
    common.check_number(config, "rms_norm_eps", 0, 1)
    low = config["time_step_min"]
    if not common.is_number(low) or low < 0:
        raise ValueError(f"config.json: time_step_min must be a number >= 0, got {low!r}")


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer a Mamba-2 mixer block; the shared blocks at ``hybrid_layer_ids``."""
    head_dim = config["attention_head_dim"]
    rope = config["rope_parameters"]["rope_theta"] if config["use_mem_rope"] else None
    mixer = mamba2.mixer_options(
        head_dim=config["mamba_headdim"], state_dim=config["mamba_d_state"],
        n_groups=config["mamba_ngroups"], conv_size=config["mamba_d_conv"], use_conv_bias=True,
        use_bias=config["add_bias_linear"], time_step_limit=(config["time_step_min"], math.inf),
        norm_eps=MIXER_NORM_EPS,
    )  # fmt: skip
    shared = dict(
        layers=tuple(config["hybrid_layer_ids"]), num_blocks=config["num_mem_blocks"],
        num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
        head_dim=head_dim, rope_theta=None if rope is None else float(rope),
        scale=(head_dim / 2) ** -0.5, mlp_hidden=config["intermediate_size"],
        activation=config["hidden_act"], mlp_bias=config["add_bias_linear"],
        adapter_rank=config["adapter_rank"],
        attention_adapters=config["use_shared_attention_adapter"],
        max_length=config["max_position_embeddings"],
    )  # fmt: skip
    return dict(
        num_heads=config["n_mamba_heads"],
        attention="mamba2",
        kind_options={"mamba2": mixer},
        mlp="none",
        shared_blocks=shared,
    )


FORMAT = common.ModelFormat(
    name="Zamba2",
    model_types=MODEL_TYPES,
    architecture="Zamba2ForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        common.ints(("hidden_size", "num_attention_heads")),
        derived,
        common.ints(INT_FIELDS),
        widths,
        common.divides("mamba_ngroups", "n_mamba_heads"),
        common.divides("num_key_value_heads", "num_attention_heads"),
        common.plain_rope(10000.0),
        check,
    ),
    options=options,
    table=table,
    prefixes=("model.",),
    ignored=tied_copies,
    finish=common.rms_norm_eps("rms_norm_eps"),
)
