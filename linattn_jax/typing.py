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
"""Maps ``[..., d] -> [..., f]``; the kernel is ``phi(q) . phi(k)``."""

# The shapes in signatures are written with jaxtyping (``Float[Array, "b t h d"]``) in
# these letters, as documentation: they are not checked at run time.

__all__ = ["Array", "Bool", "FeatureMap", "Float", "Int"]
