"""The one short causal convolution of the library (the blocks' and the delta layers')."""

from __future__ import annotations

import functools

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
      use_bias: a bias per channel added to each real token's output (RecurrentGemma's).
      rngs: as in Flax (the kernel's noise is drawn from ``rngs.params()``).
      param_dtype: the kernel's dtype, as in Flax.
    """

    def __init__(
        self, channels: int, size: int, *, use_bias: bool = False, rngs: nnx.Rngs,
        param_dtype=jnp.float32,
    ):  # fmt: skip
        checks.check_int("channels", channels, 1)
        checks.check_int("conv_size", size, 1)
        checks.check_bool("use_bias", use_bias)
        self.kernel = nnx.Param(_init_kernel(rngs.params(), size, channels, param_dtype))
        self.bias = nnx.data(nnx.Param(jnp.zeros((channels,), param_dtype)) if use_bias else None)
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

        With ``use_bias``, the bias is added to every real token's output (a masked
        token's stays 0).

        Args:
          x: ``[b, t, c]``; rows that ``key_mask`` masks must hold zeros already (the
            layers replace padding before projecting it).
          state: the inputs before ``x`` (zeros when None); they count as part of the
            first token's segment.
          segment_ids: optional int ``[b, t]``: no tap reaches across a change of id
            (nor into an earlier run of the same id: ``checks.segment_runs``).
          key_mask: optional bool ``[b, t]``: masked tokens are skipped, as if absent: each
            real token's window holds the real inputs before it (the state's, past any
            padding; a masked token's output is 0), and the returned state holds the last
            ``size - 1`` real inputs of each row (from ``state`` where ``x`` has fewer).
        """
        b, t, c = x.shape
        n = self.size - 1
        past = self.init_state(b) if state is None else state
        checks.check_shape("state.conv", past, (b, n, c), "[batch, conv_size - 1, channels]")
        if segment_ids is not None:
            checks.check_segment_ids(segment_ids, b, t)
        seq = jnp.concatenate([past.astype(x.dtype), x], axis=1)  # [b, n + t, c]
        runs = None
        if segment_ids is not None:  # a repeated id later is a new segment
            runs = jnp.concatenate(
                [jnp.zeros((b, n), jnp.int32), checks.segment_runs(segment_ids)], 1
            )
        y, past = self._convolve(x, seq, runs, key_mask)
        if self.bias is not None:
            y = checks.where_token(key_mask, y + self.bias[...].astype(x.dtype)[None, None])
        return y, past

    def _convolve(self, x, seq, runs, key_mask):
        """The taps over ``seq`` (the state then ``x``): ``__call__``'s result, no bias."""
        b, t, c = x.shape
        n = self.size - 1
        kernel = self.kernel[...].astype(x.dtype)
        if key_mask is None:
            return _taps(kernel, seq, runs, t), seq[:, t:].astype(jnp.float32)
        # Padding skipped: the state and the real inputs last, in order (a stable sort by
        # the mask), the zeros of the padding first; every output of the sorted sequence,
        # then each token's own back in x's order.
        real = jnp.concatenate([jnp.ones((b, n), bool), key_mask], axis=1)
        order = jnp.argsort(real, axis=1, stable=True)
        seq = jnp.take_along_axis(seq, order[..., None], axis=1)
        if runs is not None:
            runs = jnp.take_along_axis(runs, order, axis=1)
            runs = jnp.concatenate([jnp.zeros((b, n), runs.dtype), runs], axis=1)
        y = _taps(kernel, jnp.concatenate([jnp.zeros((b, n, c), x.dtype), seq], 1), runs, n + t)
        at = jnp.argsort(order, axis=1)[:, n:]  # where each token of x went
        return jnp.take_along_axis(y, at[..., None], axis=1), seq[:, t:].astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one program, not six, eagerly
def _init_kernel(key, size: int, channels: int, dtype) -> jax.Array:
    """``[size, channels]``: small noise, plus 1 at the last tap (the current token)."""
    kernel = 0.02 * jax.random.normal(key, (size, channels), dtype)
    return kernel.at[-1].add(1.0)


def _taps(kernel: jax.Array, seq: jax.Array, runs: jax.Array | None, m: int) -> jax.Array:
    """The convolution's outputs at the last ``m`` positions of ``seq [b, L, c]`` (``L >=
    m + size - 1``), each from the ``size`` inputs ending there, a tap dropped where
    ``runs [b, L]`` (segment runs, or None) differs from the output's."""
    size, length = kernel.shape[0], seq.shape[1]
    start = length - m - (size - 1)  # where the first output's window begins
    y = jnp.zeros(seq.shape[:1] + (m,) + seq.shape[2:], seq.dtype)
    for i in range(size):  # tap i looks back size - 1 - i tokens
        tap = kernel[i][None, None] * seq[:, start + i : start + i + m]
        if runs is not None and i < size - 1:
            same = runs[:, start + i : start + i + m] == runs[:, length - m :]
            tap = jnp.where(same[..., None], tap, jnp.zeros((), seq.dtype))
        y = y + tap
    return y
