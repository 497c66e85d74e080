"""Flax NNX layers over the maths: attention, blocks, and the learnable Hedgehog map.

Every layer takes ``*, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32`` like
Flax's own: parameters live in ``param_dtype``, computation runs in ``dtype``
(the input's when None), and linear attention's states stay float32 whatever
``dtype`` is. Decoding states are passed in and returned explicitly:

    state = layer.init_state(batch)
    y, state = layer(prompt, state=state, return_state=True)    # prefill, chunked form
    y, state = layer(next_token, state=state, return_state=True)  # one token, O(1) step
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax import attention as attn
from linattn_jax import checks, delta_layers, sequence_parallel
from linattn_jax import feature_maps as fm
from linattn_jax.layer_utils import check_int, check_tokens, check_width, split_heads

ATTENTION_KINDS = ("linear", "softmax", "gla", "deltanet", "gated_deltanet", "kda")
GATES = (False, True, "channel")
GLA_GATE_RANK = 16  # GLA's low-rank gate: width -> 16 -> h * f
GLA_GATE_NORMALIZER = 16.0  # log_sigmoid(.) / 16: slow decays at initialisation
RANDOM_FEATURES = {"favor_plus": fm.FavorPlus, "random_fourier": fm.RandomFourier}
HEDGEHOG_FORMS = ("softmax", "paper")


class RandomProjection(nnx.Variable):
    """A random-feature projection: drawn from ``rngs``, not trained (not an ``nnx.Param``)."""


class LinearAttentionCache(NamedTuple):
    """A ``LinearAttention`` layer's decoding state.

    Attributes:
      state: the recurrent (S, Z) state, ``s [b, h, f, v]``, ``z [b, h, f]``, float32.
      position: ``[b]`` int32, the number of real (not masked-out) tokens seen so
        far: the next token's position.
    """

    state: attn.LinearAttentionState
    position: jax.Array


class KVCache(NamedTuple):
    """A ``SoftmaxAttention`` layer's decoding state: keys and values seen so far.

    Attributes:
      k: ``[b, max_length, h, d]``.
      v: ``[b, max_length, h, d]``.
      position: ``[b]`` int32, the number of tokens written (the next slot).
      mask: ``[b, max_length]`` bool, True at slots holding a real key (written,
        and not masked out by the ``key_mask`` of the call that wrote it).
    """

    k: jax.Array
    v: jax.Array
    position: jax.Array
    mask: jax.Array


class HedgehogFeatureMap(nnx.Module):
    """Hedgehog (Zhang et al. 2024, "The Hedgehog & the Porcupine"): a learnable map.

    A per-head affine map initialised to the identity, ``y = x W_h + b_h``, then
    one of two forms (``form=``). f = 2d, positive in both.

    * ``"softmax"`` (the default; FLA's and Zoology's form, which use
      ``[2y, -2y]``, i.e. W and b doubled): ``phi(x) = softmax([y, -y])``,
      ``[exp(y), exp(-y)] / c(x)`` with ``c(x) = sum_i 2 cosh(y_i)``. Its kernel
      is the paper's divided by ``c(q) c(k)``: ``c(q)`` cancels under
      normalisation, ``c(k)`` does not, so normalised attention weights are
      ``K(q, k_j) / c(k_j)`` over their sum, each key reweighted by ``1 / c(k_j)``.
      Stable for any input.
    * ``"paper"`` (the paper's equation):
      ``phi(x) = [exp(y), exp(-y)]``, kernel
      ``K(q, k) = sum_i 2 cosh(y_q,i + y_k,i)``. Role-aware: a query's features
      are shifted by ``max_i |y_i|`` (``exp(y - max|y|)``, in (0, 1]), a per-query
      factor that cancels between numerator and denominator, so attention
      outputs are the paper's exactly, but only under normalisation
      (``requires_normalize``; ``eps`` is then relative to the shifted
      denominator). Queries can be any size. Keys are not shifted (a per-key
      factor would not cancel): in float32 a key's features are finite while
      ``|y_k| < 88.7`` (``log`` of float32's maximum), and the sums over t keys
      (the state, the denominator) while ``max |y_k| < 88.7 - log(2d t max|v|)``
      (about 73 for d = 64, t = 32k, ``|v| <= 1``). Normalise k (LayerNorm, l2) if
      trained keys can grow so far.

    Call on ``[..., h, d]`` (the heads axis second to last).

    Args:
      heads, head_dim: h and d.
      form: ``"softmax"`` or ``"paper"``.
      rngs, param_dtype: as in Flax (the identity initialisation draws nothing).
    """

    role_aware = True  # called as phi(x, is_query=...); only form="paper" uses it

    def __init__(
        self,
        heads: int,
        head_dim: int,
        *,
        form: str = "softmax",
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        del rngs  # identity initialisation: nothing random
        if form not in HEDGEHOG_FORMS:
            raise ValueError(f"form must be one of {HEDGEHOG_FORMS}, got {form!r}")
        check_int("heads", heads, 1)
        check_int("head_dim", head_dim, 1)
        self.form = form
        eye = jnp.broadcast_to(jnp.eye(head_dim, dtype=param_dtype), (heads, head_dim, head_dim))
        self.kernel = nnx.Param(eye)
        self.bias = nnx.Param(jnp.zeros((heads, head_dim), param_dtype))

    @property
    def requires_normalize(self) -> bool:
        """True for ``form="paper"``: its query shift cancels only under normalisation."""
        return self.form == "paper"

    def __call__(self, x: jax.Array, is_query: bool = False) -> jax.Array:
        """``x [..., h, d] -> [..., h, 2d]``, float32 (float64 for float64 inputs)."""
        heads, d, _ = self.kernel.shape
        if x.shape[-2:] != (heads, d):
            raise ValueError(
                f"HedgehogFeatureMap expects [..., heads={heads}, d={d}], got {x.shape}"
            )
        x = fm.upcast(x)
        y = jnp.einsum("...hd,hde->...he", x, self.kernel[...].astype(x.dtype))
        bias = self.bias[...].astype(x.dtype)
        y = y + bias.reshape((1,) * (y.ndim - 2) + bias.shape)
        both = jnp.concatenate([y, -y], axis=-1)
        if self.form == "softmax":
            return jax.nn.softmax(both, axis=-1)
        if is_query:
            both = both - jax.lax.stop_gradient(jnp.max(both, axis=-1, keepdims=True))
        return jnp.exp(both)


def _make_feature_map(feature_map, heads: int, d: int, *, num_features, max_length, form, **kw):
    """``(hedgehog, projection, fixed)`` for ``LinearAttention``: exactly one is not None.

    ``kw``: ``rngs`` and ``param_dtype``. Raises on an unknown name or bad options.
    """
    # Validated whatever the map; like max_length, ignored by maps they do not apply to
    # (an experiment passes one set of options to every map it sweeps).
    if num_features is not None:
        check_int("num_features", num_features, 1)
    if form not in HEDGEHOG_FORMS:
        raise ValueError(f"hedgehog_form must be one of {HEDGEHOG_FORMS}, got {form!r}")
    if feature_map == "hedgehog":
        return HedgehogFeatureMap(heads, d, form=form, **kw), None, None
    if feature_map in RANDOM_FEATURES:
        draw = fm.orthogonal_gaussian(kw["rngs"].params(), num_features or 2 * d, d)
        return None, RandomProjection(draw), None
    if feature_map == "cosformer":
        return None, None, fm.cosformer(max_length)
    return None, None, fm.get(feature_map)  # raises on unknown names


def _positions(
    position: jax.Array | None, b: int, t: int, key_mask: jax.Array | None = None
) -> jax.Array:
    """``[b, t]`` positions from ``position [b]`` on; with a ``key_mask``, only real
    tokens count (a left-padded prompt's first real token sits where it would alone)."""
    start = jnp.zeros((b,), jnp.int32) if position is None else position
    if key_mask is None or key_mask.shape != (b, t):  # a bad mask: the maths reports it
        return start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return start[:, None] + jnp.cumsum(key_mask, axis=1, dtype=jnp.int32) - 1


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
      method: causal form, ``"chunked"``, ``"scan"`` or ``"quadratic"``.
      chunk_size: tokens per chunk.
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
      rngs, dtype, param_dtype: as in Flax.

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
        chunk_size: int = 64,
        decay: None | str | float | Sequence[float] = None,
        gate: bool | str = False,
        normalize: bool = True,
        num_features: int | None = None,
        max_length: int = 4096,
        hedgehog_form: str = "softmax",
        feature_dim: int | None = None,
        sequence_axis: str | None = None,
        batch_axis: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        eps: float = 1e-6,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
    ):
        check_width(width, num_heads)
        check_int("chunk_size", chunk_size, 1)
        _check_dropout_rate(dropout_rate)
        if feature_dim is not None:
            check_int("feature_dim", feature_dim, 1)
        if method not in attn.METHODS:
            raise ValueError(f"method must be one of {attn.METHODS}, got {method!r}")
        if not (isinstance(gate, bool) or (isinstance(gate, str) and gate == "channel")):
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        self.width, self.num_heads, self.head_dim = width, num_heads, width // num_heads
        self.qk_dim = self.head_dim if feature_dim is None else feature_dim
        self.causal, self.method, self.chunk_size = causal, method, chunk_size
        self.normalize, self.eps, self.dtype = normalize, eps, dtype
        if sequence_axis is not None and not causal:
            raise ValueError("sequence_axis needs a causal layer (causal=True)")
        self.sequence_axis, self.batch_axis, self.mesh = sequence_axis, batch_axis, mesh
        linear = lambda n_out, **kw: nnx.Linear(
            width, n_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **kw
        )
        qk_width = num_heads * self.qk_dim
        self.q_proj, self.k_proj = (linear(qk_width, use_bias=False) for _ in range(2))
        self.v_proj, self.out_proj = (linear(width, use_bias=False) for _ in range(2))
        self.decay = nnx.data(self._decay(decay))
        # Optional parts: None or a module, each assigned once.
        self.gate_proj = nnx.data(
            linear(num_heads, bias_init=nnx.initializers.constant(3.0)) if gate is True else None
        )
        self.output_norm = nnx.data(
            None
            if normalize
            else nnx.RMSNorm(self.head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        )
        self.feature_map_name = feature_map if isinstance(feature_map, str) else None
        hedgehog, projection, self._feature_map = _make_feature_map(
            feature_map,
            num_heads,
            self.qk_dim,
            num_features=num_features,
            max_length=max_length,
            form=hedgehog_form,
            rngs=rngs,
            param_dtype=param_dtype,
        )
        self.hedgehog, self.projection = nnx.data(hedgehog), nnx.data(projection)
        attn.check_normalize(self.phi, normalize, name=feature_map)  # at construction
        self.feature_dim = fm.feature_dim(self.phi, self.qk_dim, num_heads)
        self.channel_gate = nnx.data(
            nnx.Sequential(
                linear(GLA_GATE_RANK, use_bias=False),
                nnx.Linear(
                    GLA_GATE_RANK,
                    num_heads * self.feature_dim,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    rngs=rngs,
                ),
            )
            if gate == "channel"
            else None
        )
        # Last: its RNG stream (rate > 0) must not shift the parameters' initialisation.
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    def _decay(self, decay) -> jax.Array | None:
        if decay is None:
            return None
        if isinstance(decay, str):
            if decay != "retnet":
                raise ValueError(f"decay must be None, 'retnet', a float or [heads], got {decay!r}")
            return 1.0 - 2.0 ** (-5.0 - jnp.arange(self.num_heads, dtype=jnp.float32))
        try:
            gamma = np.asarray(decay, np.float32)
        except (TypeError, ValueError):
            gamma = None
        if gamma is None or gamma.shape not in ((), (self.num_heads,)):
            raise ValueError(
                f"decay must be None, 'retnet', a float or one per head "
                f"[num_heads={self.num_heads}], got {decay!r}"
            )
        if not np.all((gamma > 0) & (gamma <= 1)):
            raise ValueError(f"decay must lie in (0, 1], got {decay!r}")
        return jnp.broadcast_to(jnp.asarray(gamma), (self.num_heads,))

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
        if not self.causal:
            raise ValueError("decoding needs a causal layer (causal=True)")
        state = attn.init_state(batch, self.num_heads, self.feature_dim, self.head_dim)
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
        if (state is not None or return_state) and not self.causal:
            raise ValueError("decoding (state=, return_state=) needs a causal layer (causal=True)")
        x, (q, k, v), key_mask, query_mask = _project_qkv(
            self, x, inputs_k, inputs_v, key_mask, query_mask
        )
        b, t, _ = x.shape
        gate = None
        if self.gate_proj is not None:
            gate = jax.nn.log_sigmoid(self.gate_proj(x).astype(jnp.float32))
        elif self.channel_gate is not None:
            logits = split_heads(self.channel_gate(x).astype(jnp.float32), self.num_heads)
            gate = jax.nn.log_sigmoid(logits) / GLA_GATE_NORMALIZER  # [b, t, h, f]
        phi = self.phi
        if not self.causal:
            out = attn.linear_attention(
                q,
                k,
                v,
                feature_map=phi,
                key_mask=key_mask,
                query_mask=query_mask,
                segment_ids=segment_ids,
                normalize=self.normalize,
                eps=self.eps,
            )
            new_state = None
        else:
            position = None if state is None else state.position
            if state is not None and t == 1 and key_mask is None and segment_ids is None:
                out, s = attn.causal_linear_attention_step(
                    q[:, 0],
                    k[:, 0],
                    v[:, 0],
                    state.state,
                    feature_map=phi,
                    decay=self.decay,
                    gate=None if gate is None else gate[:, 0],
                    position=position,
                    normalize=self.normalize,
                    eps=self.eps,
                )
                out = out[:, None]
            elif self.sequence_axis is not None and state is None:
                if key_mask is not None or segment_ids is not None:
                    raise ValueError("a sequence-parallel layer takes no key_mask or segment_ids")
                out, s = sequence_parallel.sequence_parallel_causal_linear_attention(
                    q,
                    k,
                    v,
                    axis_name=self.sequence_axis,
                    batch_axis=self.batch_axis,
                    mesh=self.mesh,
                    feature_map=phi,
                    chunk_size=self.chunk_size,
                    return_state=True,
                    decay=self.decay,
                    gate=gate,
                    normalize=self.normalize,
                    eps=self.eps,
                )
            else:
                out, s = attn.causal_linear_attention(
                    q,
                    k,
                    v,
                    feature_map=phi,
                    method=self.method,
                    chunk_size=self.chunk_size,
                    initial_state=None if state is None else state.state,
                    return_state=True,
                    key_mask=key_mask,
                    decay=self.decay,
                    gate=gate,
                    segment_ids=segment_ids,
                    positions=_positions(position, b, t, key_mask),
                    normalize=self.normalize,
                    eps=self.eps,
                )
            start = jnp.zeros((b,), jnp.int32) if position is None else position
            seen = t if key_mask is None else jnp.sum(key_mask, axis=1, dtype=jnp.int32)
            new_state = LinearAttentionCache(s, start + seen)
        if self.output_norm is not None:
            out = self.output_norm(out)
        out = self.dropout(out, deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.width))
        return (y, new_state) if return_state else y


class SoftmaxAttention(nnx.Module):
    """Multi-head softmax attention (``jax.nn.dot_product_attention``), same call as
    ``LinearAttention``, with a KV cache for decoding; for like-for-like comparisons.

    Args:
      width, num_heads, causal, dropout_rate: as in ``LinearAttention``.
      max_length: the KV cache's length (decoding only).
      rngs, dtype, param_dtype: as in Flax.
      **linear_options: ``LinearAttention``'s own options (``LINEAR_ONLY_OPTIONS``),
        accepted and ignored so that one set of options builds either kind; any
        other keyword raises ``TypeError``.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        causal: bool = True,
        max_length: int = 4096,
        dropout_rate: float = 0.0,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **linear_options: Any,
    ):
        # One set of options builds any kind (make_attention): linear attention's
        # are accepted and ignored here, anything else is a mistake.
        unknown = sorted(set(linear_options) - LINEAR_ONLY_OPTIONS)
        if unknown:
            raise TypeError(f"SoftmaxAttention got unexpected keyword arguments {unknown}")
        check_width(width, num_heads)
        _check_dropout_rate(dropout_rate)
        self.width, self.num_heads, self.head_dim = width, num_heads, width // num_heads
        self.causal, self.max_length = causal, max_length
        linear = lambda: nnx.Linear(
            width, width, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (linear() for _ in range(4))
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs if dropout_rate > 0 else None)

    def init_state(self, batch: int, max_length: int | None = None) -> KVCache:
        """An empty KV cache of ``max_length`` (the layer's by default) tokens."""
        if not self.causal:
            raise ValueError("decoding needs a causal layer (causal=True)")
        n = max_length or self.max_length
        shape = (batch, n, self.num_heads, self.head_dim)
        zeros = jnp.zeros(shape)
        return KVCache(
            zeros, zeros, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, n), jnp.bool_)
        )

    def __call__(
        self,
        x: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        key_mask: jax.Array | None = None,
        query_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: KVCache | None = None,
        return_state: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new KV cache if ``return_state``).

        With a ``state``, ``x`` is written to the cache after the tokens already
        there; keys masked out by ``key_mask`` stay masked for every later call.
        ``inputs_k``, ``inputs_v``, ``query_mask``, ``deterministic`` and ``rngs`` as
        in ``LinearAttention`` (cross-attention for non-causal layers).

        Raises:
          ValueError: the tokens would not fit in the cache (``t`` longer than it,
            or, when ``state.position`` is concrete, ``position + t`` past its end).
            Under ``jit`` the position is not known: rows that overflow get NaN outputs.
        """
        if (state is not None or return_state) and not self.causal:
            raise ValueError("decoding (state=, return_state=) needs a causal layer (causal=True)")
        x, (q, k, v), key_mask, query_mask = _project_qkv(
            self, x, inputs_k, inputs_v, key_mask, query_mask
        )
        b, t, _ = x.shape
        if segment_ids is not None and k.shape[1] != t:
            raise ValueError("segment_ids needs self-attention (no inputs_k / inputs_v)")
        allowed = jnp.ones((b, t, k.shape[1]), bool)
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, :]
        if segment_ids is not None:
            allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
        if self.causal:
            allowed = allowed & jnp.tril(jnp.ones((1, t, t), bool))
        new_state = None
        if state is not None or return_state:
            if segment_ids is not None:
                raise ValueError("SoftmaxAttention takes no segment_ids with a KV cache")
            if state is None:
                state = self.init_state(b, max(t, self.max_length))
            n = state.k.shape[1]
            overflow = _check_cache_room(state.position, t, n)
            write = jax.vmap(
                lambda cache, new, i: jax.lax.dynamic_update_slice_in_dim(
                    cache, new.astype(cache.dtype), i, axis=0
                )
            )
            k_all, v_all = write(state.k, k, state.position), write(state.v, v, state.position)
            real = jnp.ones((b, t), bool) if key_mask is None else key_mask
            mask = write(state.mask, real, state.position)  # padding stays masked from now on
            query_pos = _positions(state.position, b, t)  # [b, t]
            allowed = jnp.arange(n)[None, None, :] <= query_pos[:, :, None]
            allowed = allowed & mask[:, None, :]
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
            new_state = KVCache(k_all, v_all, state.position + t, mask)
        # Scores and softmax in float32, like linear attention's sums.
        f32 = lambda a: a.astype(jnp.float32)
        out = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), mask=allowed[:, None])
        if new_state is not None:  # a write past the cache's end overwrote its last slots
            out = jnp.where(overflow[:, None, None, None], jnp.nan, out)
        out = checks.where_token(query_mask, out)  # a padded query's output is 0
        out = self.dropout(out.astype(q.dtype), deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.width))
        return (y, new_state) if return_state else y


LINEAR_ONLY_OPTIONS = frozenset(
    (
        "feature_map", "method", "chunk_size", "decay", "gate", "normalize", "num_features",
        "hedgehog_form", "feature_dim", "sequence_axis", "batch_axis", "mesh", "eps",
    )
)  # fmt: skip


def _check_dropout_rate(rate) -> None:
    """A rate in [0, 1). The layers' ``nnx.Dropout`` holds an RNG stream only when the
    rate is above 0, so a layer without dropout has no RNG state."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ValueError(f"dropout_rate must be a number in [0, 1), got {rate!r}")


def _project_qkv(layer, x, inputs_k, inputs_v, key_mask, query_mask):
    """``(x, (q, k, v), key_mask, query_mask)`` of a layer with q/k/v projections.

    Self-attention unless ``inputs_k`` / ``inputs_v`` are given (cross-attention,
    non-causal layers only; ``inputs_v`` defaults to ``inputs_k``). In
    self-attention ``key_mask`` masks the queries too. Padding is replaced by zeros
    before the projections, so a NaN there reaches no output or gradient.
    """
    check_tokens(x, layer.width)
    b, t, _ = x.shape
    cross = inputs_k is not None or inputs_v is not None
    if cross:
        if layer.causal:
            raise ValueError("inputs_k / inputs_v (cross-attention) need causal=False")
        inputs_k = x if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        for name, y in [("inputs_k", inputs_k), ("inputs_v", inputs_v)]:
            if y.ndim != 3 or y.shape[0] != b or y.shape[-1] != layer.width:
                raise ValueError(
                    f"{name} must have shape [batch={b}, key_length, {layer.width}], got {y.shape}"
                )
        if inputs_k.shape != inputs_v.shape:
            raise ValueError(f"inputs_k {inputs_k.shape} and inputs_v {inputs_v.shape} differ")
    else:
        inputs_k = inputs_v = x
    key_mask = checks.token_mask("key_mask", key_mask, b, inputs_k.shape[1])
    query_mask = checks.token_mask("query_mask", query_mask, b, t)
    if query_mask is None:
        query_mask = jnp.ones((b, t), bool) if cross and key_mask is not None else key_mask
    x = checks.where_token(query_mask, x)
    heads = lambda proj, y, mask: split_heads(proj(checks.where_token(mask, y)), layer.num_heads)
    qkv = (heads(layer.q_proj, x, None), heads(layer.k_proj, inputs_k, key_mask))
    return x, (*qkv, heads(layer.v_proj, inputs_v, key_mask)), key_mask, query_mask


def _check_cache_room(position: jax.Array, t: int, n: int) -> jax.Array:
    """``[b]`` bool, True for rows whose ``t`` new tokens would not fit in ``n`` slots.

    Raises where that is known before running: ``t > n``, or a concrete ``position``.
    """
    if t > n:
        raise ValueError(f"the KV cache holds {n} tokens, got {t} at once (x's length)")
    if not isinstance(position, jax.core.Tracer) and int(jnp.max(position)) + t > n:
        raise ValueError(
            f"the KV cache holds {n} tokens: {int(jnp.max(position))} written, "
            f"{t} more do not fit (make the cache longer: init_state(batch, max_length))"
        )
    return position + t > n


def make_attention(kind: str, width: int, num_heads: int, **kwargs) -> nnx.Module:
    """An attention layer of ``kind`` (one of ``ATTENTION_KINDS``) from one set of options.

    ``"linear"``: ``LinearAttention``; ``"softmax"``: ``SoftmaxAttention``; ``"gla"``:
    ``LinearAttention`` with GLA's per-channel gate (``gate="channel"``), by default
    over the identity map without a denominator (``feature_map="identity"``,
    ``normalize=False``: an output RMSNorm per head); ``"deltanet"``,
    ``"gated_deltanet"``, ``"kda"``: ``delta_layers.DeltaRuleAttention`` of that variant.
    """
    if kind == "linear":
        return LinearAttention(width, num_heads, **kwargs)
    if kind == "softmax":
        return SoftmaxAttention(width, num_heads, **kwargs)
    if kind == "gla":
        if kwargs.get("gate", "channel") != "channel":
            raise ValueError(f"gla's gate is 'channel', got gate={kwargs['gate']!r}")
        kwargs = {"feature_map": "identity", "normalize": False, **kwargs, "gate": "channel"}
        return LinearAttention(width, num_heads, **kwargs)
    if kind in ("deltanet", "gated_deltanet", "kda"):
        return delta_layers.DeltaRuleAttention(width, num_heads, variant=kind, **kwargs)
    raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")


class MLP(nnx.Module):
    """``Linear -> gelu -> Linear`` with hidden width ``hidden``."""

    def __init__(
        self, width: int, hidden: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32
    ):
        self.up = nnx.Linear(width, hidden, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class ShortConv(nnx.Module):
    """Depthwise causal convolution over time, kernel ``size`` (Zoology's BaseConv,
    H3/Based's short convolution): lets attention see the previous few tokens,
    which recall tasks need. Initialised to the identity plus small noise.

    Decoding keeps the last ``size - 1`` inputs as its state.
    """

    def __init__(self, width: int, size: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        check_int("width", width, 1)
        check_int("size", size, 1)
        kernel = 0.02 * jax.random.normal(rngs.params(), (size, width), param_dtype)
        self.kernel = nnx.Param(kernel.at[-1].add(1.0))
        self.size = size

    def init_state(self, batch: int, width: int, dtype=jnp.float32) -> jax.Array:
        return jnp.zeros((batch, self.size - 1, width), dtype)

    def __call__(self, x: jax.Array, state: jax.Array | None = None):
        """``x [b, t, w]`` (and the last ``size - 1`` inputs) -> ``(y [b, t, w], new state)``."""
        b, t, w = x.shape
        past = self.init_state(b, w, x.dtype) if state is None else state.astype(x.dtype)
        padded = jnp.concatenate([past, x], axis=1)
        kernel = self.kernel[...].astype(x.dtype)
        y = sum(kernel[i][None, None] * padded[:, i : i + t] for i in range(self.size))
        return y, padded[:, t:]


class BlockState(NamedTuple):
    """A ``TransformerBlock``'s decoding state: its attention's and its convolution's."""

    attention: Any
    conv: jax.Array | None


class TransformerBlock(nnx.Module):
    """Pre-norm block: ``x + attn(conv(norm(x)))``, then ``x + mlp(norm(x))``.

    Args:
      width, num_heads: as in the attention layers.
      attention: one of ``ATTENTION_KINDS`` (``make_attention``): ``"linear"``, ``"softmax"``,
        ``"gla"``, ``"deltanet"``, ``"gated_deltanet"`` or ``"kda"``.
      mlp_ratio: the MLP's hidden width over ``width``.
      short_conv: kernel size of a causal depthwise convolution before attention
        (0: none); causal blocks only.
      **attention_kwargs: passed to the attention layer (``feature_map``, ``causal``, ...).
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        attention: str = "linear",
        mlp_ratio: int = 4,
        short_conv: int = 0,
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=jnp.float32,
        **attention_kwargs,
    ):
        check_width(width, num_heads)
        check_int("mlp_ratio", mlp_ratio, 1)
        check_int("short_conv", short_conv, 0)
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if short_conv and not attention_kwargs.get("causal", True):
            raise ValueError("short_conv is causal: use it in causal blocks only")
        norm = lambda: nnx.RMSNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attention_norm, self.mlp_norm = norm(), norm()
        self.conv = nnx.data(
            ShortConv(width, short_conv, rngs=rngs, param_dtype=param_dtype) if short_conv else None
        )
        self.attention = make_attention(
            attention,
            width,
            num_heads,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            **attention_kwargs,
        )
        self.mlp = MLP(width, mlp_ratio * width, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.width = width

    def init_state(self, batch: int, max_length: int | None = None) -> BlockState:
        conv = None if self.conv is None else self.conv.init_state(batch, self.width)
        return BlockState(self.attention.init_state(batch, max_length), conv)

    def __call__(self, x, *, key_mask=None, segment_ids=None, state=None, return_state=False):
        h = self.attention_norm(x)
        conv_state = None
        if self.conv is not None:
            if key_mask is not None:  # padding must not reach the next tokens' window
                h = jnp.where(key_mask[..., None], h, 0.0)
            h, conv_state = self.conv(h, None if state is None else state.conv)
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
        x = x + h
        x = x + self.mlp(self.mlp_norm(x))
        return (x, state) if return_state else x
