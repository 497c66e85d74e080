"""linattn_jax: linear (kernelized) attention for JAX and Flax.

The maths (``linear_attention``, ``causal_linear_attention``,
``causal_linear_attention_step``; the delta rule's ``delta_rule``,
``delta_rule_step``) are pure functions, arrays in and arrays out,
jit-, vmap- and grad-compatible; ``feature_maps`` names the kernels.
"""

from linattn_jax import feature_maps
from linattn_jax.attention import (
    METHODS,
    LinearAttentionState,
    causal_linear_attention,
    causal_linear_attention_step,
    init_state,
    linear_attention,
)
from linattn_jax.delta_rule import (
    DELTA_METHODS,
    DeltaRuleState,
    delta_rule,
    delta_rule_step,
    init_delta_state,
)
from linattn_jax.sequence_parallel import (
    sequence_parallel_causal_linear_attention,
    sequence_parallel_delta_rule,
)

__version__ = "0.1.0"

__all__ = [
    "DELTA_METHODS",
    "METHODS",
    "DeltaRuleState",
    "LinearAttentionState",
    "causal_linear_attention",
    "causal_linear_attention_step",
    "delta_rule",
    "delta_rule_step",
    "feature_maps",
    "init_delta_state",
    "init_state",
    "linear_attention",
    "sequence_parallel_causal_linear_attention",
    "sequence_parallel_delta_rule",
]
