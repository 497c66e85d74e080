"""Mixtral checkpoints (``MixtralForCausalLM``, ``model_type`` ``mixtral``): Mistral
(``hf.mistral``: its window, none by default) whose every MLP is a mixture
(``layers.MoE``): a softmax router over ``num_local_experts`` choosing
``num_experts_per_tok``, the chosen weights renormalised, SwiGLU experts of
``intermediate_size``: saved per expert as ``block_sparse_moe.experts.{j}.w1`` (gate),
``w3`` (up) and ``w2`` (down) beside ``block_sparse_moe.gate`` (the router), or fused
(``hf.experts``). ``rope_theta`` is 1e6 unless given; ``router_jitter_noise`` acts in
``transformers``' training only and is not applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, experts, llama, minimax, mistral, tables

# transformers' MixtralConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    mistral.DEFAULTS, rms_norm_eps=1e-5, sliding_window=None, num_experts_per_tok=2,
    num_local_experts=8, router_jitter_noise=0.0,
)  # fmt: skip


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Mistral's, every MLP a ``layers.MoE`` of SwiGLU experts."""
    moe = dict(
        num_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        hidden=config["intermediate_size"],
        normalize=True,
    )
    return mistral.FORMAT.options(config) | dict(mlp="moe", moe=moe)


FORMAT = mistral.FORMAT.derive(
    name="Mixtral",
    model_types=("mixtral",),
    architecture="MixtralForCausalLM",
    steps=llama.windowed_steps(
        DEFAULTS,
        1e6,
        mistral.window,
        common.ints(("num_experts_per_tok", "num_local_experts")),
        common.at_most("num_experts_per_tok", "num_local_experts"),
        common.numbers(("router_jitter_noise",)),
    ),
    options=options,
    table=experts.table(
        lambda config: tables.ATTENTION_RULES,
        lambda config, i: True,
        minimax.ROUTER_RULES[0],
        minimax.EXPERT_RULES,
        "block_sparse_moe.experts.",
        "num_local_experts",
    ),
    prefixes=("model.", "model." + experts.FUSED),
)
