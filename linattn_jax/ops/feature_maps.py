"""Feature maps phi: ``[..., d] -> [..., f]``, so that the kernel is ``phi(q) . phi(k)``.

Three kinds, one interface (a callable):

* parameter-free functions, registered by name (``feature_map="elu"``):
  ``elu``, ``relu``, ``identity``, ``softmax``, ``two_sided_relu``, ``dpfp``, ``taylor``;
* random features drawn from an explicit PRNG key, returned as callable pytrees
  (pass them through ``jax.jit`` as ordinary arguments): ``favor_plus``,
  ``random_fourier``; redraw with ``.redraw(key)``;
* position-aware maps (``needs_positions = True``), called as ``phi(x, positions)``
  with integer positions of shape ``x.shape[:-2]``: ``cosformer``.

The learnable Hedgehog map (parameters) lives with the Flax layers
(``linattn_jax.layers.HedgehogFeatureMap``). Every map computes in float32
(float64 for float64 inputs) whatever its input dtype: exp-based maps overflow
in bfloat16 otherwise.

A map may carry boolean attributes that the attention functions and layers read
(absent means False):

* ``needs_positions``: called as ``phi(x, positions)`` (cosFormer);
* ``role_aware``: called as ``phi(x, is_query=...)``, queries and keys mapped
  differently (FAVOR+, Hedgehog);
* ``requires_normalize``: the map scales each query's features by a factor that
  only ``normalize=True`` cancels (FAVOR+, Hedgehog's ``form="paper"``);
  ``normalize=False`` is refused;
* ``signed``: the kernel ``phi(q) . phi(k)`` can be negative, so the denominator
  ``phi(q)^T Z`` can be zero or change sign and ``normalize=True`` can divide by
  about zero: ``identity`` (the plain ``q . k``) and ``random_fourier`` (an
  unbiased estimate of a positive kernel, but each draw's estimate can be
  negative). Use them with ``normalize=False``. Not signed: ``taylor``, whose
  features are signed but whose kernel ``1 + u + u^2/2`` is at least 1/2; the
  maps with non-negative features (``relu``, ``two_sided_relu``, ``dpfp``), whose
  denominator is zero only where the numerator is too (the output is then 0);
  and ``cosformer`` within its documented range ``|i - j| <= max_length``
  (beyond it the reweighting ``cos`` turns negative).

and one function attribute: ``kernel_from_dots(dots, d)``, the kernel ``phi(q) . phi(k)``
from the dot products ``q . k`` of d-wide inputs (``taylor``: ``1 + s/sqrt(d) +
s^2/(2d)``); the chunked causal form then computes the scores inside a chunk from the
``[c, c]`` dot products and uses the features only for the state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from linattn_jax.ops import checks
from linattn_jax.typing import FeatureMap

_REGISTRY: dict[str, FeatureMap] = {}
# The maps a layer builds itself (a PRNG key, parameters or a length): names besides names().
NEEDS_CONSTRUCTION = ("favor_plus", "random_fourier", "hedgehog", "cosformer")


def register(name: str, *, signed: bool = False) -> Callable[[FeatureMap], FeatureMap]:
    """Decorator: registers a parameter-free map under ``name`` (for ``feature_map=name``).

    ``signed=True`` marks a map whose kernel can be negative (sets ``fn.signed``).
    """

    def wrap(fn: FeatureMap) -> FeatureMap:
        if name in _REGISTRY:
            raise ValueError(f"feature map {name!r} is already registered")
        if signed:
            fn.signed = True
        _REGISTRY[name] = fn
        return fn

    return wrap


def is_registered(feature_map: str | FeatureMap) -> bool:
    """Whether ``feature_map`` is (the name of) a registered parameter-free map."""
    if isinstance(feature_map, str):
        return feature_map in _REGISTRY
    return any(feature_map is fn for fn in _REGISTRY.values())


def names() -> tuple[str, ...]:
    """The registered (parameter-free) feature-map names, sorted."""
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
    hint = ""
    if isinstance(feature_map, str) and feature_map in NEEDS_CONSTRUCTION:
        hint = (
            f" ({feature_map!r} has parameters or positions: build it with "
            f"linattn_jax.feature_maps.{feature_map}(...) or use the Flax layer)"
        )
    raise ValueError(
        f"feature_map must be one of {names()} or a callable, got "
        f"{checks.describe(feature_map)}{hint}"
    )


def feature_dim(feature_map: str | FeatureMap, head_dim: int, heads: int = 1) -> int:
    """The output dimension f of ``feature_map`` for ``[..., heads, head_dim]`` inputs."""
    phi = get(feature_map)
    x = jax.ShapeDtypeStruct((1, heads, head_dim), jnp.float32)
    if getattr(phi, "needs_positions", False):
        positions = jax.ShapeDtypeStruct((1,), jnp.int32)
        out = jax.eval_shape(phi, x, positions)
    else:
        out = jax.eval_shape(phi, x)
    checks.check_features(out, x)
    return out.shape[-1]


def accumulation_dtype(dtype) -> jnp.dtype:
    """float64 for float64 inputs, else float32: features, sums and states never go lower."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def upcast(x: jax.Array) -> jax.Array:
    """``x`` in its ``accumulation_dtype``."""
    return x.astype(accumulation_dtype(x.dtype))


