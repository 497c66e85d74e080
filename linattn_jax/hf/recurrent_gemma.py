"""RecurrentGemma checkpoints (``RecurrentGemmaForCausalLM``, ``model_type``
``recurrent_gemma``): Griffin's recurrent blocks (our ``"rglru"``) and local multi-query
attention (our ``"local_softmax"``) in the order ``block_types`` repeats, with

* every RMSNorm in Gemma's ``x * (1 + w)`` form (``zero_centred_norm``):
  ``temporal_pre_norm`` before the mixer, ``channel_pre_norm`` before the MLP,
  ``final_norm``; a GeGLU MLP of ``intermediate_size / 2`` hidden channels with biases on
  its three projections (``mlp_bias``);
* the embeddings times ``sqrt(hidden_size)`` rounded to bfloat16, as ``transformers``'
  ``normalizer`` buffer is (``embedding_multiplier``); the logits soft-capped,
  ``cap * tanh(logits / cap)`` with ``logits_soft_cap``;
* the attention: ``num_key_value_heads`` (1 in the releases: multi-query) over
  ``head_dim = hidden_size / num_attention_heads``, RoPE on the first half of each head
  (``partial_rotary_factor`` 0.5), a window of ``attention_window_size`` tokens, biases on
  q, k, v with ``attention_bias`` and always on the output;
* the recurrent block: ``linear_y``, ``linear_x``, ``linear_out`` and the depthwise
  ``conv_1d`` (``conv1d_width``) with biases, the RG-LRU's ``recurrent_param`` and its
  block-diagonal gates over ``num_attention_heads`` blocks of ``lru_width`` (null:
  ``hidden_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from linattn_jax.hf import common, llama, phi3, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR, rules

# transformers' RecurrentGemmaConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    num_hidden_layers=26, vocab_size=256000, hidden_size=2560, intermediate_size=3 * 2560,
    num_attention_heads=10, lru_width=None, attention_window_size=2048, conv1d_width=4,
    logits_soft_cap=30.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    block_types=["recurrent", "recurrent", "attention"], attention_dropout=0.0,
    num_key_value_heads=None, attention_bias=False, tie_word_embeddings=True,
)  # fmt: skip
BLOCK_KINDS = {"recurrent": "rglru", "attention": "local_softmax"}
INT_FIELDS = (
    "vocab_size", "intermediate_size", "lru_width", "num_key_value_heads",
    "attention_window_size", "conv1d_width",
)  # fmt: skip
RG_LRU_PARAMS = (
    "recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
    "recurrent_gate_bias",
)  # fmt: skip


def derived(config: common.Config) -> None:
    """``lru_width`` (``hidden_size``), ``num_key_value_heads`` (``num_attention_heads``)
    where null and ``head_dim`` (``hidden_size / num_attention_heads``), as
    ``transformers`` derives them; ``block_types`` checked."""
    if config.get("lru_width") is None:
        config["lru_width"] = config["hidden_size"]
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config["num_attention_heads"]
    common.check_ints(config, ("hidden_size", "num_attention_heads", "num_hidden_layers"))
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    types = config["block_types"]
    if not isinstance(types, list) or not types or any(t not in BLOCK_KINDS for t in types):
        raise ValueError(
            f"config.json: block_types must be a non-empty list of {list(BLOCK_KINDS)}, "
            f"got {types!r}"
        )


def partial_rotary(config: common.Config) -> None:
    """``rope_parameters``' ``partial_rotary_factor`` (the top-level one, else 0.5)."""
    config["rope_parameters"].setdefault(
        "partial_rotary_factor", config.pop("partial_rotary_factor", 0.5)
    )
    phi3.partial_rotary(config)


def kinds(config: Mapping[str, Any]) -> list[str]:
    """Each layer's kind: ``block_types`` repeated over the depth."""
    types = config["block_types"]
    return [BLOCK_KINDS[types[i % len(types)]] for i in range(config["num_hidden_layers"])]


