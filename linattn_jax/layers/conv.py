"""The one short causal convolution of the library (the blocks' and the delta layers')."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.ops import checks


class CausalConv1D(nnx.Module):
    """A causal depthwise convolution over time, kernel ``size``, that does not look
    across ``segment_ids`` boundaries (Zoology's BaseConv, H3/Based's and the delta
    layers' short convolution). Initialised to the identity plus small noise.

    Decoding keeps the last ``size - 1`` real inputs of each row as its state (float32).

    Args:
      channels: the number of channels (each convolved on its own).
      size: the kernel size, >= 1.
      rngs: as in Flax (the kernel's noise is drawn from ``rngs.params()``).
      param_dtype: the kernel's dtype, as in Flax.
    """

    def __init__(self, channels: int, size: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        checks.check_int("channels", channels, 1)
        checks.check_int("conv_size", size, 1)
        kernel = 0.02 * jax.random.normal(rngs.params(), (size, channels), param_dtype)
        self.kernel = nnx.Param(kernel.at[-1].add(1.0))
        self.size, self.channels = size, channels

    def init_state(self, batch: int) -> jax.Array:
        """Zeros ``[batch, size - 1, channels]``, float32."""
        return jnp.zeros((batch, self.size - 1, self.channels), jnp.float32)

    def __call__(
        self,
        x: jax.Array,
        state: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        key_mask: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """``x [b, t, c]`` -> ``(y [b, t, c] in x's dtype, the last size - 1 inputs)``.

        Args:
          x: ``[b, t, c]``; rows that ``key_mask`` masks must hold zeros already (the
            layers replace padding before projecting it).
          state: the inputs before ``x`` (zeros when None); they count as part of the
            first token's segment.
          segment_ids: optional int ``[b, t]``: no tap reaches across a change of id
            (nor into an earlier run of the same id: ``checks.segment_runs``).
          key_mask: optional bool ``[b, t]``: the returned state holds the last
            ``size - 1`` real inputs of each row (right padding included), not its last
            rows.
        """
        b, t, c = x.shape
        n = self.size - 1
        past = self.init_state(b) if state is None else state
        checks.check_shape("state.conv", past, (b, n, c), "[batch, conv_size - 1, channels]")
        if segment_ids is not None:
            checks.segment_resets(segment_ids, b, t, jnp.float32)  # validates
        padded = jnp.concatenate([past.astype(x.dtype), x], axis=1)  # [b, n + t, c]
        kernel = self.kernel[...].astype(x.dtype)
        if segment_ids is not None:
            runs = checks.segment_runs(segment_ids)  # a repeated id later is a new segment
            seg = jnp.concatenate([jnp.zeros((b, n), jnp.int32), runs], 1)
        y = jnp.zeros_like(x)
        for i in range(self.size):  # tap i looks back n - i tokens
            tap = kernel[i][None, None] * padded[:, i : i + t]
            if segment_ids is not None and i < n:
                same = seg[:, i : i + t] == runs
                tap = jnp.where(same[..., None], tap, jnp.zeros((), x.dtype))
            y = y + tap
        if key_mask is not None:  # real inputs last, in order: a stable sort by the mask
            order = jnp.argsort(key_mask, axis=1, stable=True)
            x = jnp.take_along_axis(x, order[..., None], axis=1)
            padded = jnp.concatenate([past.astype(x.dtype), x], axis=1)
        return y, padded[:, t:].astype(jnp.float32)
