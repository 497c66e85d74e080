"""xLSTM's mLSTM layer, as xLSTM-7B defines it (``transformers``' ``xLSTMLayer``, its
``weight_mode="single"``)::

    q, k, v = split_heads(q(x)), split_heads(k(x)), split_heads(v(x))   # qk_dim, v_dim
    i, f    = cap(igate_preact(x)), cap(fgate_preact(x))                # [b, t, h] each
    h       = mlstm(q, k, v, i, f)                    # linattn_jax.ops.mlstm, sigmoid forget
    out     = out_proj(sigmoid(ogate_preact(x)) * multihead_norm(h))

with ``cap(z) = c tanh(z / c)`` the gates' soft cap (``gate_soft_cap``, 15), ``qk_dim =
qk_dim_factor * width`` and ``v_dim = v_dim_factor * width`` split over the heads, and
``multihead_norm`` a layer norm over each head's ``v_dim / h`` channels (float32) times
one weight over all of them. Decoding carries the ``MLSTMState`` ``(C, n, m)`` per head,
float32; a one-token call is O(1)::

    cache = layer.init_state(batch)
    y, cache = layer(prompt, state=cache, return_state=True)      # prefill, chunked form
    y, cache = layer(next_token, state=cache, return_state=True)  # one token, one step

The xLSTM block is ``TransformerBlock(attention="mlstm", mlp="swiglu")``: pre-norm RMSNorms
and a SwiGLU feed-forward (``transformers``' ``proj_up_gate``, ``proj_up``, ``proj_down``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.common import (
    check_can_decode,
    check_decoding,
    check_state,
    check_tokens,
    split_heads,
)
from linattn_jax.layers.recurrent import run_causal, sequence_sharding
from linattn_jax.ops import checks, mlstm


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (None: ``x``)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


class MultiHeadLayerNorm(nnx.Module):
    """A layer norm over each head's channels, in float32, then one weight (and bias) over
    all heads' channels: xLSTM's ``multihead_norm``.

    Args:
      num_heads: the heads h.
      head_dim: each head's channels.
      epsilon: added to each head's variance.
      use_bias: a bias after the weight.
      rngs: unused (weight from ones, bias from zeros), as in Flax.
      param_dtype: the parameters' dtype.
    """

    def __init__(
        self, num_heads: int, head_dim: int, *, epsilon: float = 1e-6, use_bias: bool = False,
        rngs: nnx.Rngs, param_dtype: Any = jnp.float32,
    ):  # fmt: skip
        del rngs
        features = num_heads * head_dim
        param = lambda init: nnx.Param(
            sharding.with_axes(lambda *_: init((features,), param_dtype), sharding.HEADS)(
                None, (features,)
            )
        )
        self.weight = param(jnp.ones)
        self.bias = nnx.data(param(jnp.zeros) if use_bias else None)
        self.num_heads, self.head_dim, self.epsilon = num_heads, head_dim, epsilon

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [b, t, h, head_dim] -> [b, t, h * head_dim]`` float32."""
        x = x.astype(jnp.float32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])  # no -1: t may be 0
        lead = (1,) * (y.ndim - 1)
        y = y * self.weight[...].astype(jnp.float32).reshape(*lead, -1)
        return y if self.bias is None else y + self.bias[...].astype(jnp.float32).reshape(*lead, -1)


