"""The blocks models stack: a pre-norm transformer block and its MLPs (GELU, SwiGLU, squared
ReLU, or none), with or without a mixer (the hybrids' mixer-only and MLP-only layers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers import registry
from linattn_jax.layers.conv import CausalConv1D
from linattn_jax.layers.moe import MoE
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.ops import checks

MLPS = ("gelu", "swiglu", "relu2", "moe", "none")


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
    Llama's and Qwen's MLP: ``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(
        self, width: int, hidden: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32
    ):
        linear = lambda n_in, n_out, *axes: nnx.Linear(
            n_in, n_out, use_bias=False, kernel_init=sharding.kernel(*axes), dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        embed, mlp = sharding.EMBED, sharding.MLP
        self.gate_proj = linear(width, hidden, embed, mlp)
        self.up_proj = linear(width, hidden, embed, mlp)
        self.down_proj = linear(hidden, width, mlp, embed)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


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


def _residual_factors(name: str, factors) -> tuple[float, float]:
    """``(alpha, beta)`` as two floats, or a ValueError naming ``name``."""
    if not isinstance(factors, tuple | list) or len(factors) != 2:
        raise ValueError(f"{name} must be two numbers (alpha, beta), got {factors!r}")
    for factor in factors:
        checks.check_number(name, factor)
    return float(factors[0]), float(factors[1])


def _add(residual, h, factors: tuple[float, float]):
    """``alpha * residual + beta * h`` (``residual + h`` for the usual ``(1, 1)``)."""
    if factors == (1.0, 1.0):
        return residual + h
    alpha, beta = factors
    return residual * jnp.asarray(alpha, residual.dtype) + h * jnp.asarray(beta, h.dtype)


_MLP_CLASSES = {"gelu": MLP, "swiglu": SwiGLU, "relu2": ReLU2MLP}


class BlockState(NamedTuple):
    """A ``TransformerBlock``'s decoding state: its attention's and its convolution's."""

    attention: Any
    conv: jax.Array | None


