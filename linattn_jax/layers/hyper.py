"""Hyper-connections: a residual stream of ``n`` parallel streams, read into each mixer
and MLP by a learned, token-wise mixing and written back with a learned weight per stream
(Qwen4-Exp's ``Qwen4ExpTextGatedResidual``).

With ``x [..., n, d]`` the streams, a ``HyperConnection`` of rank ``r`` computes

* ``y = RMSNorm(x)``, each stream normalised over its ``d`` features, with its own gain
  (a scale of ``n * d``: ``x * (1 + w)`` zero-centred, else ``x * w``);
* the read: ``m = sigmoid(up(silu(down(y_flat) / n)))`` (``down`` ``n d -> r``, ``up``
  ``r -> n d``, no biases; ``y_flat`` is ``y [..., n * d]``) and ``u = mean_i(m_i * y_i)``
  ``[..., d]``, the block's input in place of its pre-norm;
* the write-back of the block's output ``h [..., d]``: ``x_i + g_i * h`` with
  ``g = 2 * sigmoid(inject(y_flat) / n)`` ``[..., n]`` (``inject`` ``n d -> n``).

A model with hyper-connections copies each token's embedding into the ``n`` streams, and
reads them out at the end with a ``HyperConnection`` without ``inject`` (its final norm).
Every operation is per token: padding and decoding need nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.ops import checks

OPTIONS = ("streams", "rank")


def check_options(options: Mapping[str, Any]) -> tuple[int, int]:
    """``(streams, rank)`` of a ``hyper_connections`` dict, or a ValueError naming it."""
    if not isinstance(options, Mapping) or set(options) != set(OPTIONS):
        raise ValueError(
            f"hyper_connections must be None or a dict with exactly {OPTIONS}, got {options!r}"
        )
    checks.check_int("hyper_connections['streams']", options["streams"], 2)
    checks.check_int("hyper_connections['rank']", options["rank"], 1)
    return options["streams"], options["rank"]


def expand(x: jax.Array, streams: int) -> jax.Array:
    """``x [..., d]`` copied into ``streams`` streams: ``[..., streams, d]``."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], streams, x.shape[-1]))


class HyperConnection(nnx.Module):
    """The read (``__call__``) and write-back (``write``) of ``n`` residual streams (the
    module docstring's maths).

    Args:
      width: ``d``, each stream's (and the block's) width.
      streams: ``n`` >= 2.
      rank: ``r``, the read's bottleneck.
      inject: with the write-back's ``inject`` projection (False: a read-out only, the
        model's final norm).
      zero_centred: the norm's ``x * (1 + w)`` form (``layers.norms.RMSNorm``).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
    """

    def __init__(
        self,
        width: int,
        streams: int,
        rank: int,
        *,
        inject: bool = True,
        zero_centred: bool = True,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        streams, rank = check_options(dict(streams=streams, rank=rank))
        checks.check_int("width", width, 1)
        self.streams, self.width = streams, width
        full = streams * width
        options = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        kernel = sharding.kernel(sharding.EMBED, None)
        self.norm = RMSNorm(
            full, group_size=width, zero_centred=zero_centred, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.down = nnx.Linear(full, rank, kernel_init=kernel, **options)
        self.up = nnx.Linear(rank, full, kernel_init=sharding.kernel(None, None), **options)
        self.inject = nnx.data(
            nnx.Linear(full, streams, kernel_init=kernel, **options) if inject else None
        )

    def _normed(self, x: jax.Array) -> jax.Array:
        """``x [..., n, d]`` normalised per stream, flat: ``[..., n * d]``."""
        if x.shape[-2:] != (self.streams, self.width):
            raise ValueError(
                f"x must end in (streams, width) = {(self.streams, self.width)}, got "
                f"shape {x.shape}"
            )
        return self.norm(x.reshape(*x.shape[:-2], -1))

    def __call__(self, x: jax.Array) -> jax.Array:
        """The read: ``x [..., n, d] -> u [..., d]``."""
        y = self._normed(x)
        mix = jax.nn.sigmoid(self.up(jax.nn.silu(self.down(y) / self.streams)))
        mixed = mix * y
        return jnp.mean(mixed.reshape(*x.shape), axis=-2)

    def write(self, x: jax.Array, h: jax.Array) -> jax.Array:
        """The write-back: ``x [..., n, d]`` plus each stream's weight times ``h [..., d]``."""
        if self.inject is None:
            raise ValueError("a read-out HyperConnection (inject=False) has no write-back")
        g = 2 * jax.nn.sigmoid(self.inject(self._normed(x)) / self.streams)
        return x + g[..., None].astype(h.dtype) * h[..., None, :]
