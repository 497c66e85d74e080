"""linattn_jax: linear (kernelized) attention for JAX and Flax.

The maths (``linear_attention``, ``causal_linear_attention``,
``causal_linear_attention_step``) are pure functions, arrays in and arrays out,
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
from linattn_jax.sequence_parallel import sequence_parallel_causal_linear_attention

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "LinearAttentionState",
    "causal_linear_attention",
    "causal_linear_attention_step",
    "feature_maps",
    "init_state",
    "linear_attention",
    "sequence_parallel_causal_linear_attention",
]
