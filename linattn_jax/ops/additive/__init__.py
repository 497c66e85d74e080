"""The additive family: linear attention, ``S_i = a_i S_{i-1} + phi(k_i) v_i^T``.

One interface shared with ``linattn_jax.ops.delta``: ``State``, ``init_state``,
``METHODS``, ``causal``, ``step``, ``sequence_parallel``; plus ``noncausal``. The long
names (``causal_linear_attention`` and so on) are the same functions.
"""

from linattn_jax.ops.additive.api import KERNEL_METHODS, METHODS, causal, noncausal
from linattn_jax.ops.additive.sequence_parallel import sequence_parallel
from linattn_jax.ops.additive.state import LinearAttentionState, State, init_state
from linattn_jax.ops.additive.step import step

linear_attention = noncausal
causal_linear_attention = causal
causal_linear_attention_step = step
sequence_parallel_causal_linear_attention = sequence_parallel

__all__ = [
    "KERNEL_METHODS",
    "METHODS",
    "LinearAttentionState",
    "State",
    "causal",
    "causal_linear_attention",
    "causal_linear_attention_step",
    "init_state",
    "linear_attention",
    "noncausal",
    "sequence_parallel",
    "sequence_parallel_causal_linear_attention",
    "step",
]
