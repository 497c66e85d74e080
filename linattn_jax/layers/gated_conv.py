"""The gated short convolution (LFM2's ``Lfm2ShortConv``), a mixer without attention::

    B, C, h = split(in_proj(x))     # three [b, t, width]
    y       = conv(B * h) + bias    # causal, depthwise, kernel conv_size
    out     = out_proj(C * y)

Decoding carries the convolution's last ``conv_size - 1`` inputs (``B * h``, float32): a
one-token call is O(1)::

    cache = layer.init_state(batch)
    y, cache = layer(prompt, state=cache, return_state=True)
    y, cache = layer(next_token, state=cache, return_state=True)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.common import check_state, check_tokens
from linattn_jax.layers.conv import CausalConv1D
from linattn_jax.ops import checks


class GatedConvCache(NamedTuple):
    """A ``GatedShortConv``'s decoding state.

    Attributes:
      conv: the convolution's last ``conv_size - 1`` inputs ``B * h``, ``[b, conv_size -
        1, width]`` float32.
    """

    conv: jax.Array


class GatedShortConv(nnx.Module):
    """LFM2's gated short convolution: ``[b, t, width] -> [b, t, width]`` (the module's
    docstring).

    Parameters (``transformers``' names): ``in_proj`` (``width -> 3 width``, rows ``B, C,
    h``), ``conv.kernel`` ``[conv_size, width]`` with ``conv_bias`` ``[width]``, and
    ``out_proj``; the biases only with ``use_bias`` (LFM2's ``conv_bias``, on all three).

    Args:
      width: model width (input and output features, and the convolution's channels).
      num_heads: unused (one channel per feature); taken as every kind's layer takes it.
      conv_size: the convolution's kernel (LFM2's ``conv_L_cache``).
      use_bias: biases on ``in_proj``, the convolution and ``out_proj``.
      causal: must be True (the convolution reads left to right).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's); the state stays float32.
      param_dtype: the parameters' dtype.

    Raises:
      ValueError: a width or kernel that is not a positive int, a ``use_bias`` that is not
        a bool, or ``causal=False``.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        conv_size: int = 3,
        use_bias: bool = False,
        causal: bool = True,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        del num_heads
        checks.check_sizes(width=width, conv_size=conv_size)
        checks.check_bool("use_bias", use_bias)
        if causal is not True:
            raise ValueError(
                f"the gated short convolution is causal: causal must be True, got {causal!r}"
            )
        self.width, self.causal = width, True
        zeros = nnx.initializers.zeros_init()
        options = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.in_proj = nnx.Linear(
            width, 3 * width, kernel_init=sharding.kernel(sharding.EMBED, sharding.HEADS),
            bias_init=sharding.with_axes(zeros, sharding.HEADS), **options,
        )  # fmt: skip
        self.conv = CausalConv1D(width, conv_size, rngs=rngs, param_dtype=param_dtype)
        self.conv_bias = nnx.data(nnx.Param(jnp.zeros((width,), param_dtype)) if use_bias else None)
        self.out_proj = nnx.Linear(
            width, width, kernel_init=sharding.kernel(sharding.HEADS, sharding.EMBED),
            bias_init=sharding.with_axes(zeros, sharding.EMBED), **options,
        )  # fmt: skip

    def init_state(self, batch: int, max_length: int | None = None) -> GatedConvCache:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        return GatedConvCache(self.conv.init_state(batch))

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: GatedConvCache | None = None,
        return_state: bool = False,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``).

        Args:
          x: ``[b, t, width]``.
          key_mask: optional bool ``[b, t]``, True for real tokens: padded tokens are
            skipped by the convolution, as if absent (``CausalConv1D``), reach no state and
            give ``out_proj(0)``.
          segment_ids: optional int ``[b, t]``: no tap of the convolution reaches across a
            change of id.
          state: a ``GatedConvCache`` (``init_state``) before ``x``, or None (zeros).
          return_state: also return the new ``GatedConvCache``.
        """
        check_tokens(x, self.width)
        check_state(state, GatedConvCache)
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        gate_in, gate_out, h = jnp.split(self.in_proj(checks.where_token(key_mask, x)), 3, -1)
        # Padding must not reach the next tokens' window: a replacement (in_proj's bias
        # makes a padded B * h nonzero), not a product.
        h = checks.where_token(key_mask, gate_in * h)
        h, conv = self.conv(h, None if state is None else state.conv, segment_ids, key_mask)
        if self.conv_bias is not None:
            h = h + self.conv_bias[...].astype(h.dtype)[None, None]
        out = self.out_proj(checks.where_token(key_mask, gate_out * h))
        return (out, GatedConvCache(conv)) if return_state else out
