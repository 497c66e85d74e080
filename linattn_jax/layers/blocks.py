"""The blocks models stack: a pre-norm transformer block, its mixer and its MLP (``mlp``'s
GELU, SwiGLU or squared ReLU, ``moe``'s mixture, or none), with or without a mixer (the
hybrids' mixer-only and MLP-only layers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers import registry
from linattn_jax.layers.common import check_state
from linattn_jax.layers.conv import CausalConv1D
from linattn_jax.layers.hyper import HyperConnection, check_options
from linattn_jax.layers.mlp import MLP_CLASSES, MLPS, check_multiplier
from linattn_jax.layers.moe import MoE
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.layers.rwkv import RWKVChannelMix
from linattn_jax.ops import checks


class BlockState(NamedTuple):
    """A ``TransformerBlock``'s decoding state: its attention's, its convolution's, (a
    parallel block's) its second mixer's and (RWKV's channel mix) its MLP's."""

    attention: Any
    conv: jax.Array | None
    parallel: Any = None
    mlp: Any = None


NORMS = ("rms", "layer")


def make_norm(
    norm: str, width: int, zero_centred: bool, rngs, dtype, param_dtype, hyper=None, inject=True
) -> nnx.Module:
    """A block's (and a model's) norm: ``"rms"`` (``RMSNorm``) or ``"layer"``
    (``nnx.LayerNorm`` with a bias, RWKV's; its epsilon 1e-5, as torch's); with ``hyper``
    (``hyper_connections``' dict) a ``HyperConnection`` (``inject``: with its write-back)."""
    if hyper is not None:
        streams, rank = check_options(hyper)
        return HyperConnection(
            width, streams, rank, inject=inject, zero_centred=zero_centred, rngs=rngs,
            dtype=dtype, param_dtype=param_dtype,
        )  # fmt: skip
    if norm == "layer":
        return nnx.LayerNorm(width, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    return RMSNorm(
        width, zero_centred=zero_centred, dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )


def _branch_multipliers(value) -> tuple[tuple[float, float], tuple[float, float]]:
    """``((in, out), (in, out))`` as floats, each checked by ``check_multiplier``."""
    try:
        (in_1, out_1), (in_2, out_2) = value
    except (TypeError, ValueError):
        raise ValueError(
            f"branch_multipliers must be ((in, out), (in, out)), got {value!r}"
        ) from None
    names = ("branch_multipliers[0][0]", "branch_multipliers[0][1]")
    names += ("branch_multipliers[1][0]", "branch_multipliers[1][1]")
    for name, v in zip(names, (in_1, out_1, in_2, out_2), strict=True):
        check_multiplier(name, v)
    return (float(in_1), float(out_1)), (float(in_2), float(out_2))


def _parallel_mixer(parallel, width, num_heads, mixer, short_conv, rngs, dtype, param_dtype):
    """The parallel block's second mixer (``TransformerBlock``'s ``parallel``), or None."""
    if parallel is None:
        return None
    if not isinstance(parallel, Mapping) or "attention" not in parallel:
        raise ValueError(
            f"parallel must be None or a dict with 'attention' (a kind), got {parallel!r}"
        )
    if not mixer or short_conv:
        raise ValueError("parallel needs a block with a mixer and no short_conv")
    options = dict(parallel)
    kind, heads = options.pop("attention"), options.pop("num_heads", None)
    if registry.get(kind).layer is None:
        raise ValueError(f"parallel's attention must be a mixer kind, got {kind!r}")
    options = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, **options)
    return registry.make_attention(kind, width, heads or num_heads, **options)


def _check_block_options(
    width, num_heads, attention, mlp, mlp_ratio, mlp_hidden, short_conv, normed_residual,
    post_norm, sandwich_norm, parallel, residual_multiplier, causal,
) -> tuple[bool, int]:  # fmt: skip
    """``(whether the block has a mixer, the MLP's hidden width)`` of ``TransformerBlock``'s
    options, or a ValueError naming the first bad one (the layers check their own)."""
    checks.check_sizes(width=width, num_heads=num_heads)  # the layer checks the rest
    check_multiplier("residual_multiplier", residual_multiplier)
    checks.check_bool("normed_residual", normed_residual)
    checks.check_bool("post_norm", post_norm)
    if post_norm and (normed_residual or short_conv or parallel is not None):
        raise ValueError("post_norm takes no normed_residual, short_conv or parallel mixer")
    checks.check_bool("sandwich_norm", sandwich_norm)
    if sandwich_norm and post_norm:
        raise ValueError("sandwich_norm has its norms before each half: not with post_norm")
    checks.check_int("mlp_ratio", mlp_ratio, 1)
    if mlp not in MLPS:
        raise ValueError(f"mlp must be one of {MLPS}, got {mlp!r}")
    hidden = mlp_ratio * width if mlp_hidden is None else mlp_hidden
    checks.check_int("mlp_hidden", hidden, 1)
    checks.check_int("short_conv", short_conv, 0)
    mixer = registry.get(attention).layer is not None
    if not mixer and mlp == "none":
        raise ValueError('a block needs a mixer or an MLP: attention="mlp" with mlp="none"')
    if short_conv and not mixer:
        raise ValueError(f"short_conv needs a mixer, got attention={attention!r}")
    if short_conv and not causal:
        raise ValueError("short_conv is causal: use it in causal blocks only")
    return mixer, hidden


def _residual_factors(name: str, factors) -> tuple[float, float]:
    """``(alpha, beta)`` as two floats, or a ValueError naming ``name``."""
    if not isinstance(factors, tuple | list) or len(factors) != 2:
        raise ValueError(f"{name} must be two numbers (alpha, beta), got {factors!r}")
    for factor in factors:
        checks.check_number(name, factor)
    return float(factors[0]), float(factors[1])


def _check_norms(norm, hyper, post_norm, normed_residual, alphas) -> None:
    """Checks ``norm`` and refuses the options ``hyper_connections`` cannot go with
    (``alphas``: the two halves' residual factors)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if hyper is None:
        return
    check_options(hyper)
    if norm != "rms" or post_norm or normed_residual:
        raise ValueError("hyper_connections need norm='rms', no post_norm, no normed_residual")
    if alphas != (1.0, 1.0):
        raise ValueError("hyper_connections take no residual alpha other than 1")


def _add(residual, h, factors: tuple[float, float], norm=None):
    """``alpha * residual + beta * h`` (no product for a factor of 1); a
    ``HyperConnection`` ``norm`` writes ``beta * h`` back into the streams ``residual``."""
    alpha, beta = factors
    if isinstance(norm, HyperConnection):
        return norm.write(residual, h if beta == 1.0 else h * jnp.asarray(beta, h.dtype))
    if alpha != 1.0:
        residual = residual * jnp.asarray(alpha, residual.dtype)
    if beta != 1.0:
        h = h * jnp.asarray(beta, h.dtype)
    return residual + h


def _build_mlp(
    mlp: str, width: int, hidden: int, moe, multipliers, bias: bool, options
) -> nnx.Module | None:
    """The block's MLP of kind ``mlp`` (``MLPS``; None for ``"none"``), from the block's
    ``moe``, ``mlp_multipliers`` and ``mlp_bias`` options."""
    if mlp == "rwkv":
        return RWKVChannelMix(width, hidden, **options)
    if mlp == "moe":
        if not isinstance(moe, Mapping):
            raise ValueError(f"mlp='moe' needs moe= a dict of MoE's options, got {moe!r}")
        return MoE(width, **{"hidden": hidden, **moe}, **options)
    if tuple(multipliers) != (1.0, 1.0):
        if mlp != "swiglu":
            raise ValueError(f"mlp_multipliers need mlp='swiglu', got mlp={mlp!r}")
        options = dict(options, multipliers=multipliers)
    if bias:
        if mlp not in ("swiglu", "geglu"):
            raise ValueError(f"mlp_bias needs mlp='swiglu' or 'geglu', got mlp={mlp!r}")
        options = dict(options, use_bias=True)
    return MLP_CLASSES[mlp](width, hidden, **options) if mlp != "none" else None


class TransformerBlock(nnx.Module):
    """Pre-norm block: ``x + attn(conv(norm(x)))`` (with ``parallel``, ``x + out_1
    attn(in_1 norm(x)) + out_2 parallel(in_2 norm(x))``), then ``x + mlp(norm(x))``; either half
    may be absent (``attention="mlp"``: the MLP alone; ``mlp="none"``: the mixer alone, as
    Mamba-2's blocks and the hybrids' Mamba and attention layers).

    Args:
      width: model width (input and output features).
      num_heads: heads of the attention layer; must divide ``width``.
      attention: one of ``registry.ATTENTION_KINDS`` (``registry.make_attention``):
        ``"linear"``, ``"softmax"``, ``"gla"``, ``"deltanet"``, ``"gated_deltanet"``,
        ``"kda"``, ``"mamba2"``, or ``"mlp"`` (no mixer: the block is its MLP alone).
      mlp_ratio: the MLP's hidden width over ``width``.
      mlp: ``"gelu"`` (default: ``MLP``), ``"swiglu"`` (``SwiGLU``), ``"geglu"``
        (``GeGLU``), ``"relu2"``
        (``ReLU2MLP``), ``"moe"`` (a mixture of SwiGLU experts, ``layers.moe.MoE``, of the
        ``moe`` options) or ``"none"`` (no MLP and no second norm).
      mlp_hidden: the MLP's hidden width (overrides ``mlp_ratio``; Qwen's
        ``intermediate_size``); a MoE's experts' unless ``moe`` gives ``hidden``.
      moe: ``MoE``'s options (``num_experts``, ``top_k``, ``hidden``, ``score``, ...) when
        ``mlp="moe"``; unread otherwise.
      zero_centred_norm: the block's two RMSNorms in the ``x * (1 + w)`` form
        (``layers.norms.RMSNorm``; Qwen3-Next, Qwen3.5).
      norm: ``"rms"`` (RMSNorm, default) or ``"layer"`` (LayerNorm with a bias: RWKV's).
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
      sandwich_norm: a second norm after each half too, ``x + norm_2(f(norm_1(x)))`` (Gemma 2
        and 3: ``attention_post_norm`` is ``post_attention_layernorm``, ``mlp_norm`` and
        ``mlp_post_norm`` ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``).
      residual_multiplier: each half's output times this before it is added to the residual
        stream (Granite's ``residual_multiplier``; 1: none), over the halves' ``beta``.
      parallel: a second mixer run beside the first on the same normalised input, their
        outputs added (a parallel hybrid, Falcon-H1's attention beside Mamba-2):
        ``{"attention": kind, **its options}`` (``num_heads`` there: its own heads; the
        block's dtype and rngs); None: one mixer.
      branch_multipliers: ``((in, out), (in, out))`` of the mixer and the parallel one: each
        reads its input times ``in`` and its output is taken times ``out`` (Falcon-H1's
        ``attention_in_multiplier``, ``attention_out_multiplier``, ``ssm_in_multiplier``,
        ``ssm_out_multiplier``); all 1: none.
      mlp_multipliers: ``(gate, down)`` of a SwiGLU MLP (``SwiGLU``'s ``multipliers``;
        Falcon-H1's ``mlp_multipliers``); (1, 1): none.
      mlp_bias: biases on a SwiGLU or GeGLU MLP's three projections (RecurrentGemma's).
      hyper_connections: None, or ``{"streams": n, "rank": r}``: ``x`` is ``n`` streams
        ``[..., n, width]``, ``attention_norm`` and ``mlp_norm`` ``layers.hyper``'s
        ``HyperConnection``s reading each half's input and writing its output back.
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
        norm: str = "rms",
        short_conv: int = 0,
        normed_residual: bool = False,
        attention_residual: tuple[float, float] = (1.0, 1.0),
        mlp_residual: tuple[float, float] = (1.0, 1.0),
        post_norm: bool = False,
        sandwich_norm: bool = False,
        residual_multiplier: float = 1.0,
        parallel: Mapping[str, Any] | None = None,
        branch_multipliers: Sequence[Sequence[float]] = ((1.0, 1.0), (1.0, 1.0)),
        mlp_multipliers: Sequence[float] = (1.0, 1.0),
        mlp_bias: bool = False,
        hyper_connections: Mapping[str, int] | None = None,
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=jnp.float32,
        **attention_kwargs,
    ):
        mixer, hidden = _check_block_options(
            width, num_heads, attention, mlp, mlp_ratio, mlp_hidden, short_conv,
            normed_residual, post_norm, sandwich_norm, parallel, residual_multiplier,
            attention_kwargs.get("causal", True),
        )  # fmt: skip
        self.normed_residual, self.post_norm = normed_residual, post_norm
        self.attention_residual = _residual_factors("attention_residual", attention_residual)
        self.mlp_residual = _residual_factors("mlp_residual", mlp_residual)
        branch_multipliers = _branch_multipliers(branch_multipliers)
        alphas = (self.attention_residual[0], self.mlp_residual[0])
        _check_norms(norm, hyper_connections, post_norm, normed_residual, alphas)
        norm = lambda hyper=hyper_connections, kind=norm: make_norm(
            kind, width, zero_centred_norm, rngs, dtype, param_dtype, hyper
        )
        self.attention_norm = nnx.data(norm() if mixer else None)
        self.mlp_norm = nnx.data(norm() if mlp != "none" else None)
        self.attention_post_norm = nnx.data(norm(None) if sandwich_norm and mixer else None)
        self.mlp_post_norm = nnx.data(norm(None) if sandwich_norm and mlp != "none" else None)
        new_conv = lambda: CausalConv1D(width, short_conv, rngs=rngs, param_dtype=param_dtype)
        self.conv = nnx.data(new_conv() if short_conv else None)
        options = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.attention = nnx.data(
            registry.make_attention(attention, width, num_heads, **options, **attention_kwargs)
            if mixer
            else None
        )
        self.parallel = nnx.data(
            _parallel_mixer(parallel, width, num_heads, mixer, short_conv, rngs, dtype, param_dtype)
        )
        self.branch_multipliers = branch_multipliers
        self.mlp = nnx.data(_build_mlp(mlp, width, hidden, moe, mlp_multipliers, mlp_bias, options))
        self.width, self.residual_multiplier = width, float(residual_multiplier)

    def init_state(self, batch: int, max_length: int | None = None) -> BlockState:
        conv = None if self.conv is None else self.conv.init_state(batch)
        mlp = self.mlp.init_state(batch) if isinstance(self.mlp, RWKVChannelMix) else None
        if self.attention is None:
            return BlockState(None, conv, mlp=mlp)
        parallel = None if self.parallel is None else self.parallel.init_state(batch, max_length)
        return BlockState(self.attention.init_state(batch, max_length), conv, parallel, mlp)

    def __call__(self, x, *, key_mask=None, segment_ids=None, state=None, return_state=False):
        check_state(state, BlockState)
        recording = state is None and not return_state
        mlp_state = None if state is None else state.mlp
        if self.attention is None:  # an MLP-only layer
            x, mlp_state = self._mlp_half(x, key_mask, recording, segment_ids, mlp_state)
            return (x, BlockState(None, None, mlp=mlp_state)) if return_state else x
        h = normed = x if self.post_norm else self.attention_norm(x)
        residual = normed if self.normed_residual else x
        (in_1, out_1), (in_2, out_2) = self.branch_multipliers
        if in_1 != 1.0:
            h = h * in_1
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
        parallel_state = None
        if return_state:
            h, attention_state = h
        if out_1 != 1.0:
            h = h * out_1
        if self.parallel is not None:
            g = self.parallel(
                normed if in_2 == 1.0 else normed * in_2,
                key_mask=key_mask,
                segment_ids=segment_ids,
                state=None if state is None else state.parallel,
                return_state=return_state,
            )
            if return_state:
                g, parallel_state = g
            h = h + (g if out_2 == 1.0 else g * out_2)
        if return_state:
            state = BlockState(attention_state, conv_state, parallel_state)
        if self.post_norm:
            h = self.attention_norm(h)
        elif self.attention_post_norm is not None:
            h = self.attention_post_norm(h)
        x = self._add(residual, h, self.attention_residual, self.attention_norm)
        if self.mlp is not None:
            x, mlp_state = self._mlp_half(x, key_mask, recording, segment_ids, mlp_state)
        if return_state:
            state = state._replace(mlp=mlp_state)
        return (x, state) if return_state else x

    def _add(self, residual, h, factors: tuple[float, float], norm=None):
        """``alpha * residual + beta * residual_multiplier * h`` (``_add``)."""
        alpha, beta = factors
        return _add(residual, h, (alpha, beta * self.residual_multiplier), norm)

    def _mlp_half(self, x, key_mask, recording: bool, segment_ids, state):
        """``(x + mlp(norm(x)), the MLP's new state)`` (a state only for RWKV's)."""
        normed = x if self.post_norm else self.mlp_norm(x)
        h, state = _call_mlp(self.mlp, normed, key_mask, recording, segment_ids, state)
        if self.post_norm:
            return self._add(x, self.mlp_norm(h), self.mlp_residual), state
        h = h if self.mlp_post_norm is None else self.mlp_post_norm(h)
        residual = normed if self.normed_residual else x
        return self._add(residual, h, self.mlp_residual, self.mlp_norm), state


def _call_mlp(mlp, h, key_mask, recording: bool, segment_ids, state):
    """``(mlp(h), its new state)``: a mixture records its losses (full-sequence passes, not
    decoding), RWKV's channel mix carries its previous input; the others have no state."""
    if isinstance(mlp, MoE):
        return mlp(h, key_mask=key_mask, record=recording), state
    if isinstance(mlp, RWKVChannelMix):
        return mlp(h, key_mask=key_mask, segment_ids=segment_ids, state=state)
    return mlp(h), state
