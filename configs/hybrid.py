"""A Qwen3.5-shaped hybrid: three Gated DeltaNet layers to one gated softmax-attention layer
(Qwen3-Next's ``full_attention_interval`` 4), on MQAR or byte-level text.

    python -m experiments.train --config configs/hybrid.py --workdir runs/hybrid_mqar
    python -m experiments.train --config configs/hybrid.py:small --workdir runs/hybrid_small
    python -m experiments.train --config configs/hybrid.py:text --workdir runs/hybrid_text
    python -m experiments.train --config configs/hybrid.py:text_small \
        --workdir runs/hybrid_text_small
    python -m experiments.train --config configs/hybrid.py:mamba2_small \
        --workdir runs/hybrid_mamba2_small
    python -m experiments.train --config configs/hybrid.py:mamba_small \
        --workdir runs/hybrid_mamba_small

The layers follow Qwen3-Next / Qwen3.5, scaled down: Gated DeltaNet with grouped value heads
(2 key heads, 4 value heads, dk = dv, a short convolution of 4), gated attention with GQA 4:1
(one KV head), head_dim 64, partial RoPE (a quarter of each head, theta 1e7) and QK-norm;
zero-centred RMSNorms (``x * (1 + w)``) and a SwiGLU MLP. ``:small`` (MQAR, dk = dv = 32)
and ``:text_small`` run on a CPU in minutes; the others are the tasks' full settings.

``:mamba2`` and ``:mamba2_small`` (MQAR) put Mamba-2 mixers (``"3 mamba2 : 1 softmax"``:
``model.num_heads`` SSD heads of ``2 * width / num_heads`` channels, Mamba-2's state of 128,
its convolution of 4) in the Gated DeltaNet layers' place, with plain RMSNorms; ``:mamba``
and ``:mamba_small`` Mamba-1 mixers (``"3 mamba : 1 softmax"``: ``2 * width`` channels of
16 states, its convolution of 4) likewise.
"""

from ml_collections import ConfigDict

from configs import mqar, text_lm

VARIANTS = ("", "small", "text", "text_small", "mamba2", "mamba2_small", "mamba", "mamba_small")


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or ""
    if arg not in VARIANTS:
        raise ValueError(f"unknown variant {arg!r} of configs/hybrid.py (try one of {VARIANTS})")
    small = arg.endswith("small")
    task = text_lm if arg.startswith("text") else mqar
    c = task.get_config("small" if small else None)  # locked: only its fields are set below
    m = c.model
    m.attention = "3 gated_deltanet : 1 softmax"
    m.depth = 4
    m.width = 64 if small else 128
    m.num_heads = 2  # the delta layers' key heads (the softmax layers set their own)
    m.short_conv = 0  # the delta layers have their own convolution
    m.chunk_size = 16 if small else 64
    m.mlp = "swiglu"
    m.mlp_hidden = 3 * m.width
    m.zero_centred_norm = True
    m.delta.num_heads = 2
    m.delta.num_v_heads = 4
    m.delta.head_dim = m.width // 2
    m.delta.value_head_dim = m.width // 2
    m.delta.conv_size = 4
    m.softmax.num_heads = 4
    m.softmax.num_kv_heads = 1
    m.softmax.head_dim = 64
    m.softmax.rope = True
    m.softmax.rope_theta = 1e7
    m.softmax.partial_rotary_factor = 0.25
    m.softmax.qk_norm = True
    m.softmax.zero_centred_qk_norm = True
    m.softmax.output_gate = True
    if arg.startswith("mamba2"):
        m.attention = "3 mamba2 : 1 softmax"
        m.num_heads = 2  # the Mamba-2 layers' SSD heads
        m.zero_centred_norm = False
    if arg in ("mamba", "mamba_small"):
        m.attention = "3 mamba : 1 softmax"
        m.zero_centred_norm = False
    return c
