"""Deprecated: the delta-rule layer lives in ``linattn_jax.layers`` (``layers/delta.py``).

Kept one release so that ``from linattn_jax import delta_layers`` goes on working.
"""

import warnings

from linattn_jax.layers.delta import VARIANTS, DeltaRuleAttention, DeltaRuleCache

warnings.warn(
    "linattn_jax.delta_layers is deprecated: use linattn_jax.layers.DeltaRuleAttention",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["VARIANTS", "DeltaRuleAttention", "DeltaRuleCache"]