def embedding_scale(hidden_size: int) -> float:
    """``sqrt(hidden_size)`` rounded to bfloat16 (``transformers``' ``normalizer``)."""
    return float(np.asarray(hidden_size**0.5, jnp.bfloat16))


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The layers of ``block_types``, GeGLU MLPs with biases, Gemma's norms and scales."""
    local = llama.softmax_options(
        config, qkv_bias=config["attention_bias"], out_bias=True,
        sliding_window=config["attention_window_size"],
    )  # fmt: skip
    recurrent = dict(lru_width=config["lru_width"], conv_size=config["conv1d_width"])
    layers = llama.layered_options(
        config, kinds(config), {"rglru": recurrent, "local_softmax": local}, mlp="geglu"
    )
    return dict(
        layers,
        mlp_hidden=config["intermediate_size"] // 2,
        mlp_bias=True,
        zero_centred_norm=True,
        embedding_multiplier=embedding_scale(config["hidden_size"]),
        logit_soft_cap=float(config["logits_soft_cap"]),
    )


MODEL_RULES = rules(
    ("embed_tokens.weight", "embed.embedding", COPY),
    ("final_norm.weight", "norm.scale", COPY),
)
NORM_RULES = rules(
    ("temporal_pre_norm.weight", "attention_norm.scale", COPY),
    ("channel_pre_norm.weight", "mlp_norm.scale", COPY),
)


def biased(hf: str, ours: str, names: tuple[str, ...]) -> tuple[tables.Rule, ...]:
    """The rows of biased linear maps ``names`` under ``hf.`` and ``ours.``."""
    return rules(
        *((f"{hf}.{n}.weight", f"{ours}.{n}.kernel", LINEAR) for n in names),
        *((f"{hf}.{n}.bias", f"{ours}.{n}.bias", COPY) for n in names),
    )


MLP_RULES = biased("mlp_block", "mlp", ("gate_proj", "up_proj", "down_proj"))
RECURRENT_RULES = biased("temporal_block", "attention", ("linear_y", "linear_x", "linear_out"))
RECURRENT_RULES += rules(
    ("temporal_block.conv_1d.weight", "attention.conv_1d.kernel", CONV),
    ("temporal_block.conv_1d.bias", "attention.conv_1d.bias", COPY),
    *((f"temporal_block.rg_lru.{p}", f"attention.{p}", COPY) for p in RG_LRU_PARAMS),
)


def attention_rules(config: Mapping[str, Any]) -> tuple[tables.Rule, ...]:
    """The local attention's rows under ``temporal_block.``."""
    rows = llama.attention_rules(config["attention_bias"], True)
    return tuple(r.at(r.hf.replace("self_attn.", "temporal_block."), r.ours) for r in rows)


def layer_rules(config: Mapping[str, Any], i: int) -> tuple[tables.Rule, ...]:
    """Layer ``i``'s rows: its two norms, its mixer, its MLP."""
    mixer = RECURRENT_RULES if kinds(config)[i] == "rglru" else attention_rules(config)
    return NORM_RULES + mixer + MLP_RULES


FORMAT = common.ModelFormat(
    name="RecurrentGemma",
    model_types=("recurrent_gemma",),
    architecture="RecurrentGemmaForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=("lru_width", "num_key_value_heads")),
        derived,
        common.ints(INT_FIELDS),
        common.divides("num_key_value_heads", "num_attention_heads"),
        common.divides("num_attention_heads", "lru_width"),
        common.bools(("tie_word_embeddings", "attention_bias")),
        common.numbers(("rms_norm_eps",)),
        common.positive(("logits_soft_cap",)),
        common.choice("hidden_activation", ("gelu_pytorch_tanh",)),
        common.unsupported({"attention_dropout": (0.0, 0)}),
        common.plain_rope(10000.0),
        partial_rotary,
    ),
    options=options,
    table=tables.layered(MODEL_RULES, layer_rules),
    finish=common.rms_norm_eps("rms_norm_eps"),
)
