"""The delta-rule family's layer: DeltaNet, Gated DeltaNet and KDA.

One layer, ``DeltaRuleAttention``, three variants of the published recipe (Yang,
Kautz and Hatamizadeh, ICLR 2025, "Gated Delta Networks"; FLA's layers)::

    q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))   # short causal conv
    q, k    = q / ||q||, k / ||k||                                       # per head
    beta    = sigmoid(W_beta x)                  # (x 2 with allow_negative_eigenvalues)
    g       = -exp(A_log) * softplus(W_a x + dt_bias)                    # gated variants
    o       = delta_rule(q, k, v, beta, gate=g, scale=1 / sqrt(dk))
    y       = W_o dropout(RMSNorm(o) * SiLU(W_g x))                      # per head

(Kimi Linear's KDA: ``W_g`` of low rank, ``output_gate_rank``, and ``sigmoid`` for SiLU,
``output_gate_activation``.)

``"deltanet"`` has no gate, ``"gated_deltanet"`` one log-decay per head,
``"kda"`` (Kimi Delta Attention) one per key channel, ``W_a`` then a low-rank
projection ``width -> gate_rank -> h * dk`` and ``dt_bias`` one per channel.
The state is ``hv * dk * dv`` floats per layer (``hv = num_v_heads``), float32 whatever
``dtype``.

Decoding, as for the other layers::

    cache = layer.init_state(batch)
    y, cache = layer(prompt, state=cache, return_state=True)      # prefill, chunked form
    y, cache = layer(next_token, state=cache, return_state=True)  # one token, O(1) step
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
    check_dropout_rate,
    check_head_dim,
    check_state,
    check_tokens,
    projection,
    split_heads,
)
from linattn_jax.layers.conv import CausalConv1D
from linattn_jax.layers.gates import MambaGate
from linattn_jax.layers.norms import GATE_ACTIVATIONS, GatedRMSNorm
from linattn_jax.layers.recurrent import run_causal, sequence_sharding
from linattn_jax.ops import checks, delta

VARIANTS = ("deltanet", "gated_deltanet", "kda")


class DeltaRuleCache(NamedTuple):
    """A ``DeltaRuleAttention`` layer's decoding state.

    Attributes:
      state: the delta rule's state, ``s [b, hv, dk, dv]``, float32 (``hv``: the value
        heads, ``num_v_heads``).
      conv: the short convolution's last ``conv_size - 1`` inputs,
        ``[b, conv_size - 1, 2 h dk + hv dv]`` float32 (the q, k and v projections,
        concatenated), or None without a convolution.
    """

    state: delta.State
    conv: jax.Array | None


def _l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum x^2 + eps)`` over the last axis, in float32, back in x's dtype."""
    y = x.astype(jnp.float32)
    return (y * jax.lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class DeltaRuleAttention(nnx.Module):
    """DeltaNet, Gated DeltaNet or KDA (``variant=``) with the published layer recipe.

    Args:
      width: model width (input and output features).
      num_heads: heads h (of q and k); must divide ``width`` unless ``head_dim`` is given.
      head_dim: dk, the channels of each q and k head (default ``width / h``).
      value_head_dim: dv, the channels of each value head (default ``expand_v * dk``).
      expand_v: dv over dk when ``value_head_dim`` is None (FLA's ``expand_v``; default 1).
      num_v_heads: value heads hv, a multiple of h (default h): grouped value heads, each
        group of ``hv / h`` sharing one q and k head (Qwen3-Next: 16 key heads, 32 value
        heads), each with its own beta, gate, state and output.
      variant: ``"deltanet"`` (Yang et al. 2024), ``"gated_deltanet"`` (default;
        Yang, Kautz and Hatamizadeh 2025: one Mamba2-style log-decay per head and
        token) or ``"kda"`` (Kimi Linear 2025: one per key channel).
      conv_size: kernel of the short causal depthwise convolution on q, k and v
        (default 4); 0 turns it off (SiLU still follows the projections).
      output_gate: gate the output RMSNorm with ``SiLU(W_g x)`` (default True);
        False leaves the RMSNorm alone.
      output_gate_rank: ``W_g`` through this low rank, ``width -> rank -> hv * dv``
        (Kimi Linear's ``g_a_proj``/``g_b_proj``, rank dk); None (default): one matrix.
      output_gate_activation: the gate's ``"silu"`` (default; FLA, Qwen3-Next) or
        ``"sigmoid"`` (Kimi Linear's gated norm).
      allow_negative_eigenvalues: ``beta = 2 sigmoid(W_beta x)`` in [0, 2] instead
        of [0, 1] (Grazzi et al. 2025; default False).
      gate_rank: the rank of KDA's gate projection (default dk; 0: one matrix
        ``width -> h * dk``, Ling's ``f_proj``); other variants refuse it.
      gate_lower_bound: a number < 0: KDA's bounded gate ``gate_lower_bound *
        sigmoid(exp(A_log) (W_a x + dt_bias))`` (Ling's ``kda_safe_gate``); None
        (default): ``-exp(A_log) softplus(W_a x + dt_bias)``. KDA's only.
      causal: True for decoders. The delta rule is a recurrence with no
        non-causal form: with False (an encoder, such as ``SequenceClassifier``'s)
        the layer still reads left to right, and refuses decoding.
      method: ``"chunked"`` (default), ``"scan"`` or ``"pallas"`` (the opt-in Pallas
        kernels, no per-channel gate), as in ``linattn_jax.ops.delta.causal``.
      chunk_size: tokens per chunk; None (default): the family's default
        (``linattn_jax.ops.checks.default_chunk_size``).
      sequence_axis: a mesh axis that splits full-sequence forwards along their
        length (``linattn_jax.ops.delta.sequence_parallel``; no ``key_mask`` or
        ``segment_ids`` then).
      batch_axis: the mesh axis that splits the batch alongside ``sequence_axis``.
      mesh: the mesh of those axes; the current one (``jax.set_mesh``) when None.
      dropout_rate: dropout on the gated, normalised output (before ``out_proj``), active
        when the call's (or the layer's) ``deterministic`` is False.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax; the state stays
        float32.
      param_dtype: the parameters' dtype, as in Flax.

    Raises:
      ValueError: an unknown variant or method; a width, head count, chunk size,
        ``conv_size`` or ``gate_rank`` that is not a positive int (``conv_size`` and
        ``gate_rank`` may be 0); heads not dividing the width; ``gate_rank`` or
        ``gate_lower_bound`` (a number < 0) for a variant other than KDA.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        value_head_dim: int | None = None,
        expand_v: float = 1,
        num_v_heads: int | None = None,
        variant: str = "gated_deltanet",
        conv_size: int = 4,
        output_gate: bool = True,
        output_gate_rank: int | None = None,
        output_gate_activation: str = "silu",
        allow_negative_eigenvalues: bool = False,
        gate_rank: int | None = None,
        gate_lower_bound: float | None = None,
        causal: bool = True,
        method: str = "chunked",
        chunk_size: int | None = None,
        sequence_axis: str | None = None,
        batch_axis: str | tuple[str, ...] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        h, hv, dk, dv = check_dims(
            width, num_heads, head_dim, value_head_dim, expand_v, num_v_heads
        )
        _check_options(
            variant, method, chunk_size, conv_size, dropout_rate, output_gate,
            allow_negative_eigenvalues, causal, gate_rank, output_gate_activation,
            output_gate_rank, gate_lower_bound,
        )  # fmt: skip
        self.width, self.num_heads, self.key_dim, self.value_dim = width, h, dk, dv
        self.num_v_heads = hv
        self.variant, self.causal = variant, causal
        self.method, self.chunk_size = method, chunk_size
        self.sharding = nnx.data(sequence_sharding(sequence_axis, batch_axis, mesh, causal))
        self.beta_max = 2.0 if allow_negative_eigenvalues else 1.0
        self.scale = 1.0 / math.sqrt(dk)
        options = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        heads_in = (sharding.EMBED, sharding.HEADS)
        self.q_proj = projection(width, h * dk, *heads_in, **options)
        self.k_proj = projection(width, h * dk, *heads_in, **options)
        self.v_proj = projection(width, hv * dv, *heads_in, **options)
        self.beta_proj = projection(width, hv, *heads_in, **options)
        self.conv = nnx.data(
            CausalConv1D(2 * h * dk + hv * dv, conv_size, rngs=rngs, param_dtype=param_dtype)
            if conv_size
            else None
        )
        gate = _decay_gate(variant, width, hv, dk, gate_rank, gate_lower_bound, options)
        self.gate = nnx.data(gate)
        self.g_proj = nnx.data(
            _output_gate_projection(width, hv * dv, output_gate, output_gate_rank, options)
        )
        # In float32 whatever dtype (Flax's RMSNorm would promote bfloat16 with float32).
        self.output_norm = GatedRMSNorm(
            dv, activation=output_gate_activation, dtype=jnp.float32, param_dtype=param_dtype,
            rngs=rngs,
        )  # fmt: skip
        self.out_proj = projection(hv * dv, width, sharding.HEADS, sharding.EMBED, **options)
        # Last: its RNG stream (rate > 0) must not shift the parameters' initialisation.
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    def init_state(self, batch: int, max_length: int | None = None) -> DeltaRuleCache:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        check_can_decode(self)
        state = delta.init_state(batch, self.num_v_heads, self.key_dim, self.value_dim)
        return DeltaRuleCache(state, None if self.conv is None else self.conv.init_state(batch))

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: DeltaRuleCache | None = None,
        return_state: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``).

        Args:
          x: ``[b, t, width]``.
          key_mask: optional bool ``[b, t]``, True for real tokens: padded rows of
            ``x`` are replaced by zeros before anything reads them (a NaN there
            reaches neither outputs nor gradients), leave the state untouched and
            output 0 (then ``out_proj``).
          segment_ids: optional int ``[b, t]``: the state and the convolution reset
            wherever the id changes.
          state: a ``DeltaRuleCache`` (``init_state``): a one-token ``x`` takes the
            O(1) step, a longer one (a prompt) is prefilled through the chunked form.
          return_state: also return the new ``DeltaRuleCache``.
          deterministic: switches the output dropout off (True) or on, as in
            ``nnx.Dropout`` (None: the layer's own setting).
          rngs: the dropout's random stream (None: the layer's), as in ``nnx.Dropout``.
        """
        check_tokens(x, self.width)
        check_decoding(self, state, return_state)
        check_state(state, DeltaRuleCache)
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        x = checks.where_token(key_mask, x)
        qkv = jnp.concatenate([p(x) for p in (self.q_proj, self.k_proj, self.v_proj)], axis=-1)
        conv_state = None
        if self.conv is not None:
            past = None if state is None else state.conv
            qkv, conv_state = self.conv(qkv, past, segment_ids, key_mask)
        hk = self.num_heads * self.key_dim
        q, k, v = jnp.split(jax.nn.silu(qkv), [hk, 2 * hk], axis=-1)
        q, k = (_l2_normalize(split_heads(y, self.num_heads)) for y in (q, k))
        v = split_heads(v, self.num_v_heads)
        beta = self.beta_max * jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
        out, s = run_causal(
            delta,
            q,
            k,
            v,
            beta,
            state=None if state is None else state.state,
            key_mask=key_mask,
            segment_ids=segment_ids,
            method=self.method,
            chunk_size=self.chunk_size,
            sharding=self.sharding,
            gate=None if self.gate is None else self.gate(x),
            options=dict(scale=self.scale),
        )
        g = None if self.g_proj is None else split_heads(self.g_proj(x), self.num_v_heads)
        out = self.output_norm(out.astype(jnp.float32), g).astype(qkv.dtype)
        out = self.dropout(out, deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.num_v_heads * self.value_dim))
        return (y, DeltaRuleCache(s, conv_state)) if return_state else y


