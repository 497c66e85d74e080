"""RWKV-4's two halves, as ``transformers``' ``RwkvSelfAttention`` and ``RwkvFeedForward``
define them. Each mixes every token's input with the previous token's (the token shift,
``mix(mu) = mu * x_t + (1 - mu) * x_{t-1}``, per channel)::

    time mix:     k, v, r = key(mix(mu_k)), value(mix(mu_v)), receptance(mix(mu_r))
                  out = output(sigmoid(r) * wkv(k, v))     # linattn_jax.ops.wkv
    channel mix:  out = sigmoid(receptance(mix(mu_r))) * value(relu(key(mix(mu_k)))^2)

The time mix is the mixer kind ``"rwkv"``; the channel mix is the block's MLP
(``mlp="rwkv"``), so ``TransformerBlock(attention="rwkv", mlp="rwkv", norm="layer")`` is
RWKV-4's block. Decoding carries the previous token's input of each half (float32) and the
WKV's state; a one-token call is O(1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.common import check_state, check_tokens, projection, split_heads
from linattn_jax.layers.recurrent import run_causal
from linattn_jax.ops import checks, wkv


class RWKVState(NamedTuple):
    """The time mix's decoding state: the previous token's input ``shift [b, width]`` and
    the ``WKVState`` (both float32)."""

    shift: jax.Array
    wkv: wkv.State


def token_shift(x, previous, key_mask=None, segment_ids=None):
    """Each token's previous input: ``(shifted [b, t, c], the last input [b, c] float32)``.

    Args:
      x: ``[b, t, c]``, padding already zeros.
      previous: the input before ``x`` ``[b, c]`` (None: zeros); it belongs to token 0's
        segment.
      key_mask: optional bool ``[b, t]``: a masked token is skipped, as if absent (the
        next real token's previous input is the last real one before it).
      segment_ids: optional int ``[b, t]``: the first token of a segment sees zeros.
    """
    b, t, c = x.shape
    previous = jnp.zeros((b, c), x.dtype) if previous is None else previous.astype(x.dtype)
    seq = jnp.concatenate([previous[:, None], x], axis=1)  # [b, t + 1, c]: 0 is the previous
    if key_mask is None and segment_ids is None:
        return seq[:, :t], seq[:, t].astype(jnp.float32)
    live = jnp.ones((b, t), bool) if key_mask is None else key_mask
    live = jnp.concatenate([jnp.ones((b, 1), bool), live], axis=1)
    index = jnp.broadcast_to(jnp.arange(t + 1), (b, t + 1))
    source = jax.lax.cummax(jnp.where(live, index, 0), axis=1)  # the last real at or before
    picked = jnp.take_along_axis(seq, source[..., None], axis=1)  # [b, t + 1, c]
    if segment_ids is not None:
        runs = checks.segment_runs(segment_ids)
        runs = jnp.concatenate([runs[:, :1], runs], axis=1)  # the previous: token 0's run
        own = jnp.concatenate([runs[:, 1:], runs[:, -1:]], axis=1)  # query j: token j's
        same = jnp.take_along_axis(runs, source, axis=1) == own
        picked = jnp.where(same[..., None], picked, jnp.zeros((), x.dtype))
    return picked[:, :t], picked[:, t].astype(jnp.float32)


def _mix_param(width: int, param_dtype) -> nnx.Param:
    """A token-shift mix ``mu [width]``, initialised to 0.5."""
    init = sharding.with_axes(nnx.initializers.constant(0.5), sharding.EMBED)
    return nnx.Param(init(jax.random.PRNGKey(0), (width,), param_dtype))


def _mix(x, shifted, mu):
    """``mu * x + (1 - mu) * shifted``."""
    mu = mu[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
    return x * mu + shifted * (1 - mu)


class RWKVTimeMix(nnx.Module):
    """RWKV-4's time mix (``transformers``' ``RwkvSelfAttention``): the kind ``"rwkv"``.

    Args:
      width: model width.
      num_heads: how the WKV's channels are laid out for ``linattn_jax.ops.wkv``
        (``[h, d]``; each channel is its own recurrence, so the heads change nothing but
        the layout); must divide ``wkv_width``.
      wkv_width: the key, value and receptance width (``attention_hidden_size``); None:
        ``width``.
      method: the WKV's full-sequence form, one of ``ops.wkv.METHODS``.
      chunk_size: as in ``ops.wkv.causal``.
      causal: True (RWKV is causal; the option is the layers' common one).
      rngs: as in Flax.
      dtype: the computation dtype, as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
    """

    def __init__(
        self, width: int, num_heads: int, *, wkv_width: int | None = None, method: str = "scan",
        chunk_size: int | None = None, causal: bool = True, rngs: nnx.Rngs, dtype=None,
        param_dtype=jnp.float32,
    ):  # fmt: skip
        checks.check_sizes(width=width, num_heads=num_heads)
        wkv_width = width if wkv_width is None else wkv_width
        checks.check_int("wkv_width", wkv_width, 1)
        if wkv_width % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide wkv_width={wkv_width}")
        if method not in wkv.METHODS:
            raise ValueError(f"method must be one of {wkv.METHODS}, got {method!r}")
        checks.check_chunk_size(chunk_size)
        if causal is not True:
            raise ValueError(f"the RWKV time mix is causal: causal must be True, got {causal!r}")
        self.width, self.num_heads, self.wkv_width = width, num_heads, wkv_width
        self.method, self.chunk_size, self.causal = method, chunk_size, True
        # Decays spread over the channels as RWKV-4's initialisation spreads them.
        decay = jnp.linspace(-5.0, 3.0, wkv_width, dtype=param_dtype)
        self.time_decay = nnx.Param(decay)
        self.time_first = nnx.Param(jnp.full((wkv_width,), jnp.log(0.3), param_dtype))
        self.time_mix_key = _mix_param(width, param_dtype)
        self.time_mix_value = _mix_param(width, param_dtype)
        self.time_mix_receptance = _mix_param(width, param_dtype)
        options = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        embed, heads = sharding.EMBED, sharding.HEADS
        self.key = projection(width, wkv_width, embed, heads, **options)
        self.value = projection(width, wkv_width, embed, heads, **options)
        self.receptance = projection(width, wkv_width, embed, heads, **options)
        self.output = projection(wkv_width, width, heads, embed, **options)

    def init_state(self, batch: int, max_length: int | None = None) -> RWKVState:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        h = self.num_heads
        shift = jnp.zeros((batch, self.width), jnp.float32)
        return RWKVState(shift, wkv.init_state(batch, h, self.wkv_width // h))

    def __call__(self, x, *, key_mask=None, segment_ids=None, state=None, return_state=False):
        """``x [b, t, width] -> [b, t, width]`` (and the new ``RWKVState`` if
        ``return_state``). A masked token (``key_mask`` False) is skipped by the token
        shift and leaves the WKV's state untouched; ``segment_ids`` restart both."""
        check_tokens(x, self.width)
        check_state(state, RWKVState)
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        x = checks.where_token(key_mask, x)
        shifted, last = token_shift(
            x, None if state is None else state.shift, key_mask, segment_ids
        )
        h = self.num_heads
        k = split_heads(self.key(_mix(x, shifted, self.time_mix_key)), h)
        v = split_heads(self.value(_mix(x, shifted, self.time_mix_value)), h)
        r = jax.nn.sigmoid(self.receptance(_mix(x, shifted, self.time_mix_receptance)))
        channels = lambda p: p[...].reshape(h, self.wkv_width // h)
        constants = dict(time_decay=channels(self.time_decay), time_first=channels(self.time_first))
        y, wkv_state = run_causal(
            wkv, k, v, state=None if state is None else state.wkv, key_mask=key_mask,
            segment_ids=segment_ids, method=self.method, chunk_size=self.chunk_size,
            sharding=None, options=constants,
        )  # fmt: skip
        out = self.output(r * y.reshape(b, t, self.wkv_width).astype(r.dtype))
        return (out, RWKVState(last, wkv_state)) if return_state else out


class RWKVChannelMix(nnx.Module):
    """RWKV-4's channel mix (``transformers``' ``RwkvFeedForward``): a block's MLP
    (``mlp="rwkv"``) with a token shift, whose decoding state is the previous token's
    input ``[b, width]`` float32.

    Args:
      width: model width.
      hidden: the key's width (``intermediate_size``).
      rngs: as in Flax.
      dtype: the computation dtype, as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
    """

    def __init__(
        self, width: int, hidden: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32
    ):
        checks.check_sizes(width=width, hidden=hidden)
        self.width = width
        self.time_mix_key = _mix_param(width, param_dtype)
        self.time_mix_receptance = _mix_param(width, param_dtype)
        options = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        embed, mlp = sharding.EMBED, sharding.MLP
        self.key = projection(width, hidden, embed, mlp, **options)
        self.receptance = projection(width, width, embed, None, **options)
        self.value = projection(hidden, width, mlp, embed, **options)

    def init_state(self, batch: int) -> jax.Array:
        """Zeros ``[batch, width]``, float32: no token before the first."""
        return jnp.zeros((batch, self.width), jnp.float32)

    def __call__(self, x, *, key_mask=None, segment_ids=None, state=None):
        """``x [b, t, width] -> (out [b, t, width], the last real input [b, width])``; the
        token shift as in ``token_shift``, from ``state`` (None: zeros)."""
        x = checks.where_token(key_mask, x)
        shifted, last = token_shift(x, state, key_mask, segment_ids)
        k = jnp.square(jax.nn.relu(self.key(_mix(x, shifted, self.time_mix_key))))
        r = jax.nn.sigmoid(self.receptance(_mix(x, shifted, self.time_mix_receptance)))
        return r * self.value(k), last
