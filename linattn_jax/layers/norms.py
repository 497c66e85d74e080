"""The RMSNorms of the blocks and layers: Flax's, its zero-centred form (Qwen3-Next and
Qwen3.5: ``x * (1 + w)`` with ``w`` from zeros, so weight decay pulls the gain towards 1,
not 0) and the gated RMSNorm of the delta-rule layers' output (``norm(o) * SiLU(gate)``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

GATE_ACTIVATIONS = ("silu", "sigmoid")  # GatedRMSNorm's


class RMSNorm(nnx.RMSNorm):
    """``nnx.RMSNorm`` over the last axis, or its zero-centred form.

    ``zero_centred=False``: ``nnx.RMSNorm`` itself (``x / rms(x) * w``, ``w`` from ones).
    ``zero_centred=True``: ``x / rms(x) * (1 + w)`` with ``w`` from zeros, computed in
    float32 and returned in ``dtype`` (the input's when None), as Qwen3-Next's RMSNorm.
    The parameter is ``scale`` either way, and the two initialise to the same function.
    With ``group_size``, each run of ``group_size`` features of the last axis is normalised
    alone (computed in float32 as the zero-centred form; hyper-connections' streams).

    Args:
      num_features: the last axis' size (``scale``'s).
      zero_centred: the ``1 + w`` form.
      group_size: None (the whole axis), or the size, dividing ``num_features``, of the
        groups normalised alone.
      epsilon: added to the mean square.
      dtype, param_dtype, rngs: as in ``nnx.RMSNorm``.
    """

    def __init__(
        self,
        num_features: int,
        *,
        zero_centred: bool = False,
        group_size: int | None = None,
        epsilon: float = 1e-6,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not isinstance(zero_centred, bool):
            raise ValueError(f"zero_centred must be True or False, got {zero_centred!r}")
        if group_size is not None and (
            not isinstance(group_size, int) or group_size < 1 or num_features % group_size
        ):
            raise ValueError(
                f"group_size must be None or an int >= 1 dividing num_features={num_features}, "
                f"got {group_size!r}"
            )
        init = nnx.initializers.zeros if zero_centred else nnx.initializers.ones
        super().__init__(
            num_features,
            epsilon=epsilon,
            dtype=dtype,
            param_dtype=param_dtype,
            scale_init=init,
            rngs=rngs,
        )
        self.zero_centred, self.group_size = zero_centred, group_size

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """``x [..., num_features]`` normalised (``mask`` as in ``nnx.RMSNorm``, which alone
        takes it)."""
        if not self.zero_centred and self.group_size is None:
            return super().__call__(x, mask)
        if mask is not None:
            raise ValueError("a zero-centred or grouped RMSNorm takes no mask")
        return _rms_norm(
            x, self.scale[...], epsilon=self.epsilon, group_size=self.group_size,
            zero_centred=self.zero_centred, dtype=jnp.dtype(self.dtype or x.dtype),
        )  # fmt: skip


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * act(gate)``: the output norm of Gated DeltaNet and KDA (FLA's
    ``FusedRMSNormGated``, Qwen3-Next's ``RMSNormGated``: ``act`` SiLU; Kimi Linear's:
    sigmoid), per head.

    Args: as ``RMSNorm``, and ``activation``: ``"silu"`` (default) or ``"sigmoid"``.
    """

    def __init__(self, num_features: int, *, activation: str = "silu", **options: Any):
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
        super().__init__(num_features, **options)
        self.activation = activation

    def __call__(self, x: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """``x [..., d]`` normalised, times ``act(gate [..., d])`` in the gate's dtype when
        a gate is given (the plain ``RMSNorm`` when None)."""
        y = super().__call__(x)
        return y if gate is None else _gated(y, gate, activation=self.activation)


# The norms' arithmetic as jitted functions: one program each when called eagerly,
# inlined into a caller's jitted program.
@functools.partial(jax.jit, static_argnames=("epsilon", "group_size", "zero_centred", "dtype"))
def _rms_norm(x, scale, *, epsilon, group_size, zero_centred, dtype):
    y = x.astype(jnp.float32)
    groups = y.reshape(*y.shape[:-1], -1, group_size or y.shape[-1])
    groups = groups * jax.lax.rsqrt(jnp.mean(groups**2, axis=-1, keepdims=True) + epsilon)
    y = groups.reshape(y.shape)
    scale = scale.astype(jnp.float32) + (1.0 if zero_centred else 0.0)
    y = y * scale.reshape((1,) * (y.ndim - 1) + scale.shape)
    return y.astype(dtype)


@functools.partial(jax.jit, static_argnames=("activation",))
def _gated(y, gate, *, activation):
    act = jax.nn.silu if activation == "silu" else jax.nn.sigmoid
    return y.astype(gate.dtype) * act(gate)
