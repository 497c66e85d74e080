"""The maths floor: pure functions, arrays in and arrays out; no parameters, no Flax.

``chunking`` (the chunk engine) and ``checks`` (input checks) at the bottom;
``feature_maps`` (the kernels phi); one package per family of recurrences, each split by
form with the same file names (``api``, ``chunked``, ``recurrent``, ``step``,
``sequence_parallel``, ``state``) and exposing one interface: ``additive``, ``delta`` and
``mlstm`` (xLSTM's stabilised exponential gates). ``FAMILIES`` names them. ``ssd``
(Mamba-2) is the additive rule with its own inputs (``x, dt, A, B, C``) and the same forms
(``causal``, ``step``, ``sequence_parallel``). ``selective`` (Mamba-1's selective scan)
is a family of its own inputs (``x, dt, A, B, C``: a decay per channel and state entry)
on the chunk engine. ``wkv`` is RWKV-4's per-channel WKV (``k, v, time_decay,
time_first``) and ``rglru`` Griffin's RG-LRU (``x, i, r``), both in ``FAMILIES``.
"""

from linattn_jax.ops import (
    additive,
    checks,
    chunking,
    delta,
    feature_maps,
    mlstm,
    rglru,
    selective,
    ssd,
    wkv,
)

FAMILIES = {"additive": additive, "delta": delta, "mlstm": mlstm, "wkv": wkv, "rglru": rglru}

__all__ = [
    "FAMILIES",
    "additive",
    "checks",
    "chunking",
    "delta",
    "feature_maps",
    "mlstm",
    "rglru",
    "selective",
    "ssd",
    "wkv",
]
