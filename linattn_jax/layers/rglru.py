"""Griffin's recurrent block (RecurrentGemma's ``RecurrentGemmaRecurrentBlock``)::

    y   = gelu(linear_y(x))                                   # the gate branch
    u   = conv_1d(linear_x(x))                                # causal depthwise, with bias
    i   = u_h W_i[h] + b_i[h],   r = u_h W_r[h] + b_r[h]      # block-diagonal, per head
    out = linear_out(rglru(u, i, r, a_param=recurrent_param) * y)

``rglru`` is ``linattn_jax.ops.rglru``: ``h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (sigmoid(i_t)
u_t)``, ``a_t = sigmoid(-recurrent_param) ** (8 sigmoid(r_t))``, with Griffin's sequence
start (``position == 0``: no normalisation, no state) at each row's first real token and
each segment's. Decoding carries ``RGLRUCache``: the conv's last inputs, the RG-LRU's state
(both float32) and the real tokens seen; a one-token call is O(1)::

    cache = layer.init_state(batch)
    y, cache = layer(prompt, state=cache, return_state=True)      # prefill
    y, cache = layer(next_token, state=cache, return_state=True)  # one token, one step
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.common import (
    check_can_decode,
    check_decoding,
    check_state,
    check_tokens,
    next_position,
    positions,
    split_heads,
)
from linattn_jax.layers.conv import CausalConv1D
from linattn_jax.layers.recurrent import run_causal, sequence_sharding
from linattn_jax.ops import checks, rglru

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True), "gelu": jax.nn.gelu}


class RGLRUCache(NamedTuple):
    """An ``RGLRUBlock``'s decoding state.

    Attributes:
      conv: ``[b, conv_size - 1, lru_width]`` float32, the conv's last real inputs.
      lru: the RG-LRU's ``ops.rglru.State`` (``h [b, heads, lru_width / heads]``, float32).
      position: ``[b]`` int32, the real tokens seen (0: the next one starts a sequence).
    """

    conv: jax.Array
    lru: rglru.State
    position: jax.Array


class RGLRUBlock(nnx.Module):
    """Griffin's recurrent block: ``[b, t, width] -> [b, t, width]`` (the module's docstring).

    Parameters (``transformers``' names): ``linear_y``, ``linear_x``, ``linear_out`` (with
    biases), ``conv_1d`` (``kernel [conv_size, lru_width]``, ``bias``), and the RG-LRU's
    ``recurrent_param [lru_width]``, ``input_gate_weight`` and ``recurrent_gate_weight``
    ``[heads, lru_width / heads, lru_width / heads]`` with their biases ``[heads, ...]``.

    Args:
      width: model width (input and output features).
      num_heads: the gates' blocks (dividing ``lru_width``).
      lru_width: the recurrence's channels (None: ``width``).
      conv_size: the conv's kernel size.
      activation: the gate branch's, ``"gelu_pytorch_tanh"`` (RecurrentGemma's) or ``"gelu"``.
      c: the RG-LRU's exponent scale (Griffin's 8).
      causal: must be True (the block is a recurrence); False is refused by decoding.
      method: the full-sequence form (``ops.rglru.METHODS``).
      chunk_size: tokens per chunk; None: the family's default.
      sequence_axis: a mesh axis that splits full-sequence forwards along their length
        (``ops.rglru.sequence_parallel``; no ``key_mask`` or ``segment_ids`` then).
      batch_axis: the mesh axis that splits the batch alongside ``sequence_axis``.
      mesh: the mesh of those axes; the current one when None.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's); states stay float32.
      param_dtype: the parameters' dtype.

    Raises:
      ValueError: a size that is not a positive int, heads that do not divide
        ``lru_width``, an unknown activation or method.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        lru_width: int | None = None,
        conv_size: int = 4,
        activation: str = "gelu_pytorch_tanh",
        c: float = 8.0,
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
        lru = width if lru_width is None else lru_width
        checks.check_sizes(width=width, num_heads=num_heads, lru_width=lru, conv_size=conv_size)
        if lru % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide lru_width={lru}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        if method not in rglru.METHODS:
            raise ValueError(f"method must be one of {rglru.METHODS}, got {method!r}")
        checks.check_chunk_size(chunk_size)
        checks.check_number("c", c, minimum=0.0)
        checks.check_bool("causal", causal)
        self.width, self.num_heads, self.lru_width = width, num_heads, lru
        self.activation, self.c, self.causal = activation, float(c), causal
        self.method, self.chunk_size = method, chunk_size
        self.sharding = nnx.data(sequence_sharding(sequence_axis, batch_axis, mesh, causal))
        embed, heads = sharding.EMBED, sharding.HEADS
        zeros = nnx.initializers.zeros_init()
        linear = lambda n_in, n_out, *axes: nnx.Linear(
            n_in, n_out, kernel_init=sharding.kernel(*axes),
            bias_init=sharding.with_axes(zeros, axes[1]), dtype=dtype, param_dtype=param_dtype,
            rngs=rngs,
        )  # fmt: skip
        self.linear_y = linear(width, lru, embed, heads)
        self.linear_x = linear(width, lru, embed, heads)
        self.linear_out = linear(lru, width, heads, embed)
        self.conv_1d = CausalConv1D(lru, conv_size, use_bias=True, rngs=rngs,
                                    param_dtype=param_dtype)  # fmt: skip
        block = lru // num_heads
        gate = lambda: nnx.Param(
            jax.random.normal(rngs.params(), (num_heads, block, block), param_dtype)
            / math.sqrt(block)
        )
        self.input_gate_weight, self.recurrent_gate_weight = gate(), gate()
        self.input_gate_bias = nnx.Param(jnp.zeros((num_heads, block), param_dtype))
        self.recurrent_gate_bias = nnx.Param(jnp.zeros((num_heads, block), param_dtype))
        # Griffin's initialisation: a = sigmoid(-recurrent_param) ** 8 uniform in [0.9, 0.999].
        a_8 = jax.random.uniform(rngs.params(), (lru,), jnp.float32, 0.9**2, 0.999**2)
        self.recurrent_param = nnx.Param(jnp.log(a_8**-0.5 - 1.0).astype(param_dtype))

    def init_state(self, batch: int, max_length: int | None = None) -> RGLRUCache:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        check_can_decode(self)
        h = self.num_heads
        return RGLRUCache(
            conv=self.conv_1d.init_state(batch),
            lru=rglru.init_state(batch, h, self.lru_width // h),
            position=jnp.zeros((batch,), jnp.int32),
        )

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: RGLRUCache | None = None,
        return_state: bool = False,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``).

        Args:
          x: ``[b, t, width]``.
          key_mask: optional bool ``[b, t]``, True for real tokens: padding is replaced by
            zeros, skipped by the conv, and leaves the state untouched.
          segment_ids: optional int ``[b, t]``: the conv and the recurrence restart at
            each new segment.
          state: an ``RGLRUCache`` (``init_state``): a one-token ``x`` takes the O(1) step,
            a longer one (a prompt) runs the full-sequence form from it.
          return_state: also return the new state.
        """
        check_tokens(x, self.width)
        check_decoding(self, state, return_state)
        check_state(state, RGLRUCache, "an")
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        x = checks.where_token(key_mask, x)
        y = ACTIVATIONS[self.activation](self.linear_y(x))
        u = checks.where_token(key_mask, self.linear_x(x))  # padding is absent from the conv
        u, conv = self.conv_1d(u, None if state is None else state.conv, segment_ids, key_mask)
        u = split_heads(u, self.num_heads)  # [b, t, h, lru / h]

        def gate(w, bias):  # block-diagonal: head h's channels through its own matrix
            w, bias = w[...].astype(u.dtype), bias[...].astype(u.dtype)
            return jnp.einsum("bthi,hij->bthj", u, w) + bias[None, None]

        i = gate(self.input_gate_weight, self.input_gate_bias)
        r = gate(self.recurrent_gate_weight, self.recurrent_gate_bias)
        position = None if state is None else state.position
        live = jnp.ones((b, t), bool) if key_mask is None else key_mask
        reset = live & (positions(position, b, t, key_mask) == 0)  # Griffin's position 0
        a_param = self.recurrent_param[...].reshape(self.num_heads, -1)
        h, lru = run_causal(
            rglru, u, i, r, state=None if state is None else state.lru, key_mask=key_mask,
            segment_ids=segment_ids, method=self.method, chunk_size=self.chunk_size,
            sharding=self.sharding, options=dict(a_param=a_param, c=self.c),
            step_options=dict(reset=reset[:, 0] if t else None), causal_options=dict(reset=reset),
        )  # fmt: skip
        out = self.linear_out(h.reshape(b, t, self.lru_width).astype(y.dtype) * y)
        if not return_state:
            return out
        return out, RGLRUCache(conv, lru, next_position(position, b, t, key_mask))
