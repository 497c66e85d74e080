"""Feature maps phi: ``[..., d] -> [..., f]`` and the registry that names them.

The kernel of linear attention is ``k(q, k) = phi(q) . phi(k)``. Every map here
computes in float32 (float64 for float64 inputs) whatever its input dtype:
exp-based maps overflow in bfloat16 otherwise. A map is any callable; the registry only gives names to
the parameter-free ones, so that configs can say ``feature_map="elu"``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from linattn_jax.typing import FeatureMap

_REGISTRY: dict[str, FeatureMap] = {}


def register(name: str) -> Callable[[FeatureMap], FeatureMap]:
    """Decorator: registers ``fn`` under ``name`` (for ``feature_map=name``)."""

    def wrap(fn: FeatureMap) -> FeatureMap:
        if name in _REGISTRY:
            raise ValueError(f"feature map {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return wrap


def names() -> tuple[str, ...]:
    """The registered feature-map names, sorted."""
    return tuple(sorted(_REGISTRY))


def get(feature_map: str | FeatureMap) -> FeatureMap:
    """Resolves a registered name or passes a callable through.

    Raises:
      ValueError: ``feature_map`` is neither a registered name nor callable.
    """
    if callable(feature_map):
        return feature_map
    if isinstance(feature_map, str) and feature_map in _REGISTRY:
        return _REGISTRY[feature_map]
    raise ValueError(f"feature_map must be one of {names()} or a callable, got {feature_map!r}")


def accumulation_dtype(dtype) -> jnp.dtype:
    """float64 for float64 inputs, else float32: features, sums and states never go lower."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def upcast(x: jax.Array) -> jax.Array:
    """``x`` in its ``accumulation_dtype``."""
    return x.astype(accumulation_dtype(x.dtype))


@register("elu")
def elu(x: jax.Array) -> jax.Array:
    """``elu(x) + 1`` (Katharopoulos et al. 2020, "Transformers are RNNs"). f = d, positive.

    Written as ``where(x > 0, x + 1, exp(min(x, 0)))``: the same function, but
    XLA on CPU then avoids recomputing ``expm1`` inside fusions (2x faster).
    """
    x = upcast(x)
    return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


@register("relu")
def relu(x: jax.Array) -> jax.Array:
    """``max(x, 0)``. f = d, non-negative (a query can have a zero denominator)."""
    return jax.nn.relu(upcast(x))


@register("identity")
def identity(x: jax.Array) -> jax.Array:
    """``x`` itself: the plain (unnormalised) linear kernel ``q . k``. f = d, signed."""
    return upcast(x)
