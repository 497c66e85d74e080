"""Flax NNX layers over the delta rule: DeltaNet, Gated DeltaNet and KDA.

One layer, ``DeltaRuleAttention``, three variants of the published recipe (Yang,
Kautz and Hatamizadeh, ICLR 2025, "Gated Delta Networks"; FLA's layers)::

    q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))   # short causal conv
    q, k    = q / ||q||, k / ||k||                                       # per head
    beta    = sigmoid(W_beta x)                  # (x 2 with allow_negative_eigenvalues)
    g       = -exp(A_log) * softplus(W_a x + dt_bias)                    # gated variants
    o       = delta_rule(q, k, v, beta, gate=g, scale=1 / sqrt(dk))
    y       = W_o (RMSNorm(o) * SiLU(W_g x))                             # per head

``"deltanet"`` has no gate, ``"gated_deltanet"`` one log-decay per head,
``"kda"`` (Kimi Delta Attention) one per key channel, ``W_a`` then a low-rank
projection ``width -> gate_rank -> h * dk`` and ``dt_bias`` one per channel.
The state is ``h * dk * dv`` floats per layer, float32 whatever ``dtype``.

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

from linattn_jax import checks
from linattn_jax.delta_rule import (
    DELTA_METHODS,
    DeltaRuleState,
    delta_rule,
    delta_rule_step,
    init_delta_state,
)
from linattn_jax.layer_utils import check_int, check_tokens, check_width, split_heads
from linattn_jax.sequence_parallel import sequence_parallel_delta_rule

VARIANTS = ("deltanet", "gated_deltanet", "kda")
A_INIT_RANGE = (1.0, 16.0)  # A = exp(A_log) ~ U(1, 16) (FLA)
DT_INIT_RANGE = (1e-3, 1e-1)  # softplus(dt_bias) log-uniform in this range (Mamba2)


class DeltaRuleCache(NamedTuple):
    """A ``DeltaRuleAttention`` layer's decoding state.

    Attributes:
      state: the delta rule's state, ``s [b, h, dk, dv]``, float32.
      conv: the short convolution's last ``conv_size - 1`` inputs,
        ``[b, conv_size - 1, 2 h dk + h dv]`` float32 (the q, k and v projections,
        concatenated), or None without a convolution.
    """

    state: DeltaRuleState
    conv: jax.Array | None


class CausalDepthwiseConv(nnx.Module):
    """A causal depthwise convolution over time, kernel ``size``, that does not look
    across ``segment_ids`` boundaries. Initialised to the identity plus small noise.

    Decoding keeps the last ``size - 1`` inputs as its state (float32).

    Args:
      channels: the number of channels (each convolved on its own).
      size: the kernel size, >= 1.
      rngs, param_dtype: as in Flax.
    """

    def __init__(self, channels: int, size: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        check_int("channels", channels, 1)
        check_int("conv_size", size, 1)
        kernel = 0.02 * jax.random.normal(rngs.params(), (size, channels), param_dtype)
        self.kernel = nnx.Param(kernel.at[-1].add(1.0))
        self.size, self.channels = size, channels

    def init_state(self, batch: int) -> jax.Array:
        """Zeros ``[batch, size - 1, channels]``, float32."""
        return jnp.zeros((batch, self.size - 1, self.channels), jnp.float32)

    def __call__(
        self, x: jax.Array, state: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """``x [b, t, c]`` -> ``(y [b, t, c] in x's dtype, the last size - 1 inputs)``.

        ``state`` holds the inputs before ``x`` (zeros when None); they count as
        part of the first token's segment.
        """
        b, t, c = x.shape
        n = self.size - 1
        past = self.init_state(b) if state is None else state
        checks.check_shape("state.conv", past, (b, n, c), "[batch, conv_size - 1, channels]")
        padded = jnp.concatenate([past.astype(x.dtype), x], axis=1)  # [b, n + t, c]
        kernel = self.kernel[...].astype(x.dtype)
        if segment_ids is not None:
            seg = jnp.concatenate([jnp.repeat(segment_ids[:, :1], n, axis=1), segment_ids], 1)
        y = jnp.zeros_like(x)
        for i in range(self.size):  # tap i looks back n - i tokens
            tap = kernel[i][None, None] * padded[:, i : i + t]
            if segment_ids is not None and i < n:
                same = seg[:, i : i + t] == segment_ids
                tap = jnp.where(same[..., None], tap, jnp.zeros((), x.dtype))
            y = y + tap
        return y, padded[:, t:].astype(jnp.float32)


def _l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum x^2 + eps)`` over the last axis, in float32, back in x's dtype."""
    y = x.astype(jnp.float32)
    return (y * jax.lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class DeltaRuleAttention(nnx.Module):
    """DeltaNet, Gated DeltaNet or KDA (``variant=``) with the published layer recipe.

    Args:
      width: model width (input and output features).
      num_heads: heads h; must divide ``width``; dk = dv = width / h.
      variant: ``"deltanet"`` (Yang et al. 2024), ``"gated_deltanet"`` (default;
        Yang, Kautz and Hatamizadeh 2025: one Mamba2-style log-decay per head and
        token) or ``"kda"`` (Kimi Linear 2025: one per key channel).
      conv_size: kernel of the short causal depthwise convolution on q, k and v
        (default 4); 0 turns it off (SiLU still follows the projections).
      output_gate: gate the output RMSNorm with ``SiLU(W_g x)`` (default True);
        False leaves the RMSNorm alone.
      allow_negative_eigenvalues: ``beta = 2 sigmoid(W_beta x)`` in [0, 2] instead
        of [0, 1] (Grazzi et al. 2025; default False).
      gate_rank: the rank of KDA's gate projection (default dk); other variants
        refuse it.
      causal: True for decoders. The delta rule is a recurrence with no
        non-causal form: with False (an encoder, such as ``SequenceClassifier``'s)
        the layer still reads left to right, and refuses decoding.
      method: ``"chunked"`` (default) or ``"scan"``, as in ``delta_rule``.
      chunk_size: tokens per chunk.
      sequence_axis: a mesh axis that splits full-sequence forwards along their
        length (``sequence_parallel_delta_rule``; no ``key_mask`` or ``segment_ids``
        then); ``batch_axis`` and ``mesh`` as in ``layers.LinearAttention``.
      rngs, dtype, param_dtype: as in Flax; the state stays float32.

    Raises:
      ValueError: an unknown variant or method; a width, head count, chunk size,
        ``conv_size`` or ``gate_rank`` that is not a positive int (``conv_size``
        may be 0); heads not dividing the width; ``gate_rank`` for a variant
        other than KDA.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        variant: str = "gated_deltanet",
        conv_size: int = 4,
        output_gate: bool = True,
        allow_negative_eigenvalues: bool = False,
        gate_rank: int | None = None,
        causal: bool = True,
        method: str = "chunked",
        chunk_size: int = 64,
        sequence_axis: str | None = None,
        batch_axis: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        check_width(width, num_heads)
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if method not in DELTA_METHODS:
            raise ValueError(f"method must be one of {DELTA_METHODS}, got {method!r}")
        check_int("chunk_size", chunk_size, 1)
        check_int("conv_size", conv_size, 0)
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
            check_int("gate_rank", gate_rank, 1)
        h = num_heads
        d = width // h
        self.width, self.num_heads, self.key_dim, self.value_dim = width, h, d, d
        self.variant, self.causal = variant, causal
        self.method, self.chunk_size = method, chunk_size
        if sequence_axis is not None and not causal:
            raise ValueError("sequence_axis needs a causal layer (causal=True)")
        self.sequence_axis, self.batch_axis, self.mesh = sequence_axis, batch_axis, mesh
        self.beta_max = 2.0 if allow_negative_eigenvalues else 1.0
        self.scale = 1.0 / math.sqrt(d)
        linear = lambda n_in, n_out, **kw: nnx.Linear(
            n_in, n_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **kw
        )
        self.q_proj, self.k_proj = (linear(width, h * d, use_bias=False) for _ in range(2))
        self.v_proj = linear(width, h * d, use_bias=False)
        self.beta_proj = linear(width, h, use_bias=False)
        channels = 3 * h * d
        self.conv = nnx.data(
            CausalDepthwiseConv(channels, conv_size, rngs=rngs, param_dtype=param_dtype)
            if conv_size
            else None
        )
        # Optional parts: None or a module / parameter, each assigned once.
        decay_width = {"deltanet": 0, "gated_deltanet": h, "kda": h * d}[variant]
        if variant == "kda":
            rank = d if gate_rank is None else gate_rank
            a_proj = nnx.Sequential(
                linear(width, rank, use_bias=False), linear(rank, h * d, use_bias=False)
            )
        elif variant == "gated_deltanet":
            a_proj = linear(width, h, use_bias=False)
        else:
            a_proj = None
        self.a_proj = nnx.data(a_proj)
        if decay_width:
            key_a, key_dt = jax.random.split(rngs.params())
            a = jax.random.uniform(key_a, (h,), jnp.float32, *A_INIT_RANGE)
            lo, hi = (math.log(x) for x in DT_INIT_RANGE)
            dt = jnp.exp(jax.random.uniform(key_dt, (decay_width,), jnp.float32, lo, hi))
            dt = jnp.maximum(dt, 1e-4)
            inverse_softplus = dt + jnp.log(-jnp.expm1(-dt))
            self.A_log = nnx.data(nnx.Param(jnp.log(a).astype(param_dtype)))
            self.dt_bias = nnx.data(nnx.Param(inverse_softplus.astype(param_dtype)))
        else:
            self.A_log, self.dt_bias = nnx.data(None), nnx.data(None)
        self.g_proj = nnx.data(linear(width, h * d, use_bias=False) if output_gate else None)
        # In float32 whatever dtype (Flax's RMSNorm would promote bfloat16 with float32).
        self.output_norm = nnx.RMSNorm(d, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.out_proj = linear(h * d, width, use_bias=False)

    @property
    def state_size(self) -> int:
        """Floats of recurrent state per sequence: ``h * dk * dv`` (plus the conv's inputs)."""
        conv = 0 if self.conv is None else (self.conv.size - 1) * self.conv.channels
        return self.num_heads * self.key_dim * self.value_dim + conv

    def init_state(self, batch: int, max_length: int | None = None) -> DeltaRuleCache:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        if not self.causal:
            raise ValueError("decoding needs a causal layer (causal=True)")
        state = init_delta_state(batch, self.num_heads, self.key_dim, self.value_dim)
        return DeltaRuleCache(state, None if self.conv is None else self.conv.init_state(batch))

    def _log_decay(self, x: jax.Array) -> jax.Array | None:
        """``-exp(A_log) softplus(W_a x + dt_bias)``: ``[b, t, h]`` or ``[b, t, h, dk]``."""
        if self.a_proj is None:
            return None
        a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)[None, None]
        decay_rate = jnp.exp(self.A_log[...].astype(jnp.float32))  # [h]
        if self.variant == "kda":
            a = split_heads(a, self.num_heads)  # [b, t, h, dk]
            return -decay_rate[None, None, :, None] * jax.nn.softplus(a)
        return -decay_rate[None, None] * jax.nn.softplus(a)

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: DeltaRuleCache | None = None,
        return_state: bool = False,
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
        """
        check_tokens(x, self.width)
        if (state is not None or return_state) and not self.causal:
            raise ValueError("decoding (state=, return_state=) needs a causal layer (causal=True)")
        if state is not None and not isinstance(state, DeltaRuleCache):
            raise ValueError(f"state must be a DeltaRuleCache, got {type(state).__name__}")
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        x = checks.where_token(key_mask, x)
        qkv = jnp.concatenate([p(x) for p in (self.q_proj, self.k_proj, self.v_proj)], axis=-1)
        conv_state = None
        if self.conv is not None:
            if segment_ids is not None:
                checks.segment_resets(segment_ids, b, t, jnp.float32)  # validates
            qkv, conv_state = self.conv(qkv, None if state is None else state.conv, segment_ids)
        q, k, v = (split_heads(y, self.num_heads) for y in jnp.split(jax.nn.silu(qkv), 3, axis=-1))
        q, k = _l2_normalize(q), _l2_normalize(k)
        beta = self.beta_max * jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))
        gate = self._log_decay(x)
        initial = None if state is None else state.state
        if state is not None and t == 1 and key_mask is None and segment_ids is None:
            out, s = delta_rule_step(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                beta[:, 0],
                initial,
                gate=None if gate is None else gate[:, 0],
                scale=self.scale,
            )
            out = out[:, None]
        elif self.sequence_axis is not None and state is None:
            if key_mask is not None or segment_ids is not None:
                raise ValueError("a sequence-parallel layer takes no key_mask or segment_ids")
            out, s = sequence_parallel_delta_rule(
                q,
                k,
                v,
                beta,
                axis_name=self.sequence_axis,
                batch_axis=self.batch_axis,
                mesh=self.mesh,
                gate=gate,
                chunk_size=self.chunk_size,
                return_state=True,
                scale=self.scale,
            )
        else:
            out, s = delta_rule(
                q,
                k,
                v,
                beta,
                gate=gate,
                method=self.method,
                chunk_size=self.chunk_size,
                initial_state=initial,
                return_state=True,
                key_mask=key_mask,
                segment_ids=segment_ids,
                scale=self.scale,
            )
        out = self.output_norm(out.astype(jnp.float32)).astype(qkv.dtype)
        if self.g_proj is not None:
            out = out * jax.nn.silu(split_heads(self.g_proj(x), self.num_heads)).astype(out.dtype)
        y = self.out_proj(out.reshape(b, t, self.num_heads * self.value_dim))
        return (y, DeltaRuleCache(s, conv_state)) if return_state else y
