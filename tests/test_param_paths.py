"""Every layer type's variables keep their paths (the nnx state paths, with each variable's
type and shape): checkpoints, ``linattn_jax.hf``'s weight tables and the trainer's restores
name parameters by these paths, so a refactor of a layer must not move one.

``EXPECTED`` was computed on main at 007b5f9, before the layers were split into smaller
pieces (#48), by ``python -m tests.test_param_paths``. The layers are built abstractly
(``nnx.eval_shape``): nothing is initialised or compiled.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

from linattn_jax import layers, models

SMALL_MOE = dict(num_experts=4, top_k=2, hidden=8, score="sigmoid", score_bias=True)

# Each layer type, with options that build every optional piece at least once.
CASES = {
    "linear": lambda r: layers.LinearAttention(16, 2, rngs=r),
    "linear_head_gate_hedgehog_norm": lambda r: layers.LinearAttention(
        16, 2, gate=True, feature_map="hedgehog", normalize=False, rngs=r
    ),
    "linear_channel_gate_favor_dropout": lambda r: layers.LinearAttention(
        16,
        2,
        gate="channel",
        feature_map="favor_plus",
        num_features=4,
        feature_dim=4,
        dropout_rate=0.1,
        rngs=r,
    ),  # fmt: skip
    "deltanet_plain": lambda r: layers.DeltaRuleAttention(
        16, 2, variant="deltanet", conv_size=0, output_gate=False, rngs=r
    ),
    "gated_deltanet": lambda r: layers.DeltaRuleAttention(16, 2, rngs=r),
    "kda_grouped_low_rank": lambda r: layers.DeltaRuleAttention(
        16,
        2,
        variant="kda",
        num_v_heads=4,
        gate_rank=3,
        output_gate_rank=5,
        output_gate_activation="sigmoid",
        dropout_rate=0.1,
        rngs=r,
    ),  # fmt: skip
    "mamba2": lambda r: layers.Mamba2Mixer(16, 2, state_dim=4, n_groups=2, rngs=r),
    "mamba2_bare": lambda r: layers.Mamba2Mixer(
        16,
        2,
        state_dim=4,
        head_dim=4,
        use_conv_bias=False,
        use_bias=True,
        norm="none",
        projection_multipliers=(1.0, 2.0, 1.0, 1.0, 0.5),
        rngs=r,
    ),  # fmt: skip
    "mlstm": lambda r: layers.MLSTMLayer(16, 2, use_bias=True, rngs=r),
    "rwkv_block": lambda r: layers.TransformerBlock(
        16, 2, attention="rwkv", mlp="rwkv", mlp_hidden=24, norm="layer", wkv_width=12, rngs=r
    ),
    "mamba": lambda r: layers.MambaMixer(16, state_dim=4, dt_rank=3, use_bias=True, rngs=r),
    "mamba_normed": lambda r: layers.MambaMixer(
        16,
        state_dim=4,
        dt_rank=3,
        use_conv_bias=False,
        mixer_rms_eps=1e-6,
        mixer_rms_weights=True,
        rngs=r,
    ),  # fmt: skip
    "mamba_heads": lambda r: layers.MambaMixer(16, state_dim=4, dt_rank=3, heads=2, rngs=r),
    "lightning": lambda r: layers.LightningAttention(16, 2, layer_index=1, num_layers=3, rngs=r),
    "softmax": lambda r: layers.SoftmaxAttention(16, 2, rngs=r),
    "softmax_gqa_rope_norms_gate": lambda r: layers.SoftmaxAttention(
        16,
        4,
        num_kv_heads=2,
        head_dim=6,
        rope=True,
        qk_norm=True,
        output_gate=True,
        dropout_rate=0.1,
        rngs=r,
    ),  # fmt: skip
    "latent": lambda r: layers.LatentAttention(16, 2, kv_lora_rank=8, rngs=r),
    "latent_q_lora_rope": lambda r: layers.LatentAttention(
        16,
        2,
        kv_lora_rank=8,
        q_lora_rank=6,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=4,
        rope=True,
        rngs=r,
    ),  # fmt: skip
    "block_gelu": lambda r: layers.TransformerBlock(16, 2, rngs=r),
    "block_swiglu_conv_zero_centred": lambda r: layers.TransformerBlock(
        16, 2, attention="softmax", mlp="swiglu", short_conv=3, zero_centred_norm=True, rngs=r
    ),
    "block_moe_shared": lambda r: layers.TransformerBlock(
        16,
        2,
        attention="gated_deltanet",
        mlp="moe",
        moe=dict(SMALL_MOE, shared_hidden=8, shared_gate=True),
        rngs=r,
    ),  # fmt: skip
    "block_parallel": lambda r: layers.TransformerBlock(
        16,
        2,
        attention="softmax",
        mlp="swiglu",
        parallel={"attention": "mamba2", "state_dim": 4},
        rngs=r,
    ),  # fmt: skip
    "block_mlp_only_relu2": lambda r: layers.TransformerBlock(
        16, 2, attention="mlp", mlp="relu2", rngs=r
    ),
    "block_mixer_only_post_norm": lambda r: layers.TransformerBlock(
        16, 2, attention="kda", mlp="none", post_norm=True, rngs=r
    ),
    "gated_conv": lambda r: layers.GatedShortConv(16, 2, use_bias=True, rngs=r),
    "softmax_head_gate": lambda r: layers.SoftmaxAttention(16, 2, head_gate=True, rngs=r),
    "kda_full_rank_bounded": lambda r: layers.DeltaRuleAttention(
        16, 2, variant="kda", gate_rank=0, gate_lower_bound=-5.0, rngs=r
    ),
    "latent_head_gate": lambda r: layers.LatentAttention(16, 2, head_gate=True, rngs=r),
    "language_model_hybrid": lambda r: models.LanguageModel(
        32, 16, 2, 2, attention="1 gated_deltanet : 1 softmax", mlp="swiglu", rngs=r
    ),
    "block_moe_relu2": lambda r: layers.TransformerBlock(
        16,
        2,
        attention="mlp",
        mlp="moe",
        moe=dict(SMALL_MOE, shared_hidden=8, activation="relu2"),
        rngs=r,
    ),
    "shared_blocks": lambda r: layers.SharedBlocks(
        16,
        3,
        layers=(0, 2),
        num_heads=2,
        mlp_hidden=8,
        adapter_rank=2,
        attention_adapters=True,
        mlp_bias=True,
        rngs=r,
    ),
    "rglru": lambda r: layers.RGLRUBlock(16, 2, lru_width=8, conv_size=3, rngs=r),
    "block_rglru_geglu_bias": lambda r: layers.TransformerBlock(
        16,
        2,
        attention="rglru",
        lru_width=8,
        conv_size=3,
        mlp="geglu",
        mlp_bias=True,
        mlp_hidden=6,
        rngs=r,
    ),  # fmt: skip
}


def param_paths(build) -> list[str]:
    """``"path/to/variable Type shape"`` for every variable of the layer ``build`` makes."""
    module = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    rows = []
    for path, variable in nnx.to_flat_state(nnx.state(module)):
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        shape = "x".join(map(str, getattr(value, "shape", ()))) or "()"
        rows.append(f"{'/'.join(map(str, path))} {type(variable).__name__} {shape}")
    return sorted(rows)


EXPECTED: dict[str, list[str]] = {
    "block_gelu": [
        "attention/k_proj/kernel Param 16x16",
        "attention/out_proj/kernel Param 16x16",
        "attention/q_proj/kernel Param 16x16",
        "attention/v_proj/kernel Param 16x16",
        "attention_norm/scale Param 16",
        "mlp/down/bias Param 16",
        "mlp/down/kernel Param 64x16",
        "mlp/up/bias Param 64",
        "mlp/up/kernel Param 16x64",
        "mlp_norm/scale Param 16",
    ],
    "block_mixer_only_post_norm": [
        "attention/beta_proj/kernel Param 16x2",
        "attention/conv/kernel Param 4x48",
        "attention/g_proj/kernel Param 16x16",
        "attention/gate/A_log Param 2",
        "attention/gate/dt_bias Param 16",
        "attention/gate/proj/layers/0/kernel Param 16x8",
        "attention/gate/proj/layers/1/kernel Param 8x16",
        "attention/k_proj/kernel Param 16x16",
        "attention/out_proj/kernel Param 16x16",
        "attention/output_norm/scale Param 8",
        "attention/q_proj/kernel Param 16x16",
        "attention/v_proj/kernel Param 16x16",
        "attention_norm/scale Param 16",
    ],
    "block_mlp_only_relu2": [
        "mlp/down_proj/kernel Param 64x16",
        "mlp/up_proj/kernel Param 16x64",
        "mlp_norm/scale Param 16",
    ],
    "block_moe_shared": [
        "attention/beta_proj/kernel Param 16x2",
        "attention/conv/kernel Param 4x48",
        "attention/g_proj/kernel Param 16x16",
        "attention/gate/A_log Param 2",
        "attention/gate/dt_bias Param 2",
        "attention/gate/proj/kernel Param 16x2",
        "attention/k_proj/kernel Param 16x16",
        "attention/out_proj/kernel Param 16x16",
        "attention/output_norm/scale Param 8",
        "attention/q_proj/kernel Param 16x16",
        "attention/v_proj/kernel Param 16x16",
        "attention_norm/scale Param 16",
        "mlp/bias RouterBias 4",
        "mlp/down Param 4x8x16",
        "mlp/gate Param 4x16x8",
        "mlp/losses RouterLosses 2",
        "mlp/router Param 16x4",
        "mlp/shared/down_proj/kernel Param 8x16",
        "mlp/shared/gate_proj/kernel Param 16x8",
        "mlp/shared/up_proj/kernel Param 16x8",
        "mlp/shared_gate/kernel Param 16x1",
        "mlp/up Param 4x16x8",
        "mlp_norm/scale Param 16",
    ],
    "block_parallel": [
        "attention/k_proj/kernel Param 16x16",
        "attention/out_proj/kernel Param 16x16",
        "attention/q_proj/kernel Param 16x16",
        "attention/v_proj/kernel Param 16x16",
        "attention_norm/scale Param 16",
        "mlp/down_proj/kernel Param 64x16",
        "mlp/gate_proj/kernel Param 16x64",
        "mlp/up_proj/kernel Param 16x64",
        "mlp_norm/scale Param 16",
        "parallel/A_log Param 2",
        "parallel/D Param 2",
        "parallel/conv/kernel Param 4x40",
        "parallel/conv_bias Param 40",
        "parallel/dt_bias Param 2",
        "parallel/in_proj/kernel Param 16x74",
        "parallel/norm/weight Param 32",
        "parallel/out_proj/kernel Param 32x16",
    ],
    "block_swiglu_conv_zero_centred": [
        "attention/k_proj/kernel Param 16x16",
        "attention/out_proj/kernel Param 16x16",
        "attention/q_proj/kernel Param 16x16",
        "attention/v_proj/kernel Param 16x16",
        "attention_norm/scale Param 16",
        "conv/kernel Param 3x16",
        "mlp/down_proj/kernel Param 64x16",
        "mlp/gate_proj/kernel Param 16x64",
        "mlp/up_proj/kernel Param 16x64",
        "mlp_norm/scale Param 16",
    ],
    "deltanet_plain": [
        "beta_proj/kernel Param 16x2",
        "k_proj/kernel Param 16x16",
        "out_proj/kernel Param 16x16",
        "output_norm/scale Param 8",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x16",
    ],
    "gated_deltanet": [
        "beta_proj/kernel Param 16x2",
        "conv/kernel Param 4x48",
        "g_proj/kernel Param 16x16",
        "gate/A_log Param 2",
        "gate/dt_bias Param 2",
        "gate/proj/kernel Param 16x2",
        "k_proj/kernel Param 16x16",
        "out_proj/kernel Param 16x16",
        "output_norm/scale Param 8",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x16",
    ],
    "kda_grouped_low_rank": [
        "beta_proj/kernel Param 16x4",
        "conv/kernel Param 4x64",
        "dropout/rngs/count RngCount ()",
        "dropout/rngs/key RngKey ()",
        "g_proj/layers/0/kernel Param 16x5",
        "g_proj/layers/1/kernel Param 5x32",
        "gate/A_log Param 4",
        "gate/dt_bias Param 32",
        "gate/proj/layers/0/kernel Param 16x3",
        "gate/proj/layers/1/kernel Param 3x32",
        "k_proj/kernel Param 16x16",
        "out_proj/kernel Param 32x16",
        "output_norm/scale Param 8",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x32",
    ],
    "language_model_hybrid": [
        "blocks/0/attention/beta_proj/kernel Param 16x2",
        "blocks/0/attention/conv/kernel Param 4x48",
        "blocks/0/attention/g_proj/kernel Param 16x16",
        "blocks/0/attention/gate/A_log Param 2",
        "blocks/0/attention/gate/dt_bias Param 2",
        "blocks/0/attention/gate/proj/kernel Param 16x2",
        "blocks/0/attention/k_proj/kernel Param 16x16",
        "blocks/0/attention/out_proj/kernel Param 16x16",
        "blocks/0/attention/output_norm/scale Param 8",
        "blocks/0/attention/q_proj/kernel Param 16x16",
        "blocks/0/attention/v_proj/kernel Param 16x16",
        "blocks/0/attention_norm/scale Param 16",
        "blocks/0/mlp/down_proj/kernel Param 64x16",
        "blocks/0/mlp/gate_proj/kernel Param 16x64",
        "blocks/0/mlp/up_proj/kernel Param 16x64",
        "blocks/0/mlp_norm/scale Param 16",
        "blocks/1/attention/k_proj/kernel Param 16x16",
        "blocks/1/attention/out_proj/kernel Param 16x16",
        "blocks/1/attention/q_proj/kernel Param 16x16",
        "blocks/1/attention/v_proj/kernel Param 16x16",
        "blocks/1/attention_norm/scale Param 16",
        "blocks/1/mlp/down_proj/kernel Param 64x16",
        "blocks/1/mlp/gate_proj/kernel Param 16x64",
        "blocks/1/mlp/up_proj/kernel Param 16x64",
        "blocks/1/mlp_norm/scale Param 16",
        "embed/embedding Param 32x16",
        "norm/scale Param 16",
    ],
    "latent": [
        "kv_a_proj/kernel Param 16x12",
        "kv_b_proj/kernel Param 8x32",
        "kv_norm/scale Param 8",
        "out_proj/kernel Param 16x16",
        "q_proj/kernel Param 16x24",
    ],
    "latent_q_lora_rope": [
        "kv_a_proj/kernel Param 16x10",
        "kv_b_proj/kernel Param 8x16",
        "kv_norm/scale Param 8",
        "out_proj/kernel Param 8x16",
        "q_a_norm/scale Param 6",
        "q_a_proj/kernel Param 16x6",
        "q_b_proj/kernel Param 6x12",
    ],
    "gated_conv": [
        "conv/kernel Param 3x16",
        "conv_bias Param 16",
        "in_proj/bias Param 48",
        "in_proj/kernel Param 16x48",
        "out_proj/bias Param 16",
        "out_proj/kernel Param 16x16",
    ],
    "softmax_head_gate": [
        "g_proj/kernel Param 16x2",
        "k_proj/kernel Param 16x16",
        "out_proj/kernel Param 16x16",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x16",
    ],
    "lightning": [
        "k_proj/kernel Param 16x16",
        "norm/scale Param 16",
        "out_proj/kernel Param 16x16",
        "output_gate/kernel Param 16x16",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x16",
    ],
    "linear": [
        "k_proj/kernel Param 16x16",
        "out_proj/kernel Param 16x16",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x16",
    ],
    "linear_channel_gate_favor_dropout": [
        "dropout/rngs/count RngCount ()",
        "dropout/rngs/key RngKey ()",
        "gate/proj/layers/0/kernel Param 16x16",
        "gate/proj/layers/1/bias Param 8",
        "gate/proj/layers/1/kernel Param 16x8",
        "k_proj/kernel Param 16x8",
        "out_proj/kernel Param 16x16",
        "projection RandomProjection 4x4",
        "q_proj/kernel Param 16x8",
        "v_proj/kernel Param 16x16",
    ],
    "linear_head_gate_hedgehog_norm": [
        "gate/proj/bias Param 2",
        "gate/proj/kernel Param 16x2",
        "hedgehog/bias Param 2x8",
        "hedgehog/kernel Param 2x8x8",
        "k_proj/kernel Param 16x16",
        "out_proj/kernel Param 16x16",
        "output_norm/scale Param 8",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x16",
    ],
    "mamba2": [
        "A_log Param 2",
        "D Param 2",
        "conv/kernel Param 4x48",
        "conv_bias Param 48",
        "dt_bias Param 2",
        "in_proj/kernel Param 16x82",
        "norm/weight Param 32",
        "out_proj/kernel Param 32x16",
    ],
    "mamba2_bare": [
        "A_log Param 2",
        "D Param 2",
        "conv/kernel Param 4x16",
        "dt_bias Param 2",
        "in_proj/bias Param 26",
        "in_proj/kernel Param 16x26",
        "out_proj/bias Param 16",
        "out_proj/kernel Param 8x16",
    ],
    "mamba": [
        "A_log Param 32x4",
        "D Param 32",
        "conv/kernel Param 4x32",
        "conv_bias Param 32",
        "dt_proj/bias Param 32",
        "dt_proj/kernel Param 3x32",
        "in_proj/bias Param 64",
        "in_proj/kernel Param 16x64",
        "out_proj/bias Param 16",
        "out_proj/kernel Param 32x16",
        "x_proj/kernel Param 32x11",
    ],
    "mamba_heads": [
        "A_log Param 32x4",
        "D Param 32",
        "conv/kernel Param 4x32",
        "conv_bias Param 32",
        "dt_proj/bias Param 2x16",
        "dt_proj/kernel Param 2x3x16",
        "in_proj/kernel Param 16x64",
        "out_proj/kernel Param 32x16",
        "x_proj/kernel Param 2x16x11",
    ],
    "mamba_normed": [
        "A_log Param 32x4",
        "D Param 32",
        "b_layernorm/scale Param 4",
        "c_layernorm/scale Param 4",
        "conv/kernel Param 4x32",
        "dt_layernorm/scale Param 3",
        "dt_proj/bias Param 32",
        "dt_proj/kernel Param 3x32",
        "in_proj/kernel Param 16x64",
        "out_proj/kernel Param 32x16",
        "x_proj/kernel Param 32x11",
    ],
    "mlstm": [
        "fgate_preact/bias Param 2",
        "fgate_preact/kernel Param 16x2",
        "igate_preact/bias Param 2",
        "igate_preact/kernel Param 16x2",
        "k/bias Param 8",
        "k/kernel Param 16x8",
        "multihead_norm/bias Param 16",
        "multihead_norm/weight Param 16",
        "ogate_preact/bias Param 16",
        "ogate_preact/kernel Param 16x16",
        "out_proj/bias Param 16",
        "out_proj/kernel Param 16x16",
        "q/bias Param 8",
        "q/kernel Param 16x8",
        "v/bias Param 16",
        "v/kernel Param 16x16",
    ],
    "rwkv_block": [
        "attention/key/kernel Param 16x12",
        "attention/output/kernel Param 12x16",
        "attention/receptance/kernel Param 16x12",
        "attention/time_decay Param 12",
        "attention/time_first Param 12",
        "attention/time_mix_key Param 16",
        "attention/time_mix_receptance Param 16",
        "attention/time_mix_value Param 16",
        "attention/value/kernel Param 16x12",
        "attention_norm/bias Param 16",
        "attention_norm/scale Param 16",
        "mlp/key/kernel Param 16x24",
        "mlp/receptance/kernel Param 16x16",
        "mlp/time_mix_key Param 16",
        "mlp/time_mix_receptance Param 16",
        "mlp/value/kernel Param 24x16",
        "mlp_norm/bias Param 16",
        "mlp_norm/scale Param 16",
    ],
    "softmax": [
        "k_proj/kernel Param 16x16",
        "out_proj/kernel Param 16x16",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x16",
    ],
    "softmax_gqa_rope_norms_gate": [
        "dropout/rngs/count RngCount ()",
        "dropout/rngs/key RngKey ()",
        "k_norm/scale Param 6",
        "k_proj/kernel Param 16x12",
        "out_proj/kernel Param 24x16",
        "q_norm/scale Param 6",
        "q_proj/kernel Param 16x48",
        "v_proj/kernel Param 16x12",
    ],
    # Added after 007b5f9 (#51): Ling 3's KDA and MLA.
    "kda_full_rank_bounded": [
        "beta_proj/kernel Param 16x2",
        "conv/kernel Param 4x48",
        "g_proj/kernel Param 16x16",
        "gate/A_log Param 2",
        "gate/dt_bias Param 16",
        "gate/proj/kernel Param 16x16",
        "k_proj/kernel Param 16x16",
        "out_proj/kernel Param 16x16",
        "output_norm/scale Param 8",
        "q_proj/kernel Param 16x16",
        "v_proj/kernel Param 16x16",
    ],
    "latent_head_gate": [
        "g_proj/kernel Param 16x2",
        "kv_a_proj/kernel Param 16x36",
        "kv_b_proj/kernel Param 32x32",
        "kv_norm/scale Param 32",
        "out_proj/kernel Param 16x16",
        "q_proj/kernel Param 16x24",
    ],
    "block_moe_relu2": [
        "mlp/bias RouterBias 4",
        "mlp/down Param 4x8x16",
        "mlp/losses RouterLosses 2",
        "mlp/router Param 16x4",
        "mlp/shared/down_proj/kernel Param 8x16",
        "mlp/shared/up_proj/kernel Param 16x8",
        "mlp/up Param 4x16x8",
        "mlp_norm/scale Param 16",
    ],
    "shared_blocks": [
        *(
            f"blocks/0/{p}"
            for p in (
                "down_proj/bias Param 16",
                "down_proj/kernel Param 8x16",
                "gate_up_proj/bias Param 16",
                "gate_up_proj/kernel Param 16x16",
                "input_norm/scale Param 32",
                "k_proj/kernel Param 32x32",
                "mlp_norm/scale Param 16",
                "out_proj/kernel Param 32x16",
                "q_proj/kernel Param 32x32",
                "v_proj/kernel Param 32x32",
            )
        ),
        *(
            f"uses/{k}/{p}"
            for k in (0, 1)
            for p in (
                "k_adapter/down/kernel Param 32x2",
                "k_adapter/up/kernel Param 2x32",
                "mlp_adapter/down/kernel Param 16x2",
                "mlp_adapter/up/kernel Param 2x16",
                "out_proj/kernel Param 16x16",
                "q_adapter/down/kernel Param 32x2",
                "q_adapter/up/kernel Param 2x32",
                "v_adapter/down/kernel Param 32x2",
                "v_adapter/up/kernel Param 2x32",
            )
        ),
    ],
    "block_rglru_geglu_bias": [
        "attention/conv_1d/bias Param 8",
        "attention/conv_1d/kernel Param 3x8",
        "attention/input_gate_bias Param 2x4",
        "attention/input_gate_weight Param 2x4x4",
        "attention/linear_out/bias Param 16",
        "attention/linear_out/kernel Param 8x16",
        "attention/linear_x/bias Param 8",
        "attention/linear_x/kernel Param 16x8",
        "attention/linear_y/bias Param 8",
        "attention/linear_y/kernel Param 16x8",
        "attention/recurrent_gate_bias Param 2x4",
        "attention/recurrent_gate_weight Param 2x4x4",
        "attention/recurrent_param Param 8",
        "attention_norm/scale Param 16",
        "mlp/down_proj/bias Param 16",
        "mlp/down_proj/kernel Param 6x16",
        "mlp/gate_proj/bias Param 6",
        "mlp/gate_proj/kernel Param 16x6",
        "mlp/up_proj/bias Param 6",
        "mlp/up_proj/kernel Param 16x6",
        "mlp_norm/scale Param 16",
    ],
    "rglru": [
        "conv_1d/bias Param 8",
        "conv_1d/kernel Param 3x8",
        "input_gate_bias Param 2x4",
        "input_gate_weight Param 2x4x4",
        "linear_out/bias Param 16",
        "linear_out/kernel Param 8x16",
        "linear_x/bias Param 8",
        "linear_x/kernel Param 16x8",
        "linear_y/bias Param 8",
        "linear_y/kernel Param 16x8",
        "recurrent_gate_bias Param 2x4",
        "recurrent_gate_weight Param 2x4x4",
        "recurrent_param Param 8",
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_param_paths_are_unchanged(case):
    assert param_paths(CASES[case]) == EXPECTED[case]


def test_every_layer_type_is_pinned():
    built = {type(nnx.eval_shape(lambda b=b: b(nnx.Rngs(0)))) for b in CASES.values()}
    kinds = {layers.LinearAttention, layers.DeltaRuleAttention, layers.Mamba2Mixer}
    kinds |= {layers.MLSTMLayer, layers.LightningAttention, layers.SoftmaxAttention}
    kinds |= {layers.LatentAttention, layers.TransformerBlock, models.LanguageModel}
    kinds |= {layers.GatedShortConv}
    kinds |= {layers.RGLRUBlock}
    assert kinds <= built


if __name__ == "__main__":  # prints EXPECTED for the code at hand
    import pprint

    jnp.zeros(())  # JAX up before the layers are built
    pprint.pprint({case: param_paths(build) for case, build in sorted(CASES.items())}, width=100)