def check_dims(width, num_heads, head_dim, value_head_dim, expand_v, num_v_heads):
    """``(h, hv, dk, dv)`` of a ``DeltaRuleAttention``, checked."""
    head_dim = check_head_dim(width, num_heads, head_dim)
    if value_head_dim is None:
        ok = isinstance(expand_v, int | float) and not isinstance(expand_v, bool) and expand_v > 0
        if not ok or head_dim * expand_v != int(head_dim * expand_v):
            raise ValueError(
                f"expand_v must be a number > 0 making head_dim * expand_v an int (head_dim="
                f"{head_dim}), got {expand_v!r}"
            )
        value_head_dim = int(head_dim * expand_v)
    elif expand_v != 1:
        raise ValueError(
            f"give value_head_dim or expand_v, not both; got value_head_dim={value_head_dim} "
            f"and expand_v={expand_v}"
        )
    checks.check_int("value_head_dim", value_head_dim, 1)
    num_v_heads = num_heads if num_v_heads is None else num_v_heads
    checks.check_int("num_v_heads", num_v_heads, 1)
    if num_v_heads % num_heads:
        raise ValueError(
            f"num_v_heads must be a multiple of num_heads={num_heads}, got {num_v_heads}"
        )
    return num_heads, num_v_heads, head_dim, value_head_dim


