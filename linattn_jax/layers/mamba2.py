"""Mamba-2's mixer (Dao and Gu 2024), as ``transformers``' ``Mamba2Mixer`` computes it::

    z, xBC, dt = split(in_proj(u))                     # inner, inner + 2 g n, h
    xBC        = SiLU(conv(xBC) + conv_bias)           # causal, depthwise, kernel conv_size
    x, B, C    = split(xBC)                            # h heads of p; g groups of n; g of n
    dt         = clip(softplus(dt + dt_bias), *time_step_limit)
    y          = ssd(x, dt, -exp(A_log), B, C, D=D)    # linattn_jax.ops.ssd
    out        = out_proj(RMSNorm_g(y * SiLU(z)) * w)  # RMSNorm over each of g groups

with ``inner = h p`` (``expand * width`` by default). Decoding carries the SSD state
``[b, h, n, p]`` and the convolution's last ``conv_size - 1`` inputs, both float32: a
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
from linattn_jax.layers.common import (
    check_can_decode,
    check_decoding,
    check_state,
    check_tokens,
    split_heads,
)
from linattn_jax.layers.conv import CausalConv1D
from linattn_jax.layers.recurrent import run_causal, sequence_sharding
from linattn_jax.ops import checks, ssd

NORMS = ("gate_first", "norm_first", "none")  # Mamba2Mixer's output norms
DT_INIT_RANGE = (1e-3, 1e-1)  # softplus(dt_bias) log-uniform in this range (Mamba-2)


class Mamba2Cache(NamedTuple):
    """A ``Mamba2Mixer``'s decoding state.

    Attributes:
      ssm: the SSD state, ``s [b, h, n, p]`` float32.
      conv: the convolution's last ``conv_size - 1`` inputs, ``[b, conv_size - 1, inner +
        2 g n]`` float32 (x, B and C before the convolution).
    """

    ssm: ssd.State
    conv: jax.Array


def _param(value: jax.Array, *names: str | None) -> nnx.Param:
    """``nnx.Param(value)`` with its dims named ``names`` (``sharding.with_axes``)."""
    return nnx.Param(sharding.with_axes(lambda *_: value, *names)(None, value.shape))


class GroupedGatedRMSNorm(nnx.Module):
    """``RMSNorm(x * SiLU(z))`` over each of ``groups`` equal groups of the last axis, in
    float32, times a weight (from ones): Mamba-2's output norm (``transformers``'
    ``MambaRMSNormGated``, the gate before the norm).

    Args:
      features: the last axis' size (divisible by ``groups``).
      groups: the number of groups normalised on their own.
      epsilon: added to each group's mean square.
      gate_first: ``RMSNorm(x * SiLU(z))`` (Mamba-2's); False: ``RMSNorm(x) * SiLU(z)``
        (Falcon-H1's ``mamba_norm_before_gate``).
      rngs: unused (the weight starts at ones), as in Flax.
      param_dtype: the weight's dtype.
    """

    def __init__(
        self, features: int, groups: int, *, epsilon: float = 1e-6, gate_first: bool = True,
        rngs: nnx.Rngs, param_dtype: Any = jnp.float32,
    ):  # fmt: skip
        del rngs
        checks.check_bool("gate_first", gate_first)
        self.gate_first = gate_first
        if features % groups:
            raise ValueError(f"groups={groups} must divide the features, got {features}")
        self.weight = _param(jnp.ones((features,), param_dtype), sharding.HEADS)
        self.groups, self.epsilon = groups, epsilon

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        """``x [..., features]`` gated by ``z [..., features]``, float32."""
        gate = jax.nn.silu(z.astype(jnp.float32))
        y = x.astype(jnp.float32) * gate if self.gate_first else x.astype(jnp.float32)
        grouped = y.reshape(*y.shape[:-1], self.groups, y.shape[-1] // self.groups)
        grouped = grouped * jax.lax.rsqrt(
            jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.epsilon
        )
        weight = self.weight[...].astype(jnp.float32)
        out = weight.reshape((1,) * (y.ndim - 1) + weight.shape) * grouped.reshape(y.shape)
        return out if self.gate_first else out * gate


class Mamba2Mixer(nnx.Module):
    """Mamba-2's mixer: ``[b, t, width] -> [b, t, width]`` (the module's docstring).

    Parameters (``transformers``' names): ``in_proj``, ``conv.kernel`` ``[conv_size,
    inner + 2 g n]`` with ``conv_bias``, ``dt_bias`` ``[h]``, ``A_log`` ``[h]``, ``D``
    ``[h]``, ``norm.weight`` ``[inner]`` and ``out_proj``; every one names its dims for
    ``linattn_jax.sharding``.

    Args:
      width: model width (input and output features).
      num_heads: SSD heads h.
      head_dim: p, each head's channels (default ``expand * width / h``).
      expand: ``inner / width`` when ``head_dim`` is None (Mamba-2's ``expand``, 2).
      state_dim: n, the SSD state's size per head and channel (Mamba-2's ``state_size``).
      n_groups: g, the groups of B and C (dividing h), and of the output norm.
      conv_size: the causal depthwise convolution's kernel (Mamba-2's ``conv_kernel``).
      use_conv_bias: the convolution's bias.
      use_bias: biases on ``in_proj`` and ``out_proj``.
      time_step_limit: ``(low, high)`` that ``dt`` is clipped to (default no limit).
      norm_eps: the output norm's epsilon (Mamba-2's ``layer_norm_epsilon``).
      norm: the output norm: ``"gate_first"`` (``RMSNorm_g(y * SiLU(z))``, Mamba-2's),
        ``"norm_first"`` (``RMSNorm_g(y) * SiLU(z)``) or ``"none"`` (``y * SiLU(z)``, no
        weight; Falcon-H1 without ``mamba_rms_norm``).
      projection_multipliers: ``(z, x, B, C, dt)``: each part of ``in_proj``'s output times
        its factor (Falcon-H1's ``ssm_multipliers``); None: none.
      causal: True for decoders; with False the layer still reads left to right, and
        refuses decoding.
      method: the SSD's full-sequence form (``ops.ssd.METHODS``).
      chunk_size: tokens per chunk; None (default): the family's default
        (``linattn_jax.ops.checks.default_chunk_size``).
      sequence_axis: a mesh axis that splits full-sequence forwards along their length
        (``ops.ssd.sequence_parallel``; no ``key_mask`` or ``segment_ids`` then).
      batch_axis: the mesh axis that splits the batch alongside ``sequence_axis``.
      mesh: the mesh of those axes; the current one when None.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's); states stay float32.
      param_dtype: the parameters' dtype.

    Raises:
      ValueError: a size that is not a positive int, groups not dividing the heads, a
        head dimension that does not come out whole, a bad method or time-step limit.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        expand: int = 2,
        state_dim: int = 128,
        n_groups: int = 1,
        conv_size: int = 4,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        time_step_limit: tuple[float, float] = (0.0, math.inf),
        norm_eps: float = 1e-5,
        norm: str = "gate_first",
        projection_multipliers: tuple[float, ...] | None = None,
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
        head_dim, projection_multipliers = _check_options(
            width, num_heads, head_dim, expand, state_dim, n_groups, conv_size, method,
            chunk_size, time_step_limit, use_conv_bias, use_bias, causal, norm,
            projection_multipliers,
        )  # fmt: skip
        self.projection_multipliers = projection_multipliers
        self.sharding = nnx.data(sequence_sharding(sequence_axis, batch_axis, mesh, causal))
        low, high = time_step_limit
        h, p, g, n = num_heads, head_dim, n_groups, state_dim
        inner = h * p
        self.width, self.num_heads, self.head_dim = width, h, p
        self.n_groups, self.state_dim, self.inner = g, n, inner
        self.time_step_limit = (float(low), float(high))
        self.causal, self.method, self.chunk_size = causal, method, chunk_size
        options = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        zeros = nnx.initializers.zeros_init()
        conv_dim = inner + 2 * g * n
        self.in_proj = nnx.Linear(
            width, 2 * inner + 2 * g * n + h, use_bias=use_bias,
            kernel_init=sharding.kernel(sharding.EMBED, sharding.HEADS),
            bias_init=sharding.with_axes(zeros, sharding.HEADS), **options,
        )  # fmt: skip
        self.conv = CausalConv1D(conv_dim, conv_size, rngs=rngs, param_dtype=param_dtype)
        self.conv.kernel = _param(self.conv.kernel[...], None, sharding.HEADS)
        self.conv_bias = nnx.data(
            _param(jnp.zeros((conv_dim,), param_dtype), sharding.HEADS) if use_conv_bias else None
        )
        self.dt_bias = _param(_dt_bias(rngs.params(), h).astype(param_dtype), sharding.HEADS)
        a_log = jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32))  # A = 1 ... h (Mamba-2)
        self.A_log = _param(a_log.astype(param_dtype), sharding.HEADS)
        self.D = _param(jnp.ones((h,), param_dtype), sharding.HEADS)
        self.norm = nnx.data(
            None
            if norm == "none"
            else GroupedGatedRMSNorm(
                inner,
                g,
                epsilon=norm_eps,
                gate_first=norm == "gate_first",
                rngs=rngs,
                param_dtype=param_dtype,
            )  # fmt: skip
        )
        self.out_proj = nnx.Linear(
            inner, width, use_bias=use_bias,
            kernel_init=sharding.kernel(sharding.HEADS, sharding.EMBED),
            bias_init=sharding.with_axes(zeros, sharding.EMBED), **options,
        )  # fmt: skip

    def init_state(self, batch: int, max_length: int | None = None) -> Mamba2Cache:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        check_can_decode(self)
        state = ssd.init_state(batch, self.num_heads, self.state_dim, self.head_dim)
        return Mamba2Cache(state, self.conv.init_state(batch))

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: Mamba2Cache | None = None,
        return_state: bool = False,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``).

        Args:
          x: ``[b, t, width]``.
          key_mask: optional bool ``[b, t]``, True for real tokens: padded rows are
            replaced by zeros before anything reads them, reach neither the convolution's
            window nor the state (which they do not decay) and give ``out_proj(0)``.
          segment_ids: optional int ``[b, t]``: the SSD state and the convolution reset
            wherever the id changes.
          state: a ``Mamba2Cache`` (``init_state``): a one-token ``x`` takes the O(1) step,
            a longer one (a prompt) runs the full-sequence form from it.
          return_state: also return the new ``Mamba2Cache``.
        """
        check_tokens(x, self.width)
        check_decoding(self, state, return_state)
        check_state(state, Mamba2Cache)
        b, t, _ = x.shape
        h, g, n, inner = self.num_heads, self.n_groups, self.state_dim, self.inner
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        projected = self.in_proj(checks.where_token(key_mask, x))
        if self.projection_multipliers is not None:
            sizes = (inner, inner, g * n, g * n, h)
            projected = _scale_parts(projected, sizes, self.projection_multipliers)
        z, xbc, dt = jnp.split(projected, [inner, 2 * inner + 2 * g * n], axis=-1)
        # Padding must not reach the next tokens' window (a replacement, not a product).
        xbc, conv_state = self.conv(
            checks.where_token(key_mask, xbc),
            None if state is None else state.conv,
            segment_ids,
            key_mask,
        )
        if self.conv_bias is not None:
            xbc = xbc + self.conv_bias[...].astype(xbc.dtype)[None, None]
        xs, B, C = jnp.split(jax.nn.silu(xbc), [inner, inner + g * n], axis=-1)
        xs, B, C = split_heads(xs, h), split_heads(B, g), split_heads(C, g)
        if xs.dtype == jnp.float16:  # the SSD's output can pass float16's range before the norm
            xs = xs.astype(jnp.float32)
        dt = jax.nn.softplus(
            dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)[None, None]
        )
        dt = jnp.clip(dt, *self.time_step_limit)
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        D = self.D[...].astype(jnp.float32)
        y, ssm = run_causal(
            ssd, xs, dt, A, B, C, state=None if state is None else state.ssm,
            key_mask=key_mask, segment_ids=segment_ids, method=self.method,
            chunk_size=self.chunk_size, sharding=self.sharding, options=dict(D=D),
        )  # fmt: skip
        y = y.reshape(b, t, inner)
        if self.norm is None:
            y = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        else:
            y = self.norm(y, z)
        out = self.out_proj(y.astype(projected.dtype))
        return (out, Mamba2Cache(ssm, conv_state)) if return_state else out


def _check_options(
    width, num_heads, head_dim, expand, state_dim, n_groups, conv_size, method, chunk_size,
    time_step_limit, use_conv_bias, use_bias, causal, norm, projection_multipliers,
) -> tuple[int, tuple[float, ...] | None]:  # fmt: skip
    """``(head_dim, projection_multipliers)`` of ``Mamba2Mixer``'s options, checked (the
    head dimension from ``expand`` when None, the multipliers as floats)."""
    checks.check_sizes(width=width, num_heads=num_heads, state_dim=state_dim)
    checks.check_sizes(n_groups=n_groups, conv_size=conv_size)
    if head_dim is None:
        checks.check_int("expand", expand, 1)
        if (expand * width) % num_heads:
            raise ValueError(
                f"num_heads={num_heads} must divide expand * width={expand * width} "
                f"(or give head_dim)"
            )
        head_dim = expand * width // num_heads
    checks.check_int("head_dim", head_dim, 1)
    if num_heads % n_groups:
        raise ValueError(f"n_groups must divide num_heads={num_heads}, got {n_groups}")
    if method not in ssd.METHODS:
        raise ValueError(f"method must be one of {ssd.METHODS}, got {method!r}")
    checks.check_chunk_size(chunk_size)
    low, high = time_step_limit
    if not 0 <= low <= high:
        raise ValueError(
            f"time_step_limit must be (low, high), 0 <= low <= high, got {time_step_limit}"
        )
    for name, flag in [
        ("use_conv_bias", use_conv_bias),
        ("use_bias", use_bias),
        ("causal", causal),
    ]:
        checks.check_bool(name, flag)
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if projection_multipliers is not None:
        values = tuple(projection_multipliers)
        finite = all(isinstance(v, int | float) and math.isfinite(v) for v in values)
        if len(values) != 5 or not finite:
            raise ValueError(
                "projection_multipliers must be None or 5 finite numbers (z, x, B, C, dt), "
                f"got {projection_multipliers!r}"
            )
        projection_multipliers = tuple(float(v) for v in values)
    return head_dim, projection_multipliers


def _dt_bias(key: jax.Array, heads: int) -> jax.Array:
    """Mamba-2's ``dt_bias [h]``, float32: ``softplus^-1(dt)``, ``dt`` log-uniform in
    ``DT_INIT_RANGE`` (at least 1e-4)."""
    lo, hi = (math.log(x) for x in DT_INIT_RANGE)
    dt = jnp.exp(jax.random.uniform(key, (heads,), jnp.float32, lo, hi))
    dt = jnp.maximum(dt, 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))


def _scale_parts(projected: jax.Array, sizes, multipliers) -> jax.Array:
    """``projected [b, t, sum(sizes)]`` with each consecutive part of ``sizes`` times its
    multiplier (Falcon-H1's ``ssm_multipliers``)."""
    factors = [jnp.full((k,), m, projected.dtype) for k, m in zip(sizes, multipliers, strict=True)]
    return projected * jnp.concatenate(factors)[None, None]
