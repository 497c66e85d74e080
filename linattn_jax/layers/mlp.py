"""The MLPs of a block (GELU, SwiGLU, squared ReLU), the list of MLP kinds a block takes,
and the check of a model multiplier; ``blocks`` and ``moe`` (whose shared expert is a
``SwiGLU``) both build on this module."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding

MLPS = ("gelu", "swiglu", "geglu", "relu2", "moe", "none")
MLPS += ("rwkv",)  # RWKV-4's channel mix (layers.rwkv.RWKVChannelMix), with a token shift


def mlp_layout(mlp: str | Sequence[str], depth: int) -> tuple[str, ...]:
    """The MLP kind of each of ``depth`` layers: ``mlp`` one of ``MLPS`` for every layer,
    or a list of ``depth`` of them (DeepSeek's and Kimi's first dense layers:
    ``["swiglu"] + ["moe"] * (depth - 1)``).

    Raises:
      ValueError: an unknown kind, or a list not of ``depth`` kinds.
    """
    kinds = (mlp,) * depth if isinstance(mlp, str) else tuple(mlp)
    if len(kinds) != depth:
        raise ValueError(f"mlp must list depth={depth} kinds, got {len(kinds)}: {kinds}")
    for kind in kinds:
        if kind not in MLPS:
            raise ValueError(f"mlp must be one of {MLPS}, got {kind!r}")
    return kinds


def check_multiplier(name: str, value: Any) -> None:
    """Raises ``ValueError`` unless ``value`` is a finite number > 0 (a model multiplier)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and 0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class MLP(nnx.Module):
    """``Linear -> gelu -> Linear`` with hidden width ``hidden`` (with biases)."""

    def __init__(
        self, width: int, hidden: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32
    ):
        options = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        embed, mlp = sharding.EMBED, sharding.MLP
        zeros = nnx.initializers.zeros_init()
        self.up = nnx.Linear(
            width, hidden, kernel_init=sharding.kernel(embed, mlp),
            bias_init=sharding.with_axes(zeros, mlp), **options,
        )  # fmt: skip
        self.down = nnx.Linear(
            hidden, width, kernel_init=sharding.kernel(mlp, embed),
            bias_init=sharding.with_axes(zeros, embed), **options,
        )  # fmt: skip

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class SwiGLU(nnx.Module):
    """``down(SiLU(gate(x)) * up(x))`` with hidden width ``hidden``, no biases (Shazeer 2020;
    Llama's and Qwen's MLP: ``gate_proj``, ``up_proj``, ``down_proj``).

    ``multipliers=(m_gate, m_down)`` makes it ``m_down down(SiLU(m_gate gate(x)) * up(x))``
    (Falcon-H1's ``mlp_multipliers``); (1, 1): none. ``use_bias``: the three projections
    with biases (RecurrentGemma's MLP).
    """

    def __init__(
        self, width: int, hidden: int, *, multipliers: Sequence[float] = (1.0, 1.0),
        use_bias: bool = False, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32,
    ):  # fmt: skip
        try:
            m_gate, m_down = multipliers
        except (TypeError, ValueError):
            raise ValueError(f"multipliers must be (gate, down), got {multipliers!r}") from None
        check_multiplier("multipliers[0]", m_gate)
        check_multiplier("multipliers[1]", m_down)
        self.multipliers = (float(m_gate), float(m_down))
        zeros = nnx.initializers.zeros_init()
        linear = lambda n_in, n_out, *axes: nnx.Linear(
            n_in, n_out, use_bias=use_bias, kernel_init=sharding.kernel(*axes),
            bias_init=sharding.with_axes(zeros, axes[1]), dtype=dtype, param_dtype=param_dtype,
            rngs=rngs,
        )  # fmt: skip
        embed, mlp = sharding.EMBED, sharding.MLP
        self.gate_proj = linear(width, hidden, embed, mlp)
        self.up_proj = linear(width, hidden, embed, mlp)
        self.down_proj = linear(hidden, width, mlp, embed)

    def activation(self, gate: jax.Array) -> jax.Array:
        return jax.nn.silu(gate)

    def __call__(self, x: jax.Array) -> jax.Array:
        m_gate, m_down = self.multipliers
        gate = self.gate_proj(x)
        out = self.down_proj(
            self.activation(gate if m_gate == 1.0 else gate * m_gate) * self.up_proj(x)
        )
        return out if m_down == 1.0 else out * m_down


class GeGLU(SwiGLU):
    """``down(GELU(gate(x)) * up(x))``, GELU in its tanh form (Gemma's MLP,
    ``gelu_pytorch_tanh``); otherwise ``SwiGLU``, its projections' names too."""

    def activation(self, gate: jax.Array) -> jax.Array:
        return jax.nn.gelu(gate, approximate=True)


class ReLU2MLP(nnx.Module):
    """``down(relu(up(x))^2)`` with hidden width ``hidden``, no biases (So et al. 2021's
    squared ReLU; Nemotron-H's MLP: ``up_proj``, ``down_proj``)."""

    def __init__(
        self, width: int, hidden: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32
    ):
        linear = lambda n_in, n_out, *axes: nnx.Linear(
            n_in, n_out, use_bias=False, kernel_init=sharding.kernel(*axes), dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.up_proj = linear(width, hidden, sharding.EMBED, sharding.MLP)
        self.down_proj = linear(hidden, width, sharding.MLP, sharding.EMBED)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jnp.square(jax.nn.relu(self.up_proj(x))))


MLP_CLASSES = {"gelu": MLP, "swiglu": SwiGLU, "geglu": GeGLU, "relu2": ReLU2MLP}
