"""Mamba-1's mixer (Gu and Dao 2023), as ``transformers``' ``MambaMixer`` computes it::

    x, z     = split(in_proj(u))                   # inner each
    x        = SiLU(conv(x) + conv_bias)           # causal, depthwise, kernel conv_size
    dt, B, C = split(x_proj(x))                    # dt_rank, n, n
    dt, B, C = rms(dt), rms(B), rms(C)             # Falcon-Mamba (no weights), Jamba (weights)
    dt       = softplus(dt_proj(dt))               # inner, with dt_proj's bias
    y        = selective_scan(x, dt, -exp(A_log), B, C, D=D)   # linattn_jax.ops.selective
    out      = out_proj(y * SiLU(z))

with ``inner = expand * width``, ``A_log [inner, n]``; with ``heads > 1`` (Zamba's
``n_mamba_heads``) the channels are ``heads`` groups, each with its own ``x_proj`` and
``dt_proj`` (its own dt, B and C) and its own scan. Decoding carries the scan's state
``[b, inner, n]`` and the convolution's last ``conv_size - 1`` inputs, both float32: a
one-token call is O(1)::

    cache = layer.init_state(batch)
    y, cache = layer(prompt, state=cache, return_state=True)      # prefill, chunked form
    y, cache = layer(next_token, state=cache, return_state=True)  # one token, one step
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.common import check_can_decode, check_decoding, check_state, check_tokens
from linattn_jax.layers.conv import CausalConv1D
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.layers.recurrent import run_causal, sequence_sharding
from linattn_jax.ops import checks, selective

DT_INIT_RANGE = (1e-3, 1e-1)  # softplus(dt bias) log-uniform in this range (Mamba)


class MambaCache(NamedTuple):
    """A ``MambaMixer``'s decoding state.

    Attributes:
      ssm: the selective scan's state, ``h [b, inner, n]`` float32.
      conv: the convolution's last ``conv_size - 1`` inputs, ``[b, conv_size - 1, inner]``
        float32.
    """

    ssm: selective.State
    conv: jax.Array


def _param(value: jax.Array, *names: str | None) -> nnx.Param:
    """``nnx.Param(value)`` with its dims named ``names`` (``sharding.with_axes``)."""
    return nnx.Param(sharding.with_axes(lambda *_: value, *names)(None, value.shape))


class MambaMixer(nnx.Module):
    """Mamba-1's mixer: ``[b, t, width] -> [b, t, width]`` (the module's docstring).

    Parameters (``transformers``' names): ``in_proj``, ``conv.kernel`` ``[conv_size,
    inner]`` with ``conv_bias``, ``x_proj`` (no bias), ``dt_proj`` (with bias), ``A_log``
    ``[inner, n]``, ``D`` ``[inner]`` and ``out_proj``.

    Args:
      width: model width (input and output features).
      num_heads: unused (Mamba-1 has no heads; the registry passes one to every kind).
      expand: ``inner / width`` (Mamba's ``expand``, 2).
      state_dim: n, the state's size per channel (Mamba's ``state_size``).
      dt_rank: the width of ``dt`` before ``dt_proj``; None: ``ceil(width / 16)``.
      conv_size: the causal depthwise convolution's kernel (Mamba's ``conv_kernel``).
      use_conv_bias: the convolution's bias.
      use_bias: biases on ``in_proj`` and ``out_proj``.
      heads: the inner channels in ``heads`` equal groups, each with its own ``x_proj``
        and ``dt_proj`` (so its own dt, B and C: Zamba's ``n_mamba_heads``); with more
        than one, ``x_proj.kernel`` is ``[heads, inner / heads, dt_rank + 2 n]``,
        ``dt_proj.kernel`` ``[heads, dt_rank, inner / heads]`` and its bias ``[heads,
        inner / heads]``.
      mixer_rms_eps: None, or the epsilon of the RMS norms on dt, B and C (Falcon-Mamba's
        ``mixer_rms_eps``).
      mixer_rms_weights: those norms with weights (``dt_layernorm``, ``b_layernorm``,
        ``c_layernorm``: ``layers.RMSNorm``s, Jamba's); False: weightless (Falcon-Mamba's).
      causal: True for decoders; with False the layer still reads left to right, and
        refuses decoding.
      method: the scan's full-sequence form (``ops.selective.METHODS``).
      chunk_size: tokens per chunk; None (default): the family's default.
      sequence_axis: a mesh axis that splits full-sequence forwards along their length
        (``ops.selective.sequence_parallel``; no ``key_mask`` or ``segment_ids`` then).
      batch_axis: the mesh axis that splits the batch alongside ``sequence_axis``.
      mesh: the mesh of those axes; the current one when None.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's); states stay float32.
      param_dtype: the parameters' dtype.

    Raises:
      ValueError: a size that is not a positive int, a bad method, epsilon or flag.
    """

    def __init__(
        self,
        width: int,
        num_heads: int | None = None,
        *,
        expand: int = 2,
        state_dim: int = 16,
        dt_rank: int | None = None,
        conv_size: int = 4,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        heads: int = 1,
        mixer_rms_eps: float | None = None,
        mixer_rms_weights: bool = False,
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
        del num_heads
        dt_rank = math.ceil(width / 16) if dt_rank is None else dt_rank
        checks.check_sizes(width=width, expand=expand, state_dim=state_dim, dt_rank=dt_rank)
        checks.check_sizes(conv_size=conv_size, heads=heads)
        if (expand * width) % heads:
            raise ValueError(f"heads={heads} must divide the inner width {expand * width}")
        if method not in selective.METHODS:
            raise ValueError(f"method must be one of {selective.METHODS}, got {method!r}")
        checks.check_chunk_size(chunk_size)
        for name, flag in [("use_conv_bias", use_conv_bias), ("use_bias", use_bias),
                           ("causal", causal)]:  # fmt: skip
            checks.check_bool(name, flag)
        if mixer_rms_eps is not None:
            checks.check_number("mixer_rms_eps", mixer_rms_eps, minimum=0.0)
        checks.check_bool("mixer_rms_weights", mixer_rms_weights)
        if mixer_rms_weights and mixer_rms_eps is None:
            raise ValueError("mixer_rms_weights needs mixer_rms_eps (the norms' epsilon), got None")
        inner = expand * width
        self.sharding = nnx.data(sequence_sharding(sequence_axis, batch_axis, mesh, causal))
        self.width, self.inner, self.state_dim, self.dt_rank = width, inner, state_dim, dt_rank
        self.heads = heads
        self.mixer_rms_eps = None if mixer_rms_eps is None else float(mixer_rms_eps)
        self.causal, self.method, self.chunk_size = causal, method, chunk_size
        options = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        zeros = nnx.initializers.zeros_init()
        heads = sharding.with_axes(zeros, sharding.HEADS)
        self.in_proj = nnx.Linear(
            width, 2 * inner, use_bias=use_bias, bias_init=heads,
            kernel_init=sharding.kernel(sharding.EMBED, sharding.HEADS), **options,
        )  # fmt: skip
        self.conv = CausalConv1D(inner, conv_size, rngs=rngs, param_dtype=param_dtype)
        self.conv.kernel = _param(self.conv.kernel[...], None, sharding.HEADS)
        self.conv_bias = nnx.data(
            _param(jnp.zeros((inner,), param_dtype), sharding.HEADS) if use_conv_bias else None
        )
        self.x_proj, self.dt_proj = _projections(self.heads, inner, dt_rank, state_dim, options)
        a_log = jnp.log(jnp.broadcast_to(jnp.arange(1, state_dim + 1.0), (inner, state_dim)))
        self.A_log = _param(a_log.astype(param_dtype), sharding.HEADS, None)  # A = -1 ... -n
        self.D = _param(jnp.ones((inner,), param_dtype), sharding.HEADS)
        self.out_proj = nnx.Linear(
            inner, width, use_bias=use_bias,
            kernel_init=sharding.kernel(sharding.HEADS, sharding.EMBED),
            bias_init=sharding.with_axes(zeros, sharding.EMBED), **options,
        )  # fmt: skip
        # Last: the other parameters are drawn as without them.
        norm = lambda size: (
            RMSNorm(size, epsilon=mixer_rms_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            if mixer_rms_weights
            else None
        )
        self.dt_layernorm = nnx.data(norm(dt_rank))
        self.b_layernorm = nnx.data(norm(state_dim))
        self.c_layernorm = nnx.data(norm(state_dim))

    def init_state(self, batch: int, max_length: int | None = None) -> MambaCache:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        check_can_decode(self)
        state = selective.init_state(batch, self.inner, self.state_dim)
        return MambaCache(state, self.conv.init_state(batch))

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: MambaCache | None = None,
        return_state: bool = False,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``).

        Args:
          x: ``[b, t, width]``.
          key_mask: optional bool ``[b, t]``, True for real tokens: padded rows are
            replaced by zeros before anything reads them, reach neither the convolution's
            window nor the state (which they do not decay) and give ``out_proj(0)``.
          segment_ids: optional int ``[b, t]``: the scan's state and the convolution reset
            wherever the id changes.
          state: a ``MambaCache`` (``init_state``): a one-token ``x`` takes the O(1) step,
            a longer one (a prompt) runs the full-sequence form from it.
          return_state: also return the new ``MambaCache``.
        """
        check_tokens(x, self.width)
        check_decoding(self, state, return_state)
        check_state(state, MambaCache)
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        projected = self.in_proj(checks.where_token(key_mask, x))
        xs, z = jnp.split(projected, 2, axis=-1)
        xs, conv_state = self.conv(
            checks.where_token(key_mask, xs),
            None if state is None else state.conv,
            segment_ids,
            key_mask,
        )
        if self.conv_bias is not None:
            xs = xs + self.conv_bias[...].astype(xs.dtype)[None, None]
        xs = checks.where_token(key_mask, jax.nn.silu(xs))
        per_head = xs if self.heads == 1 else xs.reshape(b, t, self.heads, -1)
        dt, B, C = jnp.split(
            self.x_proj(per_head), [self.dt_rank, self.dt_rank + self.state_dim], -1
        )
        if self.dt_layernorm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif self.mixer_rms_eps is not None:
            dt, B, C = (_weightless_rms(y, self.mixer_rms_eps) for y in (dt, B, C))
        dt = jax.nn.softplus(self.dt_proj(dt).reshape(b, t, self.inner).astype(jnp.float32))
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        D = self.D[...].astype(jnp.float32)
        scan = lambda xs, dt, A, B, C, D, state: run_causal(
            selective, xs, dt, A, B, C, state=state, key_mask=key_mask,
            segment_ids=segment_ids, method=self.method, chunk_size=self.chunk_size,
            sharding=self.sharding, options=dict(D=D),
        )  # fmt: skip
        ssm = None if state is None else state.ssm
        if self.heads == 1:
            y, ssm = scan(xs, dt, A, B, C, D, ssm)
        else:
            y, ssm = _scan_heads(scan, self.heads, xs, dt, A, B, C, D, ssm)
        y = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        out = self.out_proj(y.astype(projected.dtype))
        return (out, MambaCache(ssm, conv_state)) if return_state else out


def _projections(heads: int, inner: int, dt_rank: int, state_dim: int, options):
    """``(x_proj, dt_proj)``: ``nnx.Linear``s for one head, else ``nnx.Einsum``s per head
    of ``inner / heads`` channels."""
    if heads == 1:
        x_proj = nnx.Linear(
            inner, dt_rank + 2 * state_dim, use_bias=False,
            kernel_init=sharding.kernel(sharding.HEADS, None), **options,
        )  # fmt: skip
        dt_proj = nnx.Linear(
            dt_rank, inner, kernel_init=sharding.kernel(None, sharding.HEADS),
            bias_init=sharding.with_axes(_dt_bias, sharding.HEADS), **options,
        )  # fmt: skip
        return x_proj, dt_proj
    width = inner // heads
    x_proj = nnx.Einsum(
        "...hd,hde->...he", (heads, width, dt_rank + 2 * state_dim),
        kernel_init=sharding.kernel(None, sharding.HEADS, None), **options,
    )  # fmt: skip
    dt_proj = nnx.Einsum(
        "...hr,hrd->...hd", (heads, dt_rank, width), (heads, width),
        kernel_init=sharding.kernel(None, None, sharding.HEADS),
        bias_init=sharding.with_axes(_dt_bias, None, sharding.HEADS), **options,
    )  # fmt: skip
    return x_proj, dt_proj


def _scan_heads(scan, heads: int, xs, dt, A, B, C, D, state):
    """``scan`` (``run_causal``'s call) per head: channels ``[b, t, inner]`` in ``heads``
    equal groups, each with its own ``B, C [b, t, heads, n]`` and its part of ``A``, ``D``
    and the state ``h [b, inner, n]``: ``(y [b, t, inner], the whole new state)``."""
    width = xs.shape[-1] // heads
    ys, hs = [], []
    for j in range(heads):
        part = slice(j * width, (j + 1) * width)
        h = None if state is None else selective.State(state.h[:, part])
        y, h = scan(xs[..., part], dt[..., part], A[part], B[:, :, j], C[:, :, j], D[part], h)
        ys.append(y)
        hs.append(h.h)
    return jnp.concatenate(ys, -1), selective.State(jnp.concatenate(hs, 1))


def _weightless_rms(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, in float32, back in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _dt_bias(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """Mamba's ``dt_proj.bias [inner]`` (an initializer): ``softplus^-1(dt)``, ``dt``
    log-uniform in ``DT_INIT_RANGE`` (at least 1e-4)."""
    lo, hi = (math.log(x) for x in DT_INIT_RANGE)
    dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, jnp.float32, lo, hi)), 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
