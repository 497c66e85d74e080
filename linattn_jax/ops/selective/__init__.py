"""Mamba-1's selective scan (Gu and Dao 2023): a decay per channel AND state dimension.

``h_t = exp(dt_t A) * h_{t-1} + (dt_t x_t) B_t``, ``y_t = h_t . C_t + D x_t``, with ``h``
``[d, n]`` per batch row, ``A [d, n] <= 0``, ``dt`` and ``x`` per channel, ``B`` and ``C``
shared by the channels. One interface shared with ``linattn_jax.ops.additive``:
``State``, ``init_state``, ``METHODS``, ``causal``, ``step``, ``sequence_parallel``; the inputs are
``x, dt, A, B, C`` (as ``linattn_jax.ops.ssd``'s), ``D`` a keyword. The long names
(``selective_scan`` and so on) are the same functions.
"""

from linattn_jax.ops.selective.api import METHODS, causal
from linattn_jax.ops.selective.sequence_parallel import sequence_parallel
from linattn_jax.ops.selective.state import SelectiveState, State, init_state
from linattn_jax.ops.selective.step import step

selective_scan = causal
selective_scan_step = step
init_selective_state = init_state
sequence_parallel_selective_scan = sequence_parallel
SELECTIVE_METHODS = METHODS

__all__ = [
    "METHODS",
    "SELECTIVE_METHODS",
    "SelectiveState",
    "State",
    "causal",
    "init_selective_state",
    "init_state",
    "selective_scan",
    "selective_scan_step",
    "sequence_parallel",
    "sequence_parallel_selective_scan",
    "step",
]
