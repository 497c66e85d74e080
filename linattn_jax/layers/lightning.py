"""Lightning attention (MiniMax-01): the additive rule with fixed per-head decays that
depend on the layer's depth, SiLU on q, k and v, no normaliser, an RMSNorm over all heads
and a sigmoid output gate.

For each head ``h`` of layer ``l`` of ``L``::

    S_i = gamma_h S_{i-1} + k_i v_i^T,     o_i = q_i^T S_i     (q, k, v after SiLU)
    y = out_proj(sigmoid(x W_g) * RMSNorm(concat_h o_i))

with ``gamma_h = exp(-slope_h)``, ``slope_h = 2^(-8 (h + 1) / H) * (1 - l / (L - 1 + 1e-5)
+ 1e-5)`` (ALiBi's slopes, shrunk towards the last layer: early layers forget fast, late
ones barely at all; ``lightning_decays``). The recurrence runs on the additive family
(``linattn_jax.ops.additive``: identity features, ``normalize=False``, ``decay=gamma``), so
the chunked, scan, quadratic, step and sequence-parallel forms all apply.

Reference: Qin et al. 2024, "Various Lengths, Constant Speed: Efficient Language Modeling
with Lightning Attention" (https://arxiv.org/abs/2405.17381); MiniMax et al. 2025,
"MiniMax-01: Scaling Foundation Models with Lightning Attention"
(https://arxiv.org/abs/2501.08313).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.common import (
    check_decoding,
    check_head_dim,
    check_state,
    check_tokens,
    next_position,
    positions,
    projection,
    split_heads,
)
from linattn_jax.layers.linear import LinearAttentionCache
from linattn_jax.layers.norms import RMSNorm
from linattn_jax.layers.recurrent import run_causal, sequence_sharding
from linattn_jax.ops import additive, checks


def lightning_decays(num_heads: int, layer_index: int, num_layers: int) -> np.ndarray:
    """MiniMax-01's per-head decays ``gamma_h = exp(-slope_h)`` of layer ``layer_index``
    of ``num_layers``: float64 ``[num_heads]`` (module docstring; ``transformers``'
    ``MiniMaxLightningAttention.get_slope_rate``).

    Raises:
      ValueError: a size that is not a positive int, or ``layer_index`` outside
        ``[0, num_layers)``.
    """
    checks.check_sizes(num_heads=num_heads, num_layers=num_layers)
    checks.check_int("layer_index", layer_index, 0)
    if layer_index >= num_layers:
        raise ValueError(f"layer_index must be < num_layers={num_layers}, got {layer_index}")
    base = 2.0 ** (-8.0 / num_heads)
    depth = 1.0 - layer_index / (num_layers - 1 + 1e-5) + 1e-5
    slopes = base ** np.arange(1, num_heads + 1, dtype=np.float64) * depth
    return np.exp(-slopes)


class LightningAttention(nnx.Module):
    """MiniMax-01's lightning attention (module docstring), causal.

    Args:
      width: model width (input and output features).
      num_heads: heads ``H``.
      head_dim: per-head dimension (None: ``width / num_heads``, which must divide).
      layer_index: this layer's index ``l`` in the model (the decays depend on it).
      num_layers: the model's depth ``L``.
      method: the full-sequence form, ``"chunked"``, ``"scan"``, ``"quadratic"`` or the
        opt-in ``"pallas"`` kernel (``additive.causal``).
      chunk_size: tokens per chunk; None (default): the family's default
        (``linattn_jax.ops.checks.default_chunk_size``).
      norm_eps: the output RMSNorm's epsilon (``transformers``' default 1e-6).
      sequence_axis: a mesh axis that splits the sequence (the full-sequence forward runs
        ``additive.sequence_parallel``; no key mask or segments there).
      batch_axis: the mesh axis that splits the batch beside ``sequence_axis``.
      mesh: the mesh of those axes; the current one when None.
      causal: must be True (lightning attention is a decoder's).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``output_gate`` ``[width, H * d]``,
    ``norm.scale`` ``[H * d]``, ``out_proj`` ``[H * d, width]``; no biases.

    Raises:
      ValueError: a bad size, ``layer_index`` outside ``[0, num_layers)``, an unknown
        method, or ``causal=False``.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        layer_index: int = 0,
        num_layers: int = 1,
        method: str = "chunked",
        chunk_size: int | None = None,
        norm_eps: float = 1e-6,
        sequence_axis: str | None = None,
        batch_axis: str | tuple[str, ...] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        causal: bool = True,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        self.head_dim = check_head_dim(width, num_heads, head_dim)
        if causal is not True:
            raise ValueError(f"lightning attention is causal: causal must be True, got {causal!r}")
        if method not in additive.METHODS + additive.KERNEL_METHODS:
            raise ValueError(
                f"method must be one of {additive.METHODS} or 'pallas', got {method!r}"
            )
        checks.check_chunk_size(chunk_size)
        checks.check_number("norm_eps", norm_eps, 0)
        gamma = lightning_decays(num_heads, layer_index, num_layers)
        self.width, self.num_heads, self.causal = width, num_heads, True
        self.layer_index, self.num_layers = layer_index, num_layers
        self.method, self.chunk_size, self.dtype = method, chunk_size, dtype
        self.decay = tuple(float(g) for g in gamma)  # static: fixed, not a parameter
        self.sharding = nnx.data(sequence_sharding(sequence_axis, batch_axis, mesh))
        inner = num_heads * self.head_dim
        linear = functools.partial(projection, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        heads_in = (sharding.EMBED, sharding.HEADS)
        self.q_proj = linear(width, inner, *heads_in)
        self.k_proj = linear(width, inner, *heads_in)
        self.v_proj = linear(width, inner, *heads_in)
        self.output_gate = linear(width, inner, *heads_in)
        self.norm = RMSNorm(
            inner, epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.out_proj = linear(inner, width, sharding.HEADS, sharding.EMBED)

    @property
    def slopes(self) -> np.ndarray:
        """The per-head ``slope_h = -log(gamma_h)``, float64 ``[H]``."""
        return -np.log(lightning_decays(self.num_heads, self.layer_index, self.num_layers))

    def init_state(self, batch: int, max_length: int | None = None) -> LinearAttentionCache:
        """The empty decoding state (``max_length`` ignored: the state has a fixed size)."""
        del max_length
        d = self.head_dim
        state = additive.init_state(batch, self.num_heads, d, d)
        return LinearAttentionCache(state, jnp.zeros((batch,), jnp.int32))

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: LinearAttentionCache | None = None,
        return_state: bool = False,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``).

        ``key_mask [b, t]`` (True = real): a padded token adds nothing to the state (no
        decay either) and its output is zero before the gate; ``segment_ids [b, t]`` reset
        the state where they change. With a ``state``, a one-token ``x`` takes the O(1)
        step, a longer one is prefilled.
        """
        check_decoding(self, state, return_state)
        check_state(state, LinearAttentionCache)
        check_tokens(x, self.width)
        b, t, _ = x.shape
        key_mask = checks.token_mask("key_mask", key_mask, b, t)
        x = checks.where_token(key_mask, x)
        q, k, v = (
            split_heads(jax.nn.silu(p(x)), self.num_heads)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        position = None if state is None else state.position
        decay = jnp.asarray(self.decay, jnp.float32)
        options = dict(decay=decay, feature_map="identity", normalize=False)
        out, s = run_causal(
            additive,
            q,
            k,
            v,
            state=None if state is None else state.state,
            key_mask=key_mask,
            segment_ids=segment_ids,
            method=self.method,
            chunk_size=self.chunk_size,
            sharding=self.sharding,
            options=options,
            step_options=dict(position=position),
            causal_options=dict(positions=positions(position, b, t, key_mask)),
        )
        gate = jax.nn.sigmoid(self.output_gate(x))
        out = out.reshape(b, t, self.num_heads * self.head_dim)  # no -1: t may be 0
        y = self.out_proj(gate * self.norm(out).astype(gate.dtype))
        if return_state:
            return y, LinearAttentionCache(s, next_position(position, b, t, key_mask))
        return y
