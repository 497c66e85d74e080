"""Array type aliases and the one legend of dimension letters used everywhere.

Dimension letters (in einsum strings, jaxtyping annotations and docstrings):

  b  batch                      t  query length (tokens)
  s  key/value length           h  heads
  d  query/key head dimension   f  feature dimension (D, the output of phi)
  v  value head dimension       c  chunk size (inside the chunked form)
  n  number of chunks

Arrays are laid out ``[b, t, h, d]`` as in ``jax.nn.dot_product_attention``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import jax
from jaxtyping import Array, Bool, Float, Int

FeatureMap: TypeAlias = Callable[[jax.Array], jax.Array]
"""Maps ``[..., d]`` to ``[..., f]``; the kernel is ``phi(q) . phi(k)``."""

Queries: TypeAlias = Float[Array, "b t h d"]
Keys: TypeAlias = Float[Array, "b s h d"]
Values: TypeAlias = Float[Array, "b s h v"]
Outputs: TypeAlias = Float[Array, "b t h v"]
KeyMask: TypeAlias = Bool[Array, "b s"]
SegmentIds: TypeAlias = Int[Array, "b t"]

__all__ = [
    "Array",
    "Bool",
    "FeatureMap",
    "Float",
    "Int",
    "KeyMask",
    "Keys",
    "Outputs",
    "Queries",
    "SegmentIds",
    "Values",
]
