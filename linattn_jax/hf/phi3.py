"""Phi-3 checkpoints (``Phi3ForCausalLM``, ``model_type`` ``phi3``): Mistral (``hf.mistral``:
a sliding window on every layer, or none) with q, k and v fused in one ``qkv_proj`` (rows
``[q | k | v]``) and the MLP's gate and up in one ``gate_up_proj`` (rows ``[gate | up]``),
both split into our projections (``tables.SPLIT``), and RoPE on the first
``int(head_dim * partial_rotary_factor)`` channels of each head (``rope_parameters``', else
the top-level one, else 1). ``rope_type`` is ``default``: ``transformers``' Phi-3 reads
LongRoPE otherwise (its ``longrope``, and ``su`` and ``yarn`` by their old names), which is
refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping

from linattn_jax.hf import common, llama, mistral, rope, tables
from linattn_jax.hf.tables import LINEAR, SPLIT, rules

# transformers' Phi3Config defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
    num_attention_heads=32, hidden_act="silu", max_position_embeddings=4096,
    original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    sliding_window=None,
)  # fmt: skip
QKV = ("attention.q_proj.kernel", "attention.k_proj.kernel", "attention.v_proj.kernel")
LAYER_RULES = tables.NORM_RULES + rules(
    ("self_attn.qkv_proj.weight", QKV, SPLIT),
    ("self_attn.o_proj.weight", "attention.out_proj.kernel", LINEAR),
    ("mlp.gate_up_proj.weight", ("mlp.gate_proj.kernel", "mlp.up_proj.kernel"), SPLIT),
    ("mlp.down_proj.weight", "mlp.down_proj.kernel", LINEAR),
)


def default_rope(config: common.Config) -> None:
    """Refuses LongRoPE (``longrope``, ``su``, ``yarn``: all of them LongRoPE to Phi-3)."""
    given = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if isinstance(given, Mapping):  # else rope.parameters names it
        kind = given.get("rope_type", given.get("type", "default"))
        if kind != "default":
            raise ValueError(
                "config.json: Phi-3's rope_type must be 'default' (LongRoPE, which Phi-3 reads "
                f"for 'longrope', 'su' and 'yarn', is not supported), got {kind!r}"
            )


def partial_rotary(config: common.Config) -> None:
    """``rope_parameters``' ``partial_rotary_factor`` (the top-level one, else 1), checked."""
    parameters = config["rope_parameters"]
    factor = parameters.setdefault(
        "partial_rotary_factor", config.get("partial_rotary_factor", 1.0)
    )
    rotary = int(config["head_dim"] * factor) if common.is_number(factor) else 0
    if not (common.is_number(factor) and 0 < factor <= 1) or rotary < 2 or rotary % 2:
        raise ValueError(
            "config.json: rope_parameters' partial_rotary_factor must be in (0, 1] and rotate an "
            f"even number >= 2 of head_dim={config['head_dim']} channels, got {factor!r}"
        )


FORMAT = mistral.FORMAT.derive(
    name="Phi-3",
    model_types=("phi3",),
    architecture="Phi3ForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=("sliding_window",)),
        *llama.CHECKS,
        default_rope,
        rope.parameters(10000.0, keys=("partial_rotary_factor",)),
        partial_rotary,
        mistral.window,
    ),
    table=tables.layered(tables.MODEL_RULES, lambda config, i: LAYER_RULES),
)
