"""The mLSTM family (xLSTM's matrix memory): exponential input gates, a stabilised state.

``C_t = f_t C_{t-1} + exp(i_t) v_t k_t^T``, ``n_t = f_t n_{t-1} + exp(i_t) k_t``, read as
``h_t = C_t^T q_t / max(|n_t^T q_t|, exp(-m_t))``. One interface shared with
``linattn_jax.ops.additive``: ``State``, ``init_state``, ``METHODS``, ``causal``,
``step``, ``sequence_parallel``; the gate pre-activations ``i`` and ``f`` are the family's
extra inputs, after ``v``. The long names (``mlstm`` and so on) are the same functions.
"""

from linattn_jax.ops.mlstm.api import METHODS, causal
from linattn_jax.ops.mlstm.inputs import FORGET_GATES
from linattn_jax.ops.mlstm.sequence_parallel import sequence_parallel
from linattn_jax.ops.mlstm.state import MLSTMState, State, init_state
from linattn_jax.ops.mlstm.step import step

mlstm = causal
mlstm_step = step
sequence_parallel_mlstm = sequence_parallel
init_mlstm_state = init_state
MLSTM_METHODS = METHODS

__all__ = [
    "FORGET_GATES",
    "METHODS",
    "MLSTM_METHODS",
    "MLSTMState",
    "State",
    "causal",
    "init_mlstm_state",
    "init_state",
    "mlstm",
    "mlstm_step",
    "sequence_parallel",
    "sequence_parallel_mlstm",
    "step",
]
