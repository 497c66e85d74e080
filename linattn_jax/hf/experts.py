"""The softmax model types' mixtures of SwiGLU experts (Qwen3-MoE, Mixtral, DeepSeek-V3):
which layers are mixtures, and their rows. ``transformers`` saves a mixture per expert
(a router, then each expert's three projections under its own prefix) and holds it fused
in memory (``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` ``[e, 2 * hidden, width]``
rows ``[gate | up]``, ``mlp.experts.down_proj`` ``[e, width, hidden]``): a format's
prefixes name both (``FUSED``), and the loader reads a file by the one that names most of
its tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from linattn_jax.hf import qwen3_5_moe, tables

FUSED = qwen3_5_moe.FUSED  # a prefix ending so names the fused layout's table
ROUTER = qwen3_5_moe.ROUTER_RULES[0]  # mlp.gate.weight: our router, transposed
FUSED_RULES = (ROUTER, *tables.FUSED_EXPERT_RULES)


def layout(moe: Sequence[bool]) -> list[str]:
    """Each layer's MLP kind: ``"moe"`` where ``moe[i]``, else ``"swiglu"``."""
    return ["moe" if m else "swiglu" for m in moe]


def table(
    attention: Callable[[Mapping[str, Any]], tuple[tables.Rule, ...]],
    is_moe: Callable[[Mapping[str, Any], int], bool],
    router: tables.Rule,
    expert_rules: tuple[tables.Rule, ...],
    experts: str,
    count: str,
    more: Callable[[Mapping[str, Any], int], tuple[tables.Rule, ...]] = lambda config, i: (),
) -> Callable[[Mapping[str, Any], str], tables.Table]:
    """A table of Llama's layers, the MLP of those ``is_moe`` a mixture: ``router``, then
    ``expert_rules`` under ``{experts}{j}.`` for ``config[count]`` experts (fused: in
    ``transformers``' memory layout for a prefix ending in ``FUSED``), and ``more(config,
    i)``'s rows (a shared expert)."""

    def rows(config: Mapping[str, Any], prefix: str) -> tables.Table:
        fused, prefix = prefix.endswith(FUSED), prefix.removesuffix(FUSED)
        out = [(prefix + r.hf, r) for r in tables.MODEL_RULES]
        for i in range(config["num_hidden_layers"]):
            layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
            out += tables.prefixed(tables.NORM_RULES + attention(config), layer, block)
            if not is_moe(config, i):
                out += tables.prefixed(tables.MLP_RULES, layer, block)
                continue
            if fused:
                out += tables.prefixed(FUSED_RULES, layer, block)
            else:
                out += tables.prefixed((router,), layer, block)
                out += tables.experts(expert_rules, layer, block, config[count], experts)
            out += tables.prefixed(more(config, i), layer, block)
        return out

    return rows
