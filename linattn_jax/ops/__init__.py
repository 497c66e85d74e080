"""The maths floor: pure functions, arrays in and arrays out; no parameters, no Flax.

``chunking`` (the chunk engine) and ``checks`` (input checks) at the bottom;
``feature_maps`` (the kernels phi); one package per family of recurrences, each split by
form with the same file names (``api``, ``chunked``, ``recurrent``, ``step``,
``sequence_parallel``, ``state``) and exposing one interface: ``additive``, ``delta`` and
``mlstm`` (xLSTM's stabilised exponential gates). ``FAMILIES`` names them. ``ssd``
(Mamba-2) is the additive rule with its own inputs (``x, dt, A, B, C``) and the same forms
(``causal``, ``step``, ``sequence_parallel``).
``wkv`` is RWKV-4's per-channel WKV (``k, v, time_decay, time_first``; ``causal``, ``step``).
"""

from linattn_jax.ops import additive, checks, chunking, delta, feature_maps, mlstm, rglru, ssd, wkv

FAMILIES = {"additive": additive, "delta": delta, "mlstm": mlstm}
FAMILIES["wkv"] = wkv
FAMILIES["rglru"] = rglru

__all__ = ["FAMILIES", "additive", "checks", "chunking", "delta", "feature_maps", "mlstm", "ssd"]
__all__ += ["wkv"]
__all__ += ["rglru"]
