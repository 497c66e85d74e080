"""The feature maps that own state: the learnable Hedgehog and T2R maps and random
projections."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.ops import checks
from linattn_jax.ops import feature_maps as fm

RANDOM_FEATURES = {"favor_plus": fm.FavorPlus, "random_fourier": fm.RandomFourier}
HEDGEHOG_FORMS = ("softmax", "paper")


class RandomProjection(nnx.Variable):
    """A random-feature projection: drawn from ``rngs``, not trained (not an ``nnx.Param``)."""


class HedgehogFeatureMap(nnx.Module):
    """Hedgehog (Zhang et al. 2024, "The Hedgehog & the Porcupine"): a learnable map.

    A per-head affine map initialised to the identity, ``y = x W_h + b_h``, then
    one of two forms (``form=``). f = 2d, positive in both.

    * ``"softmax"`` (the default; FLA's and Zoology's form, which use
      ``[2y, -2y]``, i.e. W and b doubled): ``phi(x) = softmax([y, -y])``,
      ``[exp(y), exp(-y)] / c(x)`` with ``c(x) = sum_i 2 cosh(y_i)``. Its kernel
      is the paper's divided by ``c(q) c(k)``: ``c(q)`` cancels under
      normalisation, ``c(k)`` does not, so normalised attention weights are
      ``K(q, k_j) / c(k_j)`` over their sum, each key reweighted by ``1 / c(k_j)``.
      Stable for any input.
    * ``"paper"`` (the paper's equation):
      ``phi(x) = [exp(y), exp(-y)]``, kernel
      ``K(q, k) = sum_i 2 cosh(y_q,i + y_k,i)``. Role-aware: a query's features
      are shifted by ``max_i |y_i|`` (``exp(y - max|y|)``, in (0, 1]), a per-query
      factor that cancels between numerator and denominator, so attention
      outputs are the paper's exactly, but only under normalisation
      (``requires_normalize``; ``eps`` is then relative to the shifted
      denominator). Queries can be any size. Keys are not shifted (a per-key
      factor would not cancel): in float32 a key's features are finite while
      ``|y_k| < 88.7`` (``log`` of float32's maximum), and the sums over t keys
      (the state, the denominator) while ``max |y_k| < 88.7 - log(2d t max|v|)``
      (about 73 for d = 64, t = 32k, ``|v| <= 1``). Normalise k (LayerNorm, l2) if
      trained keys can grow so far.

    Call on ``[..., h, d]`` (the heads axis second to last).

    Args:
      heads: h, the number of heads.
      head_dim: d, the dimension per head.
      form: ``"softmax"`` or ``"paper"``.
      rngs: as in Flax (the identity initialisation draws nothing).
      param_dtype: the parameters' dtype, as in Flax.
    """

    role_aware = True  # called as phi(x, is_query=...); only form="paper" uses it

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        form: str = "softmax",
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        del rngs  # identity initialisation: nothing random
        if form not in HEDGEHOG_FORMS:
            raise ValueError(f"form must be one of {HEDGEHOG_FORMS}, got {form!r}")
        checks.check_int("heads", heads, 1)
        checks.check_int("head_dim", head_dim, 1)
        self.form = form
        eye = jnp.broadcast_to(jnp.eye(head_dim, dtype=param_dtype), (heads, head_dim, head_dim))
        self.kernel = nnx.Param(eye)
        self.bias = nnx.Param(jnp.zeros((heads, head_dim), param_dtype))

    @property
    def requires_normalize(self) -> bool:
        """True for ``form="paper"``: its query shift cancels only under normalisation."""
        return self.form == "paper"

    def __call__(self, x: jax.Array, is_query: bool = False) -> jax.Array:
        """``x [..., h, d] -> [..., h, 2d]``, float32 (float64 for float64 inputs)."""
        heads, d, _ = self.kernel.shape
        if x.shape[-2:] != (heads, d):
            raise ValueError(
                f"HedgehogFeatureMap expects [..., heads={heads}, d={d}], got {x.shape}"
            )
        x = fm.upcast(x)
        y = jnp.einsum("...hd,hde->...he", x, self.kernel[...].astype(x.dtype))
        bias = self.bias[...].astype(x.dtype)
        y = y + bias.reshape((1,) * (y.ndim - 2) + bias.shape)
        both = jnp.concatenate([y, -y], axis=-1)
        if self.form == "softmax":
            return jax.nn.softmax(both, axis=-1)
        if is_query:
            both = both - jax.lax.stop_gradient(jnp.max(both, axis=-1, keepdims=True))
        return jnp.exp(both)


class T2RFeatureMap(nnx.Module):
    """T2R's learned map (Kasai et al. 2021, "Finetuning Pretrained Transformers into
    RNNs"): a per-head single-layer MLP, ``phi(x) = relu(x W_h + b_h)``, ``[..., h, d] ->
    [..., h, f]``, float32 (float64 for float64 inputs). Non-negative features: its kernel
    is never negative, and a denominator is zero only where the numerator is.

    Args:
      heads: h, the number of heads.
      head_dim: d, the dimension per head.
      num_features: f, the features per head.
      rngs: as in Flax (``W`` drawn LeCun-normal, ``b`` zeros).
      param_dtype: the parameters' dtype, as in Flax.
    """

    def __init__(
        self,
        heads: int,
        head_dim: int,
        num_features: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        checks.check_int("heads", heads, 1)
        checks.check_int("head_dim", head_dim, 1)
        checks.check_int("num_features", num_features, 1)
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.kernel = nnx.Param(init(rngs.params(), (heads, head_dim, num_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((heads, num_features), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., h, d] -> [..., h, f]``."""
        heads, d, _ = self.kernel.shape
        if x.shape[-2:] != (heads, d):
            raise ValueError(f"T2RFeatureMap expects [..., heads={heads}, d={d}], got {x.shape}")
        x = fm.upcast(x)
        y = jnp.einsum("...hd,hdf->...hf", x, self.kernel[...].astype(x.dtype))
        bias = self.bias[...].astype(x.dtype)
        return jax.nn.relu(y + bias.reshape((1,) * (y.ndim - 2) + bias.shape))


def make_feature_map(feature_map, heads: int, d: int, *, num_features, max_length, form, **kw):
    """``(hedgehog, projection, fixed)`` for ``LinearAttention``: exactly one is not None.

    ``kw``: ``rngs`` and ``param_dtype``. Raises on an unknown name or bad options.
    """
    if not (isinstance(feature_map, str) or callable(feature_map)):
        fm.get(feature_map)  # raises, naming what feature_map must be (not "unhashable")
    # Validated whatever the map; like max_length, ignored by maps they do not apply to
    # (an experiment passes one set of options to every map it sweeps).
    if num_features is not None:
        checks.check_int("num_features", num_features, 1)
    if form not in HEDGEHOG_FORMS:
        raise ValueError(f"hedgehog_form must be one of {HEDGEHOG_FORMS}, got {form!r}")
    if feature_map == "hedgehog":
        return HedgehogFeatureMap(heads, d, form=form, **kw), None, None
    if feature_map in RANDOM_FEATURES:
        draw = fm.orthogonal_gaussian(kw["rngs"].params(), num_features or 2 * d, d)
        return None, RandomProjection(draw), None
    if feature_map == "cosformer":
        return None, None, fm.cosformer(max_length)
    return None, None, fm.get(feature_map)  # raises on unknown names