class MLSTMLayer(nnx.Module):
    """xLSTM's mLSTM layer: ``[b, t, width] -> [b, t, width]`` (the module's docstring).

    Parameters (``transformers``' names): ``q``, ``k``, ``v``, ``ogate_preact``,
    ``igate_preact`` and ``fgate_preact`` (with biases: -10 and ``linspace(3, 6)`` at
    initialisation, their kernels zeros, as xLSTM), ``multihead_norm`` and ``out_proj``.

    Args:
      width: model width (input and output features).
      num_heads: the mLSTM's heads (dividing qk_dim and v_dim).
      qk_dim_factor: ``qk_dim / width`` (xLSTM-7B: 0.5).
      v_dim_factor: ``v_dim / width`` (xLSTM-7B: 1).
      gate_soft_cap: the input and forget gates' soft cap (None: none).
      use_bias: biases on the projections (the gates always have theirs) and the norm.
      norm_eps: the multi-head norm's epsilon.
      eps: the mLSTM normaliser's epsilon (``ops.mlstm.causal``'s).
      causal: True for decoders; with False the layer still reads left to right, and
        refuses decoding.
      method: the full-sequence form (``ops.mlstm.METHODS``).
      chunk_size: tokens per chunk; None (default): the family's default
        (``linattn_jax.ops.checks.default_chunk_size``).
      sequence_axis: a mesh axis that splits full-sequence forwards along their length
        (``ops.mlstm.sequence_parallel``; no ``key_mask`` or ``segment_ids`` then).
      batch_axis: the mesh axis that splits the batch alongside ``sequence_axis``.
      mesh: the mesh of those axes; the current one when None.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's); states stay float32.
      param_dtype: the parameters' dtype.

    Raises:
      ValueError: a size that is not a positive int, heads that do not divide qk_dim or
        v_dim, a bad method, soft cap or flag.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        qk_dim_factor: float = 0.5,
        v_dim_factor: float = 1.0,
        gate_soft_cap: float | None = 15.0,
        use_bias: bool = False,
        norm_eps: float = 1e-6,
        eps: float = 1e-6,
        causal: bool = True,
        method: str = "chunked",
        chunk_size: int | None = None,
        sequence_axis: str | None = None,
        batch_axis: str | tuple[str, ...] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        checks.check_sizes(width=width, num_heads=num_heads)
        qk_dim, v_dim = int(width * qk_dim_factor), int(width * v_dim_factor)
        for name, dim in [("qk_dim_factor * width", qk_dim), ("v_dim_factor * width", v_dim)]:
            if dim < 1 or dim % num_heads:
                raise ValueError(f"num_heads={num_heads} must divide {name} = {dim} (>= 1)")
        if method not in mlstm.METHODS:
            raise ValueError(f"method must be one of {mlstm.METHODS}, got {method!r}")
        checks.check_chunk_size(chunk_size)
        if gate_soft_cap is not None:
            checks.check_number("gate_soft_cap", gate_soft_cap, minimum=0.0)
        checks.check_number("eps", eps, minimum=0.0)
        for name, flag in [("use_bias", use_bias), ("causal", causal)]:
            checks.check_bool(name, flag)
        self.width, self.num_heads, self.qk_dim, self.v_dim = width, num_heads, qk_dim, v_dim
        self.gate_soft_cap, self.eps = gate_soft_cap, eps
        self.causal, self.method, self.chunk_size = causal, method, chunk_size
        self.sharding = nnx.data(sequence_sharding(sequence_axis, batch_axis, mesh, causal))
        options = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        zeros = nnx.initializers.zeros_init()
        embed, heads = sharding.EMBED, sharding.HEADS

        def linear(n_in, n_out, axes, bias=use_bias, kernel_init=None, bias_init=zeros):
            kernel_init = kernel_init or sharding.kernel(*axes)
            if kernel_init is zeros:
                kernel_init = sharding.with_axes(zeros, *axes)
            return nnx.Linear(
                n_in, n_out, use_bias=bias, kernel_init=kernel_init,
                bias_init=sharding.with_axes(bias_init, axes[1]), **options,
            )  # fmt: skip

        self.q = linear(width, qk_dim, (embed, heads))
        self.k = linear(width, qk_dim, (embed, heads))
        self.v = linear(width, v_dim, (embed, heads))
        self.ogate_preact = linear(width, v_dim, (embed, heads))
        h = num_heads
        forget_bias = lambda key, shape, dtype=jnp.float32: jnp.linspace(3.0, 6.0, h, dtype=dtype)
        input_bias = lambda key, shape, dtype=jnp.float32: jnp.full(shape, -10.0, dtype)
        self.igate_preact = linear(width, h, (embed, None), True, zeros, input_bias)
        self.fgate_preact = linear(width, h, (embed, None), True, zeros, forget_bias)
        self.multihead_norm = MultiHeadLayerNorm(
            h, v_dim // h, epsilon=norm_eps, use_bias=use_bias, rngs=rngs,
            param_dtype=param_dtype,
        )  # fmt: skip
        self.out_proj = linear(v_dim, width, (heads, embed))

    def init_state(self, batch: int, max_length: int | None = None) -> mlstm.State:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        check_can_decode(self)
        h = self.num_heads
        return mlstm.init_state(batch, h, self.qk_dim // h, self.v_dim // h)

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: mlstm.State | None = None,
        return_state: bool = False,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``).

        Args:
          x: ``[b, t, width]``.
          key_mask: optional bool ``[b, t]``, True for real tokens: padded rows are
            replaced by zeros before the projections and leave the state untouched.
          segment_ids: optional int ``[b, t]``: the state restarts wherever the id changes.
          state: an ``MLSTMState`` (``init_state``): a one-token ``x`` takes the O(1) step,
            a longer one (a prompt) runs the full-sequence form from it.
          return_state: also return the new state.
        """
        check_tokens(x, self.width)
        check_decoding(self, state, return_state)
        check_state(state, mlstm.State, "an")
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        x = checks.where_token(key_mask, x)
        h = self.num_heads
        q, k, v = (split_heads(proj(x), h) for proj in (self.q, self.k, self.v))
        i, f = (
            soft_cap(proj(x).astype(jnp.float32), self.gate_soft_cap)
            for proj in (self.igate_preact, self.fgate_preact)
        )
        y, state = run_causal(
            mlstm, q, k, v, i, f, state=state, key_mask=key_mask, segment_ids=segment_ids,
            method=self.method, chunk_size=self.chunk_size, sharding=self.sharding,
            options=dict(eps=self.eps),
        )  # fmt: skip
        gate = jax.nn.sigmoid(self.ogate_preact(x).astype(jnp.float32))
        out = self.out_proj((gate * self.multihead_norm(y)).astype(v.dtype))
        return (out, state) if return_state else out
