"""Qwen3 checkpoints (``Qwen3ForCausalLM``, ``model_type`` ``qwen3``): Qwen2 (``hf.qwen2``:
its sliding-window layers) with an RMSNorm over each head's q and k before RoPE (one weight
``[head_dim]`` shared by the heads: our ``qk_norm``), ``head_dim`` 128 unless given, and
biases on the four projections only with ``attention_bias`` (as Llama's).
"""

from __future__ import annotations

from linattn_jax.hf import common, llama, qwen2, tables

# transformers' Qwen3Config defaults (head_dim's is not hidden_size / num_attention_heads).
DEFAULTS = dict(qwen2.DEFAULTS, head_dim=128, attention_bias=False)


def attention_rules(config) -> tuple[tables.Rule, ...]:
    """The attention's rows: QK-norm, and biases where it has them."""
    bias = config["attention_bias"]
    return llama.attention_rules(bias, bias) + tables.QK_NORM_RULES


FORMAT = qwen2.FORMAT.derive(
    name="Qwen3",
    model_types=("qwen3",),
    architecture="Qwen3ForCausalLM",
    steps=llama.windowed_steps(
        DEFAULTS,
        10000.0,
        common.bools(("attention_bias",)),
        qwen2.layer_types,
    ),
    options=lambda config: qwen2.windowed_options(
        config, qk_norm=True, qkv_bias=config["attention_bias"], out_bias=config["attention_bias"]
    ),
    table=llama.table(attention_rules),
)
