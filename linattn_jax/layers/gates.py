"""The learned gates: data-dependent log-decays ``g <= 0`` for the recurrent layers.

* ``HeadGate``: ``log_sigmoid(W x + b)`` per head, biased towards slow decay (the
  additive layer's ``gate=True``).
* ``ChannelGate``: GLA's ``log_sigmoid(W2 W1 x + b) / 16`` per feature channel, through
  a low rank (Yang et al. 2024).
* ``MambaGate``: Mamba2's ``-exp(A_log) softplus(W_a x + dt_bias)``, per head (Gated
  DeltaNet) or per key channel through a low rank or one matrix (KDA); or, with a
  ``lower_bound``, the bounded ``lower_bound * sigmoid(exp(A_log) (W_a x + dt_bias))``
  (Ling's KDA, ``transformers``' ``kda_safe_gate``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers.common import split_heads

GLA_GATE_RANK = 16  # GLA's low-rank gate: width -> 16 -> h * f
GLA_GATE_NORMALIZER = 16.0  # log_sigmoid(.) / 16: slow decays at initialisation
A_INIT_RANGE = (1.0, 16.0)  # A = exp(A_log) ~ U(1, 16) (FLA)
DT_INIT_RANGE = (1e-3, 1e-1)  # softplus(dt_bias) log-uniform in this range (Mamba2)


class HeadGate(nnx.Module):
    """``log_sigmoid(W x + b)``, ``[b, t, width] -> [b, t, heads]`` float32 (bias 3)."""

    def __init__(
        self, width: int, heads: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32
    ):
        self.proj = nnx.Linear(
            width,
            heads,
            bias_init=nnx.initializers.constant(3.0),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.log_sigmoid(self.proj(x).astype(jnp.float32))


class ChannelGate(nnx.Module):
    """GLA's gate, ``[b, t, width] -> [b, t, heads, channels]`` float32:
    ``log_sigmoid(W2 W1 x + b) / 16`` through rank ``GLA_GATE_RANK``."""

    def __init__(
        self,
        width: int,
        heads: int,
        channels: int,
        *,
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=jnp.float32,
    ):
        linear = lambda n_in, n_out, **kw: nnx.Linear(
            n_in, n_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **kw
        )
        self.proj = nnx.Sequential(
            linear(width, GLA_GATE_RANK, use_bias=False), linear(GLA_GATE_RANK, heads * channels)
        )
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = self.proj(x).astype(jnp.float32)
        return jax.nn.log_sigmoid(split_heads(logits, self.heads)) / GLA_GATE_NORMALIZER


class MambaGate(nnx.Module):
    """``-exp(A_log) softplus(W_a x + dt_bias)``: ``[b, t, heads]`` or, with ``channels``,
    ``[b, t, heads, channels]`` (``W_a`` then of rank ``rank``, or one matrix for None),
    float32. With ``lower_bound`` (< 0), ``lower_bound * sigmoid(exp(A_log) (W_a x +
    dt_bias))`` instead: a log-decay in ``(lower_bound, 0)``.

    ``A = exp(A_log)`` is drawn from ``A_INIT_RANGE`` per head, ``softplus(dt_bias)``
    log-uniformly from ``DT_INIT_RANGE`` per output (Mamba2, FLA).
    """

    def __init__(
        self,
        width: int,
        heads: int,
        channels: int | None = None,
        rank: int | None = None,
        *,
        lower_bound: float | None = None,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        linear = lambda n_in, n_out: nnx.Linear(
            n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        if channels is None:
            self.proj = linear(width, heads)
        elif rank is None:
            self.proj = linear(width, heads * channels)
        else:
            self.proj = nnx.Sequential(linear(width, rank), linear(rank, heads * channels))
        outputs = heads * (channels or 1)
        a_log, dt_bias = _init_decays(rngs.params(), heads, outputs, param_dtype)
        self.A_log, self.dt_bias = nnx.Param(a_log), nnx.Param(dt_bias)
        self.heads, self.channels, self.lower_bound = heads, channels, lower_bound

    def __call__(self, x: jax.Array) -> jax.Array:
        a = self.proj(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)[None, None]
        decay_rate = jnp.exp(self.A_log[...].astype(jnp.float32))[None, None]  # [1, 1, h]
        if self.channels is not None:
            a = split_heads(a, self.heads)  # [b, t, h, dk]
            decay_rate = decay_rate[..., None]
        if self.lower_bound is not None:
            return self.lower_bound * jax.nn.sigmoid(decay_rate * a)
        return -decay_rate * jax.nn.softplus(a)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))  # one program, not a dozen, eagerly
def _init_decays(key, heads: int, outputs: int, dtype) -> tuple[jax.Array, jax.Array]:
    """``(A_log [heads], dt_bias [outputs])``: ``A`` from ``A_INIT_RANGE``, ``softplus(dt_bias)``
    log-uniform in ``DT_INIT_RANGE``."""
    key_a, key_dt = jax.random.split(key)
    a = jax.random.uniform(key_a, (heads,), jnp.float32, *A_INIT_RANGE)
    lo, hi = (math.log(x) for x in DT_INIT_RANGE)
    dt = jnp.exp(jax.random.uniform(key_dt, (outputs,), jnp.float32, lo, hi))
    dt = jnp.maximum(dt, 1e-4)
    inverse_softplus = dt + jnp.log(-jnp.expm1(-dt))
    return jnp.log(a).astype(dtype), inverse_softplus.astype(dtype)
