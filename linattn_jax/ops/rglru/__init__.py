"""The RG-LRU family (Griffin's and RecurrentGemma's Real-Gated Linear Recurrent Unit).

``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (sigmoid(i_t) x_t)`` per channel, with ``a_t =
sigmoid(-a_param)^(c sigmoid(r_t))``; at a sequence start ``h_t = sigmoid(i_t) x_t``. The
interface of ``linattn_jax.ops.additive`` without its attention inputs: ``State``,
``init_state``, ``METHODS``, ``causal``, ``step``, ``sequence_parallel``; the inputs are
``x, i, r`` and the per-channel ``a_param`` a keyword. The long names (``rglru`` and so
on) are the same functions.
"""

from linattn_jax.ops.rglru.api import METHODS, causal
from linattn_jax.ops.rglru.sequence_parallel import sequence_parallel
from linattn_jax.ops.rglru.state import RGLRUState, State, init_state
from linattn_jax.ops.rglru.step import step

rglru = causal
rglru_step = step
sequence_parallel_rglru = sequence_parallel
init_rglru_state = init_state
RGLRU_METHODS = METHODS

__all__ = [
    "METHODS",
    "RGLRUState",
    "RGLRU_METHODS",
    "State",
    "causal",
    "init_rglru_state",
    "init_state",
    "rglru",
    "rglru_step",
    "sequence_parallel",
    "sequence_parallel_rglru",
    "step",
]