# ----------------------------------------------------------------------------
# Parameter-free maps.
# ----------------------------------------------------------------------------


@register("elu")
def elu(x: jax.Array) -> jax.Array:
    """``elu(x) + 1`` (Katharopoulos et al. 2020, "Transformers are RNNs"). f = d, positive.

    Written as ``where(x > 0, x + 1, exp(min(x, 0)))``: the same function, but
    XLA on CPU then avoids recomputing ``expm1`` inside fusions.
    """
    x = upcast(x)
    return jnp.where(x > 0, x + 1.0, jnp.exp(jnp.minimum(x, 0.0)))


@register("relu")
def relu(x: jax.Array) -> jax.Array:
    """``max(x, 0)``. f = d, non-negative (a query can have a zero denominator)."""
    return jax.nn.relu(upcast(x))


@register("identity", signed=True)
def identity(x: jax.Array) -> jax.Array:
    """``x`` itself: the plain linear kernel ``q . k``. f = d, signed (use ``normalize=False``)."""
    return upcast(x)


@register("softmax")
def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the feature axis. f = d, positive (each feature vector sums to 1)."""
    return jax.nn.softmax(upcast(x), axis=-1)


@register("two_sided_relu")
def two_sided_relu(x: jax.Array) -> jax.Array:
    """``[relu(x), relu(-x)]``. f = 2d, non-negative; keeps the sign information relu drops."""
    x = upcast(x)
    return jnp.concatenate([jax.nn.relu(x), jax.nn.relu(-x)], axis=-1)


@register("dpfp")
def dpfp(x: jax.Array, nu: int = 1) -> jax.Array:
    """Deterministic parameter-free projection (Schlag et al. 2021, "Linear Transformers
    Are Secretly Fast Weight Programmers"). f = 2d * nu, non-negative.

    With ``r = [relu(x), relu(-x)]``: ``phi = concat_{i=1..nu} r * roll(r, i)``.
    Use ``functools.partial(dpfp, nu=3)`` for another ``nu``.
    """
    if not isinstance(nu, int) or nu < 1:
        raise ValueError(f"nu must be an int >= 1, got {nu!r}")
    r = two_sided_relu(x)
    return jnp.concatenate([r * jnp.roll(r, i, axis=-1) for i in range(1, nu + 1)], axis=-1)


@register("taylor")
def taylor(x: jax.Array) -> jax.Array:
    """Second-order Taylor features of ``exp(q.k / sqrt(d))`` (Based; Arora et al. 2024,
    "Simple linear attention language models balance the recall-throughput tradeoff").
    f = 1 + d + d^2, signed (the kernel itself is positive: 1 + u + u^2/2 > 0).

    ``phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))]``, so exactly
    ``phi(q) . phi(k) = 1 + q.k / sqrt(d) + (q.k)^2 / (2 d)``.
    """
    x = upcast(x)
    d = x.shape[-1]
    ones = jnp.ones(x.shape[:-1] + (1,), x.dtype)
    outer = _outer_products(x) / (math.sqrt(2.0) * math.sqrt(d))
    return jnp.concatenate([ones, x / d**0.25, outer], axis=-1)


@jax.custom_vjp
def _outer_products(x: jax.Array) -> jax.Array:
    """``vec(x x^T)``: ``[..., d] -> [..., d * d]``."""
    return (x[..., :, None] * x[..., None, :]).reshape(x.shape[:-1] + (x.shape[-1] ** 2,))


def _outer_products_fwd(x):
    return _outer_products(x), x


def _outer_products_bwd(x, g):
    d = x.shape[-1]
    g = g.reshape(x.shape + (d,))
    g = g + jnp.swapaxes(g, -1, -2)
    # (G + G^T) x as d elementwise multiply-adds, one fusion: autodiff's form became a
    # [d, d] x [d] dot per token, which XLA's CPU backend ran 10-20x slower.
    return (sum(g[..., :, j] * x[..., j, None] for j in range(d)),)


_outer_products.defvjp(_outer_products_fwd, _outer_products_bwd)


def _taylor_kernel(dots: jax.Array, d: int) -> jax.Array:
    """``phi(q) . phi(k)`` of ``taylor`` from ``q . k`` alone (the chunked form's scores)."""
    return 1.0 + dots / math.sqrt(d) + dots * dots / (2.0 * d)


taylor.kernel_from_dots = _taylor_kernel


# ----------------------------------------------------------------------------
# Random features (Performer; Choromanski et al. 2021, "Rethinking Attention with
# Performers"). Both approximate the softmax kernel exp(q.k / sqrt(d)).
# ----------------------------------------------------------------------------


def orthogonal_gaussian(key: jax.Array, num_features: int, dim: int) -> jax.Array:
    """``[num_features, dim]`` rows orthogonal in blocks of ``dim``, with Gaussian row norms.

    Each row is marginally ``N(0, I)``; rows within a block are exactly
    orthogonal, which lowers the variance of the kernel estimate (FAVOR+).
    """
    blocks = -(-num_features // dim)
    block_key, norm_key = jax.random.split(key)
    gaussians = jax.random.normal(block_key, (blocks, dim, dim), jnp.float32)
    q, r = jnp.linalg.qr(gaussians)  # [blocks, dim, dim], orthonormal columns
    # Householder QR fixes the signs of R's diagonal, which biases Q's directions;
    # flipping columns by those signs makes Q Haar-distributed (uniform directions).
    q = q * jnp.sign(jnp.diagonal(r, axis1=1, axis2=2))[:, None, :]
    rows = jnp.swapaxes(q, 1, 2).reshape(blocks * dim, dim)[:num_features]
    norms = jnp.linalg.norm(jax.random.normal(norm_key, (num_features, dim), jnp.float32), axis=-1)
    return rows * norms[:, None]


def _check_random_args(key, dim, num_features):
    checks.check_sizes(dim=dim, num_features=num_features)
    if not isinstance(key, jax.Array):
        raise ValueError(f"key must be a jax PRNG key, got {type(key).__name__}")


def _projected(x: jax.Array, projection: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x' W^T, |x'|^2 / 2)`` with ``x' = x / d^(1/4)``, checking that d matches."""
    if x.shape[-1] != projection.shape[-1]:
        raise ValueError(
            f"random features were drawn for d={projection.shape[-1]}, got inputs {x.shape}"
        )
    x = upcast(x) / x.shape[-1] ** 0.25
    return x @ projection.T.astype(x.dtype), 0.5 * jnp.sum(x * x, axis=-1, keepdims=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FavorPlus:
    """Positive random features: ``exp(w . x' - |x'|^2 / 2) / sqrt(m)``, ``x' = x / d^(1/4)``.

    f = m (``num_features``), positive. ``E[phi(k) . phi(k')] = exp(k.k' / sqrt(d))``
    for key features (``is_query=False``, the default).

    Numerics: a key's exponent is at most ``|w|^2 / 2`` whatever k is (its maximum
    over k), so key features cannot overflow. Query features are shifted per
    query by ``max_i w_i . q' - |q'|^2 / 2`` (so they lie in (0, 1/sqrt(m)]), as
    in Performer: a per-query factor cancels between numerator and denominator,
    so the attention output is unchanged, but only when normalised, hence
    ``requires_normalize``. Without the shift, a query and a key aligned with the
    same w overflow float32 once trained q and k grow. Features underflow for
    ``|x| > 13 d^(1/4)``: normalise q and k (LayerNorm, l2) first.

    Attributes:
      projection: ``[m, d]`` random projection (``orthogonal_gaussian``).
    """

    projection: jax.Array
    role_aware = True  # called as phi(x, is_query=...) by the attention functions
    requires_normalize = True

    def __call__(self, x: jax.Array, is_query: bool = False) -> jax.Array:
        wx, half_norm = _projected(x, self.projection)
        if is_query:
            exponent = wx - jax.lax.stop_gradient(jnp.max(wx, axis=-1, keepdims=True))
        else:
            exponent = wx - half_norm
        return jnp.exp(exponent) / math.sqrt(self.projection.shape[0])

    def redraw(self, key: jax.Array) -> FavorPlus:
        """The same map with a fresh projection drawn from ``key``."""
        m, d = self.projection.shape
        return FavorPlus(orthogonal_gaussian(key, m, d))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RandomFourier:
    """Trigonometric random features: ``exp(|x'|^2 / 2) [cos(w.x'), sin(w.x')] / sqrt(m)``.

    f = 2m, signed. ``E[phi(q) . phi(k)] = exp(q.k / sqrt(d))``; its estimate can
    be negative (``signed``), so use ``normalize=False``, or FAVOR+.

    Attributes:
      projection: ``[m, d]`` random projection (``orthogonal_gaussian``).
    """

    projection: jax.Array
    signed = True  # the kernel estimate can be negative: no safe denominator

    def __call__(self, x: jax.Array) -> jax.Array:
        wx, half_norm = _projected(x, self.projection)
        scale = jnp.exp(half_norm) / math.sqrt(self.projection.shape[0])
        return scale * jnp.concatenate([jnp.cos(wx), jnp.sin(wx)], axis=-1)

    def redraw(self, key: jax.Array) -> RandomFourier:
        """The same map with a fresh projection drawn from ``key``."""
        m, d = self.projection.shape
        return RandomFourier(orthogonal_gaussian(key, m, d))


def favor_plus(key: jax.Array, dim: int, num_features: int) -> FavorPlus:
    """Draws FAVOR+ features for head dimension ``dim`` (f = ``num_features``)."""
    _check_random_args(key, dim, num_features)
    return FavorPlus(orthogonal_gaussian(key, num_features, dim))


def random_fourier(key: jax.Array, dim: int, num_features: int) -> RandomFourier:
    """Draws trigonometric random features for head dimension ``dim`` (f = 2 ``num_features``)."""
    _check_random_args(key, dim, num_features)
    return RandomFourier(orthogonal_gaussian(key, num_features, dim))


# ----------------------------------------------------------------------------
# Position-aware maps.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CosFormer:
    """cosFormer (Qin et al. 2022, "cosFormer: Rethinking Softmax in Attention").

    The kernel ``relu(q_i) . relu(k_j) cos(pi/2 (i - j) / M)`` made linear by
    ``cos(a - b) = cos a cos b + sin a sin b``:
    ``phi(x, i) = [relu(x) cos(pi i / 2M), relu(x) sin(pi i / 2M)]``. f = 2d,
    non-negative; the reweighting stays positive while ``|i - j| <= M``.

    Attributes:
      max_length: M, at least the longest distance between a query and a key.
    """

    max_length: int
    needs_positions = True

    def __post_init__(self):
        if not isinstance(self.max_length, int) or self.max_length < 1:
            raise ValueError(f"max_length must be an int >= 1, got {self.max_length!r}")

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x`` ``[..., h, d]`` and integer ``positions`` of shape ``x.shape[:-2]``."""
        if tuple(positions.shape) != tuple(x.shape[:-2]):
            raise ValueError(
                f"positions must have shape x.shape[:-2]={x.shape[:-2]}, got {positions.shape}"
            )
        r = relu(x)
        angle = (0.5 * math.pi / self.max_length) * positions.astype(r.dtype)[..., None, None]
        return jnp.concatenate([r * jnp.cos(angle), r * jnp.sin(angle)], axis=-1)


def cosformer(max_length: int) -> CosFormer:
    """The cosFormer map for sequences (or query-key distances) up to ``max_length``."""
    return CosFormer(max_length)
