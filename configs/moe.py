"""A Qwen3-Next-shaped mixture-of-experts hybrid: ``configs/hybrid.py``'s layers (three Gated
DeltaNet to one gated softmax attention) with a mixture of SwiGLU experts as every MLP, on
MQAR or byte-level text.

    python -m experiments.train --config configs/moe.py --workdir runs/moe_mqar
    python -m experiments.train --config configs/moe.py:small --workdir runs/moe_small
    python -m experiments.train --config configs/moe.py:text_small --workdir runs/moe_text_small
    python -m experiments.train --config configs/moe.py:small --config.mesh.expert=2 \
        --workdir runs/moe_small_ep  # the experts split over 2 devices

The mixture follows Qwen3-Next, scaled down: softmax router, top-k weights renormalised,
a shared expert behind a sigmoid gate, each routed expert a quarter of the dense MLP's
width (8 experts, 2 per token; ``docs/guide/moe.md``). Training adds Switch's
load-balancing loss (0.01) and ST-MoE's router z-loss (1e-3), logged per step.
"""

from ml_collections import ConfigDict

from configs import hybrid

VARIANTS = hybrid.VARIANTS


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or ""
    if arg not in VARIANTS:
        raise ValueError(f"unknown variant {arg!r} of configs/moe.py (try one of {VARIANTS})")
    c = hybrid.get_config(arg)
    m = c.model
    m.mlp = "moe"
    m.moe.num_experts = 8
    m.moe.top_k = 2
    m.moe.hidden = m.width // 2
    m.moe.normalize = True
    m.moe.shared_hidden = m.width
    m.moe.shared_gate = True
    c.optim.load_balancing_loss = 0.01
    c.optim.router_z_loss = 1e-3
    return c