class TransformerBlock(nnx.Module):
    """Pre-norm block: ``x + attn(conv(norm(x)))``, then ``x + mlp(norm(x))``; either half
    may be absent (``attention="mlp"``: the MLP alone; ``mlp="none"``: the mixer alone, as
    Mamba-2's blocks and the hybrids' Mamba and attention layers).

    Args:
      width: model width (input and output features).
      num_heads: heads of the attention layer; must divide ``width``.
      attention: one of ``registry.ATTENTION_KINDS`` (``registry.make_attention``):
        ``"linear"``, ``"softmax"``, ``"gla"``, ``"deltanet"``, ``"gated_deltanet"``,
        ``"kda"``, ``"mamba2"``, or ``"mlp"`` (no mixer: the block is its MLP alone).
      mlp_ratio: the MLP's hidden width over ``width``.
      mlp: ``"gelu"`` (default: ``MLP``), ``"swiglu"`` (``SwiGLU``), ``"relu2"``
        (``ReLU2MLP``), ``"moe"`` (a mixture of SwiGLU experts, ``layers.moe.MoE``, of the
        ``moe`` options) or ``"none"`` (no MLP and no second norm).
      mlp_hidden: the MLP's hidden width (overrides ``mlp_ratio``; Qwen's
        ``intermediate_size``); a MoE's experts' unless ``moe`` gives ``hidden``.
      moe: ``MoE``'s options (``num_experts``, ``top_k``, ``hidden``, ``score``, ...) when
        ``mlp="moe"``; unread otherwise.
      zero_centred_norm: the block's two RMSNorms in the ``x * (1 + w)`` form
        (``layers.norms.RMSNorm``; Qwen3-Next, Qwen3.5).
      short_conv: kernel size of a causal depthwise convolution before attention
        (``CausalConv1D``, which does not reach across ``segment_ids``; 0: none);
        causal blocks only.
      normed_residual: each half's residual is its normed input, ``norm(x) + f(norm(x))``,
        not ``x + f(norm(x))`` (MiniMax-01's blocks).
      attention_residual: ``(alpha, beta)``: the attention half is ``alpha * residual +
        beta * attn(...)`` (MiniMax-01's ``*_attn_alpha_factor``, ``*_attn_beta_factor``).
      mlp_residual: ``(alpha, beta)`` of the MLP half likewise (``mlp_alpha_factor``, ...).
      post_norm: the norms after each half instead of before, ``x + norm(f(x))`` (OLMo 2's
        and OLMo-Hybrid's attention blocks; ``attention_norm`` and ``mlp_norm`` are then
        ``post_attention_layernorm`` and ``post_feedforward_layernorm``).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
      **attention_kwargs: passed to the attention layer (``feature_map``, ``causal``, ...).
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        attention: str = "linear",
        mlp_ratio: int = 4,
        mlp: str = "gelu",
        mlp_hidden: int | None = None,
        moe: Mapping[str, Any] | None = None,
        zero_centred_norm: bool = False,
        short_conv: int = 0,
        normed_residual: bool = False,
        attention_residual: tuple[float, float] = (1.0, 1.0),
        mlp_residual: tuple[float, float] = (1.0, 1.0),
        post_norm: bool = False,
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=jnp.float32,
        **attention_kwargs,
    ):
        checks.check_sizes(width=width, num_heads=num_heads)  # the layer checks the rest
        checks.check_int("mlp_ratio", mlp_ratio, 1)
        if mlp not in MLPS:
            raise ValueError(f"mlp must be one of {MLPS}, got {mlp!r}")
        hidden = mlp_ratio * width if mlp_hidden is None else mlp_hidden
        checks.check_int("mlp_hidden", hidden, 1)
        checks.check_int("short_conv", short_conv, 0)
        checks.check_bool("normed_residual", normed_residual)
        checks.check_bool("post_norm", post_norm)
        if post_norm and (normed_residual or short_conv):
            raise ValueError("post_norm takes no normed_residual or short_conv")
        self.normed_residual, self.post_norm = normed_residual, post_norm
        self.attention_residual = _residual_factors("attention_residual", attention_residual)
        self.mlp_residual = _residual_factors("mlp_residual", mlp_residual)
        mixer = registry.get(attention).layer is not None
        if not mixer and mlp == "none":
            raise ValueError('a block needs a mixer or an MLP: attention="mlp" with mlp="none"')
        if short_conv and not mixer:
            raise ValueError(f"short_conv needs a mixer, got attention={attention!r}")
        if short_conv and not attention_kwargs.get("causal", True):
            raise ValueError("short_conv is causal: use it in causal blocks only")
        norm = lambda: RMSNorm(
            width, zero_centred=zero_centred_norm, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.attention_norm = nnx.data(norm() if mixer else None)
        self.mlp_norm = nnx.data(norm() if mlp != "none" else None)
        self.conv = nnx.data(
            CausalConv1D(width, short_conv, rngs=rngs, param_dtype=param_dtype)
            if short_conv
            else None
        )
        if mixer:
            attention_kwargs = dict(
                rngs=rngs, dtype=dtype, param_dtype=param_dtype, **attention_kwargs
            )
            self.attention = registry.make_attention(
                attention, width, num_heads, **attention_kwargs
            )
        else:
            self.attention = nnx.data(None)
        options = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if mlp == "moe":
            if not isinstance(moe, Mapping):
                raise ValueError(f"mlp='moe' needs moe= a dict of MoE's options, got {moe!r}")
            self.mlp = MoE(width, **{"hidden": hidden, **moe}, **options)
        else:
            self.mlp = nnx.data(
                _MLP_CLASSES[mlp](width, hidden, **options) if mlp != "none" else None
            )
        self.width = width

    def init_state(self, batch: int, max_length: int | None = None) -> BlockState:
        conv = None if self.conv is None else self.conv.init_state(batch)
        if self.attention is None:
            return BlockState(None, conv)
        return BlockState(self.attention.init_state(batch, max_length), conv)

    def __call__(self, x, *, key_mask=None, segment_ids=None, state=None, return_state=False):
        if self.attention is None:  # an MLP-only layer
            x = self._mlp_half(x, key_mask, state is None and not return_state)
            return (x, BlockState(None, None)) if return_state else x
        h = x if self.post_norm else self.attention_norm(x)
        residual = h if self.normed_residual else x
        conv_state = None
        if self.conv is not None:
            # Padding must not reach the next tokens' window (a replacement, not a product).
            h = checks.where_token(key_mask, h)
            past = None if state is None else state.conv
            h, conv_state = self.conv(h, past, segment_ids, key_mask)
        h = self.attention(
            h,
            key_mask=key_mask,
            segment_ids=segment_ids,
            state=None if state is None else state.attention,
            return_state=return_state,
        )
        if return_state:
            h, attention_state = h
            state = BlockState(attention_state, conv_state)
        if self.post_norm:
            h = self.attention_norm(h)
        x = _add(residual, h, self.attention_residual)
        if self.mlp is not None:
            x = self._mlp_half(x, key_mask, state is None and not return_state)
        return (x, state) if return_state else x

    def _mlp_half(self, x, key_mask, recording: bool):
        if self.post_norm:
            return _add(x, self.mlp_norm(self._mlp(x, key_mask, recording)), self.mlp_residual)
        h = self.mlp_norm(x)
        residual = h if self.normed_residual else x
        return _add(residual, self._mlp(h, key_mask, recording), self.mlp_residual)

    def _mlp(self, h, key_mask, recording: bool):
        if isinstance(self.mlp, MoE):
            # Losses are recorded by full-sequence passes (training), not by decoding.
            return self.mlp(h, key_mask=key_mask, record=recording)
        return self.mlp(h)
