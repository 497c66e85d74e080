"""linattn_jax: linear (kernelized) attention for JAX and Flax.

``linattn_jax.ops`` holds the maths: pure functions, arrays in and arrays out, jit-,
vmap- and grad-compatible, one package per family of recurrences with one interface
(``ops.additive``, ``ops.delta``; Mamba-2's SSD, ``ops.ssd``); its public functions are
re-exported here under their descriptive names (``linear_attention``, ``causal_linear_attention``,
``causal_linear_attention_step``, ``delta_rule``, ``delta_rule_step``, ``ssd``, ...).
``feature_maps`` names the kernels. ``linattn_jax.layers`` and ``linattn_jax.models`` hold
the Flax NNX modules over them.
"""

from linattn_jax import ops
from linattn_jax.ops import feature_maps
from linattn_jax.ops.additive import (
    METHODS,
    LinearAttentionState,
    causal_linear_attention,
    causal_linear_attention_step,
    init_state,
    linear_attention,
    sequence_parallel_causal_linear_attention,
)
from linattn_jax.ops.delta import (
    DELTA_METHODS,
    DeltaRuleState,
    delta_rule,
    delta_rule_step,
    init_delta_state,
    sequence_parallel_delta_rule,
)
from linattn_jax.ops.mlstm import (
    MLSTM_METHODS,
    MLSTMState,
    init_mlstm_state,
    mlstm,
    mlstm_step,
    sequence_parallel_mlstm,
)
from linattn_jax.ops.rglru import (
    RGLRU_METHODS,
    RGLRUState,
    init_rglru_state,
    rglru,
    rglru_step,
    sequence_parallel_rglru,
)
from linattn_jax.ops.selective import (
    SELECTIVE_METHODS,
    SelectiveState,
    init_selective_state,
    selective_scan,
    selective_scan_step,
    sequence_parallel_selective_scan,
)
from linattn_jax.ops.ssd import (
    SSD_METHODS,
    SSDState,
    init_ssd_state,
    sequence_parallel_ssd,
    ssd,
    ssd_step,
)
from linattn_jax.ops.wkv import (
    WKV_METHODS,
    WKVState,
    init_wkv_state,
    sequence_parallel_wkv,
    wkv,
    wkv_step,
)

__version__ = "0.1.0"

__all__ = [
    "DELTA_METHODS",
    "MLSTM_METHODS",
    "METHODS",
    "SSD_METHODS",
    "DeltaRuleState",
    "LinearAttentionState",
    "MLSTMState",
    "SSDState",
    "causal_linear_attention",
    "causal_linear_attention_step",
    "delta_rule",
    "delta_rule_step",
    "feature_maps",
    "init_delta_state",
    "init_mlstm_state",
    "init_ssd_state",
    "init_state",
    "linear_attention",
    "mlstm",
    "mlstm_step",
    "ops",
    "sequence_parallel_causal_linear_attention",
    "sequence_parallel_delta_rule",
    "sequence_parallel_mlstm",
    "sequence_parallel_ssd",
    "ssd",
    "ssd_step",
    "WKV_METHODS",
    "WKVState",
    "init_wkv_state",
    "sequence_parallel_wkv",
    "wkv",
    "wkv_step",
    "RGLRU_METHODS",
    "RGLRUState",
    "init_rglru_state",
    "rglru",
    "rglru_step",
    "sequence_parallel_rglru",
    "SELECTIVE_METHODS",
    "SelectiveState",
    "init_selective_state",
    "selective_scan",
    "selective_scan_step",
    "sequence_parallel_selective_scan",
]
