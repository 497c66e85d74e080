"""The additive family's layer: multi-head linear attention with q/k/v/output projections.

Decoding states are passed in and returned explicitly::

    state = layer.init_state(batch)
    y, state = layer(prompt, state=state, return_state=True)    # prefill, chunked form
    y, state = layer(next_token, state=state, return_state=True)  # one token, O(1) step
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers.common import (
    check_can_decode,
    check_decoding,
    check_dropout_rate,
    check_state,
    check_width,
    next_position,
    positions,
    project_qkv,
    projection,
)
from linattn_jax.layers.feature_maps import RANDOM_FEATURES, make_feature_map
from linattn_jax.layers.gates import ChannelGate, HeadGate
from linattn_jax.layers.recurrent import run_causal, sequence_sharding
from linattn_jax.ops import additive, checks
from linattn_jax.ops import feature_maps as fm
from linattn_jax.ops.additive.inputs import check_normalize

GATES = (False, True, "channel")


class LinearAttentionCache(NamedTuple):
    """A ``LinearAttention`` layer's decoding state.

    Attributes:
      state: the recurrent (S, Z) state, ``s [b, h, f, v]``, ``z [b, h, f]``, float32.
      position: ``[b]`` int32, the number of real (not masked-out) tokens seen so
        far: the next token's position.
    """

    state: additive.State
    position: jax.Array


class LinearAttention(nnx.Module):
    """Multi-head linear attention with q/k/v/output projections.

    Args:
      width: model width (input and output features).
      num_heads: heads; must divide ``width``.
      feature_map: a registered name (``fm.names()``), ``"favor_plus"`` or
        ``"random_fourier"`` (projection drawn from ``rngs``; ``num_features``),
        ``"hedgehog"`` (learnable; ``hedgehog_form``), ``"cosformer"``
        (``max_length``), or a callable.
      causal: causal (decoder) or non-causal (encoder) attention.
      method: causal form, ``"chunked"``, ``"scan"``, ``"quadratic"`` or ``"pallas"`` (the
        opt-in Pallas kernel of the chunked form, as in ``linattn_jax.ops.additive.causal``;
        interpreted on CPU); a non-causal layer ignores it.
      chunk_size: tokens per chunk; None (default): the family's default
        (``linattn_jax.ops.checks.default_chunk_size``).
      decay: None, ``"retnet"`` (gamma_h = 1 - 2^(-5-h)), a float or one per head.
      gate: learn a data-dependent log-decay per token: ``True`` one per head
        (``log_sigmoid`` of a projection of the input, biased towards slow decay),
        ``"channel"`` one per feature channel (GLA; Yang et al. 2024, "Gated Linear
        Attention Transformers with Hardware-Efficient Training"):
        ``log_sigmoid(W2 W1 x + b) / 16`` through rank 16, ``[b, t, h, f]``.
        ``False``: none.
      normalize: divide by ``phi(q)^T Z`` (True) or not; without it an RMSNorm
        over each head's output keeps the scale (TransNormer). Maps that need it
        (``requires_normalize``: FAVOR+, Hedgehog's paper form) refuse False;
        signed maps (``signed``: ``"identity"``, ``"random_fourier"``) refuse True.
      num_features: m for random features (default 2 * head_dim); other maps ignore it.
      max_length: cosFormer's M; other maps ignore it.
      hedgehog_form: ``"softmax"`` (default) or ``"paper"``; see ``HedgehogFeatureMap``.
        Other maps ignore it.
      feature_dim: d' (Based): q and k are projected to ``feature_dim`` per head
        (instead of ``head_dim``) before the feature map, so a Taylor map's state
        has 1 + d' + d'^2 features per head (273 at d' = 16, not 4,161 at d = 64).
        Values keep ``head_dim``. None: no reduction.
      sequence_axis: a mesh axis that splits the sequence: the causal full-sequence
        forward then runs sequence-parallel (``sequence_parallel``; no key mask or
        segments there), decoding steps are unaffected.
      batch_axis: the mesh axis that splits the batch alongside ``sequence_axis``.
      mesh: the mesh of those axes; the current one (``jax.set_mesh``) when None.
      eps: the denominator's epsilon.
      dropout_rate: dropout on the attention's output (before ``out_proj``), active
        when the call's (or the layer's) ``deterministic`` is False, as in
        ``nnx.MultiHeadAttention``.
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.

    Attributes:
      feature_dim: f, the feature map's output dimension per head (the state's
        size; not the ``feature_dim`` argument, which is ``qk_dim``).
      qk_dim: the per-head dimension of q and k (``feature_dim`` or ``head_dim``).

    Raises:
      ValueError: unknown feature map, method or Hedgehog form; a width, head
        count, chunk size, ``num_features`` or ``feature_dim`` that is not a
        positive int; heads not dividing the width; a bad decay; ``normalize``
        the feature map cannot take.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        feature_map: str | Callable = "elu",
        causal: bool = True,
        method: str = "chunked",
        chunk_size: int | None = None,
        decay: None | str | float | Sequence[float] = None,
        gate: bool | str = False,
        normalize: bool = True,
        num_features: int | None = None,
        max_length: int = 4096,
        hedgehog_form: str = "softmax",
        feature_dim: int | None = None,
        sequence_axis: str | None = None,
        batch_axis: str | tuple[str, ...] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        eps: float = 1e-6,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        _check_options(
            width, num_heads, chunk_size, dropout_rate, causal, normalize, eps, feature_dim,
            method, gate,
        )  # fmt: skip
        self.width, self.num_heads, self.head_dim = width, num_heads, width // num_heads
        self.qk_dim = self.head_dim if feature_dim is None else feature_dim
        self.causal, self.method, self.chunk_size = causal, method, chunk_size
        self.normalize, self.eps, self.dtype = normalize, eps, dtype
        self.sharding = nnx.data(sequence_sharding(sequence_axis, batch_axis, mesh, causal))
        options = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        qk_width, heads_in = num_heads * self.qk_dim, (sharding.EMBED, sharding.HEADS)
        self.q_proj = projection(width, qk_width, *heads_in, **options)
        self.k_proj = projection(width, qk_width, *heads_in, **options)
        self.v_proj = projection(width, width, *heads_in, **options)
        self.out_proj = projection(width, width, sharding.HEADS, sharding.EMBED, **options)
        self.decay = nnx.data(checks.parse_decay(decay, num_heads))
        # Built in this order: it fixes which parameters each RNG draw initialises.
        head_gate = HeadGate(width, num_heads, **options) if gate is True else None
        self.output_norm = nnx.data(
            None
            if normalize
            else nnx.RMSNorm(self.head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        )
        self.feature_map_name = feature_map if isinstance(feature_map, str) else None
        hedgehog, random_projection, self._feature_map = make_feature_map(
            feature_map,
            num_heads,
            self.qk_dim,
            num_features=num_features,
            max_length=max_length,
            form=hedgehog_form,
            rngs=rngs,
            param_dtype=param_dtype,
        )
        self.hedgehog, self.projection = nnx.data(hedgehog), nnx.data(random_projection)
        check_normalize(self.phi, normalize, name=feature_map)  # at construction
        self.feature_dim = fm.feature_dim(self.phi, self.qk_dim, num_heads)
        channel_gate = None
        if gate == "channel":
            channel_gate = ChannelGate(width, num_heads, self.feature_dim, **options)
        self.gate = nnx.data(channel_gate if head_gate is None else head_gate)
        # Last: its RNG stream (rate > 0) must not shift the parameters' initialisation.
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    @property
    def phi(self) -> Callable:
        """The feature map as a callable ``[..., h, d] -> [..., h, f]``."""
        if self.hedgehog is not None:
            return self.hedgehog
        if self.projection is not None:
            return RANDOM_FEATURES[self.feature_map_name](self.projection[...])
        return self._feature_map

    def redraw_features(self, key: jax.Array) -> None:
        """Draws a fresh random-feature projection (random-feature maps only)."""
        if self.projection is None:
            raise ValueError(f"feature map {self.feature_map_name!r} has no random features")
        m, d = self.projection.shape
        self.projection[...] = fm.orthogonal_gaussian(key, m, d)

    def init_state(self, batch: int, max_length: int | None = None) -> LinearAttentionCache:
        """The empty decoding state (``max_length`` is ignored: the state has a fixed size)."""
        del max_length
        check_can_decode(self)
        state = additive.init_state(batch, self.num_heads, self.feature_dim, self.head_dim)
        return LinearAttentionCache(state, jnp.zeros((batch,), jnp.int32))

    def __call__(
        self,
        x: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        key_mask: jax.Array | None = None,
        query_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: LinearAttentionCache | None = None,
        return_state: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``).

        With a ``state`` of a causal layer, a one-token ``x`` takes the O(1) step;
        a longer one (a prompt) is prefilled through the chunked form. The call
        follows ``nnx.MultiHeadAttention``'s where it applies: ``inputs_k`` and
        ``inputs_v`` (``[b, s, width]``) make a non-causal layer cross-attend
        (``key_mask [b, s]`` then masks them, ``query_mask [b, t]`` the queries);
        ``deterministic`` and ``rngs`` drive the output dropout.
        """
        check_decoding(self, state, return_state)
        check_state(state, LinearAttentionCache)
        x, (q, k, v), key_mask, query_mask = project_qkv(
            self, x, inputs_k, inputs_v, key_mask, query_mask
        )
        b, t, _ = x.shape
        gate = None if self.gate is None else self.gate(x)
        out, new_state = _attend(self, q, k, v, gate, state, key_mask, query_mask, segment_ids)
        if self.output_norm is not None:
            out = self.output_norm(out)
        out = self.dropout(out, deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.width))
        return (y, new_state) if return_state else y


def _check_options(
    width, num_heads, chunk_size, dropout_rate, causal, normalize, eps, feature_dim, method, gate
) -> None:
    """``LinearAttention``'s options that need no other piece built, or a ValueError."""
    check_width(width, num_heads)
    checks.check_chunk_size(chunk_size)
    check_dropout_rate(dropout_rate)
    checks.check_bool("causal", causal)
    checks.check_bool("normalize", normalize)
    checks.check_number("eps", eps, 0)
    if feature_dim is not None:
        checks.check_int("feature_dim", feature_dim, 1)
    if method not in additive.METHODS + additive.KERNEL_METHODS:
        raise ValueError(f"method must be one of {additive.METHODS} or 'pallas', got {method!r}")
    if not (isinstance(gate, bool) or (isinstance(gate, str) and gate == "channel")):
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")


def _attend(layer: LinearAttention, q, k, v, gate, state, key_mask, query_mask, segment_ids):
    """``(out [b, t, h, d], the new LinearAttentionCache or None)`` of ``layer`` on its
    projected ``q``, ``k``, ``v``: the non-causal form, or the causal one through
    ``run_causal`` (with the position of the next token)."""
    b, t = q.shape[:2]
    options = dict(feature_map=layer.phi, normalize=layer.normalize, eps=layer.eps)
    if not layer.causal:
        out = additive.noncausal(
            q, k, v, key_mask=key_mask, query_mask=query_mask, segment_ids=segment_ids, **options
        )
        return out, None
    position = None if state is None else state.position
    out, s = run_causal(
        additive, q, k, v, state=None if state is None else state.state, key_mask=key_mask,
        segment_ids=segment_ids, method=layer.method, chunk_size=layer.chunk_size,
        sharding=layer.sharding, gate=gate, options=dict(options, decay=layer.decay),
        step_options=dict(position=position),
        causal_options=dict(positions=positions(position, b, t, key_mask)),
    )  # fmt: skip
    return out, LinearAttentionCache(s, next_position(position, b, t, key_mask))
