"""RWKV-4's WKV family: a per-channel decayed average with a bonus for the current token.

``wkv_t = (sum_{j<t} e^{k_j + (t-1-j) w} v_j + e^{u + k_t} v_t) / (sum_{j<t}
e^{k_j + (t-1-j) w} + e^{u + k_t})``, ``w = -exp(time_decay)``, ``u = time_first``, kept
stable by a running maximum of the log weights. One interface shared with the other
families: ``State``, ``init_state``, ``METHODS``, ``causal``, ``step``,
``sequence_parallel``; ``k`` and ``v``
are the inputs (there is no query: the receptance gates the output in the layer), the
per-channel ``time_decay`` and ``time_first`` keywords. The long names (``wkv`` and so
on) are the same functions.
"""

from linattn_jax.ops.wkv.api import METHODS, causal
from linattn_jax.ops.wkv.sequence_parallel import sequence_parallel
from linattn_jax.ops.wkv.state import EMPTY, State, WKVState, init_state
from linattn_jax.ops.wkv.step import step

wkv = causal
wkv_step = step
sequence_parallel_wkv = sequence_parallel
init_wkv_state = init_state
WKV_METHODS = METHODS

__all__ = [
    "EMPTY",
    "METHODS",
    "State",
    "WKVState",
    "WKV_METHODS",
    "causal",
    "init_state",
    "init_wkv_state",
    "sequence_parallel",
    "sequence_parallel_wkv",
    "step",
    "wkv",
    "wkv_step",
]
