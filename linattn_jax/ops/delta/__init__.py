"""The delta-rule family: DeltaNet, Gated DeltaNet and KDA.

``S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` (KDA: ``alpha_t`` a
diagonal matrix). One interface shared with ``linattn_jax.ops.additive``: ``State``,
``init_state``, ``METHODS`` (and the opt-in ``KERNEL_METHODS``), ``causal``, ``step``,
``sequence_parallel``; ``beta`` is the family's one extra input, after ``v``. The long
names (``delta_rule`` and so on) are the same functions.
"""

from linattn_jax.ops.delta.api import KERNEL_METHODS, METHODS, causal
from linattn_jax.ops.delta.sequence_parallel import sequence_parallel
from linattn_jax.ops.delta.state import DeltaRuleState, State, init_state
from linattn_jax.ops.delta.step import step

delta_rule = causal
delta_rule_step = step
sequence_parallel_delta_rule = sequence_parallel
init_delta_state = init_state
DELTA_METHODS = METHODS

__all__ = [
    "DELTA_METHODS",
    "KERNEL_METHODS",
    "METHODS",
    "DeltaRuleState",
    "State",
    "causal",
    "delta_rule",
    "delta_rule_step",
    "init_delta_state",
    "init_state",
    "sequence_parallel",
    "sequence_parallel_delta_rule",
    "step",
]
