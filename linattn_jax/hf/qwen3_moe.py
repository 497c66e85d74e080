"""Qwen3-MoE checkpoints (``Qwen3MoeForCausalLM``, ``model_type`` ``qwen3_moe``): Qwen3
(``hf.qwen3``: QK-norm, biases with ``attention_bias``) whose MLPs are mixtures
(``layers.MoE``): a softmax router over ``num_experts`` (saved as ``num_local_experts``)
choosing ``num_experts_per_tok``, renormalised with ``norm_topk_prob``, SwiGLU experts of
``moe_intermediate_size``, on every ``decoder_sparse_step``-th layer but those of
``mlp_only_layers`` (a SwiGLU of ``intermediate_size``). ``head_dim`` is ``hidden_size /
num_attention_heads`` unless given; with ``use_sliding_window`` every layer slides over
``sliding_window`` tokens. Experts as ``hf.experts`` reads them (per expert under
``mlp.experts.{j}.``, or fused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, experts, llama, qwen2, qwen3, tables

# transformers' Qwen3MoeConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=32, num_key_value_heads=4, hidden_act="silu",
    max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1,
    moe_intermediate_size=768, num_experts_per_tok=8, norm_topk_prob=False,
    mlp_only_layers=[],
)  # fmt: skip
MOE_INTS = ("decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok")


def experts_count(config: common.Config) -> None:
    """``num_local_experts``, the name ``transformers`` saves ``num_experts`` under (an
    older config's ``num_experts`` read as it; 128 where neither is given)."""
    named = config.pop("num_experts", None)
    if config.get("num_local_experts") is None:
        config["num_local_experts"] = 128 if named is None else named


def is_moe(config: Mapping[str, Any], i: int) -> bool:
    """Whether layer ``i``'s MLP is a mixture, as ``transformers``' Qwen3-MoE decides."""
    sparse = (i + 1) % config["decoder_sparse_step"] == 0
    return i not in config["mlp_only_layers"] and sparse


def check_moe(config: common.Config) -> None:
    """Checks the mixture's fields and the window's."""
    common.check_ints(config, MOE_INTS + ("num_local_experts",))
    common.check_at_most(config, "num_experts_per_tok", "num_local_experts")
    common.check_bools(config, ("norm_topk_prob", "attention_bias", "use_sliding_window"))
    only = config["mlp_only_layers"]
    if not isinstance(only, list) or not all(common.is_int(i) for i in only):
        raise ValueError(f"config.json: mlp_only_layers must be a list of ints, got {only!r}")
    if qwen2.window(config) is not None:
        common.check_ints(config, ("sliding_window",))


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer Qwen3's attention (every one windowed with ``use_sliding_window``), the
    mixtures ``layers.MoE`` of SwiGLU experts."""
    bias = config["attention_bias"]
    softmax = llama.softmax_options(
        config, qk_norm=True, qkv_bias=bias, out_bias=bias, sliding_window=qwen2.window(config)
    )
    mlps = experts.layout([is_moe(config, i) for i in range(config["num_hidden_layers"])])
    moe = dict(
        num_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        hidden=config["moe_intermediate_size"],
        normalize=config["norm_topk_prob"],
    )
    return llama.layered_options(config, ["softmax"], {"softmax": softmax}, mlp=mlps) | dict(
        moe=moe
    )


FORMAT = qwen3.FORMAT.derive(
    name="Qwen3-MoE",
    model_types=("qwen3_moe",),
    architecture="Qwen3MoeForCausalLM",
    steps=llama.windowed_steps(DEFAULTS, 10000.0, experts_count, check_moe),
    options=options,
    table=experts.table(
        qwen3.attention_rules,
        is_moe,
        experts.ROUTER,
        tables.EXPERT_RULES,
        "mlp.experts.",
        "num_local_experts",
    ),
    prefixes=("model.", "model." + experts.FUSED),
)
