"""LFM3 checkpoints (``Lfm3ForCausalLM``, ``model_type`` ``lfm3``): LFM2 (``hf.lfm2``: its
gated short convolutions, of kernel ``conv_L_cache`` 7 by default) with three differences.

- A third layer type, ``"sliding_attention"``: the attention of the last ``sliding_window``
  tokens (our ``"local_softmax"``); by default layer ``i`` is ``"full_attention"`` where
  ``i % 4 == 2``, sliding where ``i % 4 == 0`` (but the first), else ``"conv"``.
- Qwen3's attention (``q_norm``, ``k_norm``, ``o_proj``, biases with ``attention_bias``,
  ``head_dim`` 128 unless given) with RoPE per layer type (``rope_parameters`` holds one
  dict per attention type: by default the sliding layers' plain, base 1e4, the full
  layers' ``"proportional"``, base 1e6, ``partial_rotary_factor`` 0.5:
  ``layers.rope_scaling``) and, with ``use_attention_gate``, each head's output times
  ``sigmoid(gate_proj(x))`` (our ``head_gate``; ``g_proj`` in ``transformers``' memory).
- With ``use_sandwich_norm``, an RMSNorm after each half too (``post_operator_norm``,
  ``post_ffn_norm``: our ``sandwich_norm``); the SwiGLU is ``intermediate_size`` wide
  (no ``block_auto_adjust_ff_dim`` rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, lfm2, llama, rope, tables
from linattn_jax.hf.tables import COPY, LINEAR

# transformers' Lfm3Config defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=128_000, hidden_size=2048, intermediate_size=7680, num_hidden_layers=24,
    num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=128_000,
    norm_eps=1e-5, tie_word_embeddings=True, conv_bias=False, conv_L_cache=7,
    sliding_window=256, use_sandwich_norm=True, use_attention_gate=True, attention_bias=False,
)  # fmt: skip
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5,
    },
}  # fmt: skip
LAYER_KINDS = dict(lfm2.LAYER_KINDS, sliding_attention="local_softmax")

SANDWICH_RULES = tables.rules(
    ("post_operator_norm.weight", "attention_post_norm.scale", COPY),
    ("post_ffn_norm.weight", "mlp_post_norm.scale", COPY),
)
GATE_RULES = tables.rules(("self_attn.gate_proj.weight", "attention.g_proj.kernel", LINEAR))


def layer_types(config: common.Config) -> None:
    """Fills in ``layer_types`` where null as ``transformers`` does, and checks it and
    ``sliding_window`` (an int >= 1, or null)."""
    if config.get("layer_types") is None:
        config["layer_types"] = [
            "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i else "conv"
            for i in range(config["num_hidden_layers"])
        ]
    common.check_layer_types(config, tuple(LAYER_KINDS))
    if config["sliding_window"] is not None:  # null: the sliding layers see every token
        common.check_ints(config, ("sliding_window",))


def rope_by_layer_type(config: common.Config) -> None:
    """``rope_parameters`` as one checked dict per attention type (``ROPE`` where null)."""
    given = config.get("rope_parameters") or ROPE
    if not isinstance(given, Mapping) or not set(given) <= set(ROPE):
        raise ValueError(
            f"config.json: rope_parameters must be one dict per layer type {list(ROPE)}, got "
            f"{given!r}"
        )
    config["rope_parameters"] = {
        name: rope.normalize(
            given.get(name, default), config, default["rope_theta"], ("partial_rotary_factor",),
            name=name,
        )
        for name, default in ROPE.items()
    }  # fmt: skip


def mixer_rules(config: Mapping[str, Any], i: int) -> tuple[tables.Rule, ...]:
    """Layer ``i``'s mixer rows: Qwen3's attention (and its gate), or LFM2's convolution."""
    if config["layer_types"][i] == "conv":
        return lfm2.mixer_rules(config, i)
    bias = config["attention_bias"]
    rows = llama.attention_rules(bias, bias) + tables.QK_NORM_RULES
    return rows + (GATE_RULES if config["use_attention_gate"] else ())


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Each layer of ``layer_types``: gated QK-normed attention, full or sliding, each of its
    RoPE, or the gated short convolution; sandwich norms with ``use_sandwich_norm``."""
    bias = config["attention_bias"]
    more = dict(qk_norm=True, head_gate=config["use_attention_gate"], qkv_bias=bias, out_bias=bias)
    by_type = config["rope_parameters"]
    softmax = llama.softmax_options(config, by_type["full_attention"], **more)
    local = llama.softmax_options(config, by_type["sliding_attention"], **more)
    local.update(sliding_window=config["sliding_window"])
    conv = dict(conv_size=config["conv_L_cache"], use_bias=config["conv_bias"])
    kinds = [LAYER_KINDS[t] for t in config["layer_types"]]
    kind_options = {"softmax": softmax, "local_softmax": local, "gated_conv": conv}
    return dict(
        llama.layered_options(config, kinds, kind_options),
        sandwich_norm=config["use_sandwich_norm"],
    )


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """LFM2's table, with Qwen3's attention rows and the sandwich norms."""
    sandwich = lambda: SANDWICH_RULES if config["use_sandwich_norm"] else ()
    return tables.layered(
        lfm2.MODEL_RULES,
        lambda config, i: lfm2.NORM_RULES + sandwich() + mixer_rules(config, i) + lfm2.MLP_RULES,
    )(config, prefix)


FORMAT = lfm2.FORMAT.derive(
    name="LFM3",
    model_types=("lfm3",),
    architecture="Lfm3ForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=("sliding_window",)),
        *lfm2.CHECKS,
        common.bools(("attention_bias", "use_sandwich_norm", "use_attention_gate")),
        layer_types,
        rope_by_layer_type,
    ),
    options=options,
    table=table,
)