def _check_options(
    variant, method, chunk_size, conv_size, dropout_rate, output_gate,
    allow_negative_eigenvalues, causal, gate_rank, output_gate_activation, output_gate_rank,
    gate_lower_bound,
) -> None:  # fmt: skip
    """``DeltaRuleAttention``'s options besides its sizes, or a ValueError naming one."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if method not in delta.METHODS + delta.KERNEL_METHODS:
        raise ValueError(f"method must be one of {delta.METHODS} or 'pallas', got {method!r}")
    checks.check_chunk_size(chunk_size)
    checks.check_int("conv_size", conv_size, 0)
    check_dropout_rate(dropout_rate)
    for name, flag in [
        ("output_gate", output_gate),
        ("allow_negative_eigenvalues", allow_negative_eigenvalues),
        ("causal", causal),
    ]:
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if gate_rank is not None:
        if variant != "kda":
            raise ValueError(f"gate_rank is KDA's (variant='kda'), got variant={variant!r}")
        checks.check_int("gate_rank", gate_rank, 0)
    if gate_lower_bound is not None:
        if variant != "kda":
            raise ValueError(f"gate_lower_bound is KDA's (variant='kda'), got variant={variant!r}")
        number = isinstance(gate_lower_bound, (int, float)) and not isinstance(
            gate_lower_bound, bool
        )
        if not (number and gate_lower_bound < 0):
            raise ValueError(f"gate_lower_bound must be a number < 0, got {gate_lower_bound!r}")
    if output_gate_activation not in GATE_ACTIVATIONS:
        raise ValueError(
            f"output_gate_activation must be one of {GATE_ACTIVATIONS}, got "
            f"{output_gate_activation!r}"
        )
    if output_gate_rank is not None:
        if not output_gate:
            raise ValueError("output_gate_rank needs output_gate=True")
        checks.check_int("output_gate_rank", output_gate_rank, 1)


def _decay_gate(
    variant: str, width: int, hv: int, dk: int, gate_rank, lower_bound, options
) -> MambaGate | None:
    """The variant's log-decay: none (DeltaNet), one per head (Gated DeltaNet) or one per
    key channel through a low rank (KDA; ``gate_rank``, default dk, 0 one matrix),
    bounded below by ``lower_bound`` where given."""
    if variant == "gated_deltanet":
        return MambaGate(width, hv, **options)
    if variant == "kda":
        rank = dk if gate_rank is None else gate_rank or None
        return MambaGate(width, hv, dk, rank, lower_bound=lower_bound, **options)
    return None


def _output_gate_projection(width: int, features: int, output_gate: bool, rank, options):
    """``W_g``: ``width -> features`` in one matrix, or through ``rank`` (Kimi Linear's
    ``g_a_proj``, ``g_b_proj``); None without an output gate."""
    if not output_gate:
        return None
    if rank is None:
        return projection(width, features, sharding.EMBED, sharding.HEADS, **options)
    return nnx.Sequential(
        projection(width, rank, sharding.EMBED, None, **options),
        projection(rank, features, None, sharding.HEADS, **options),
    )
