"""Softmax attention made linear: a pretrained softmax layer's projections, QK-norms and RoPE
kept as they are, its ``softmax(s q kᵀ)`` replaced by learned feature maps (Hedgehog, T2R),
optionally gated (GLA-style decays: Liger) or mixed with exact softmax inside a sliding
window (LoLCATs' hybrid form).

Per head, with ``s`` softmax's scale (``head_dim^-1/2``), the teacher's q, k, v (after its
QK-norm and RoPE; GQA's key and value heads repeated over their groups), ``Q`` and ``K``
the learned maps of queries and keys::

    phi_q, phi_k = Q(sqrt(s) q), K(sqrt(s) k)
    y_i = sum_{j <= i} (phi_q_i . phi_k_j) v_j / sum_{j <= i} phi_q_i . phi_k_j

With a window of ``w`` tokens the ``w`` latest keys keep softmax's own weights::

    a_ij = gamma exp(s q_i . k_j - m_i)    for i - w < j <= i   (m_i: their largest score)
    a_ij = phi_q_i . phi_k_j               for j <= i - w
    y_i  = sum_j a_ij v_j / sum_j a_ij,     gamma = sigmoid(window_factor), one per head

so a window as long as the sequence is softmax attention exactly. The windowed form runs the
linear part as the chunked form over keys delayed by ``w`` tokens and the window in blocks
of ``w`` queries against ``2 w`` keys: O(t w) time and memory, no ``[t, t]`` array.
``attention_weights`` gives both layers' ``[t, t]`` weights (Hedgehog's attention-transfer
loss, and the reference the fast forms are tested against).

References: Zhang et al. 2024, "The Hedgehog & the Porcupine"; Kasai et al. 2021,
"Finetuning Pretrained Transformers into RNNs" (T2R); Zhang et al. 2025, "LoLCATs"; Lan et
al. 2025, "Liger: Linearizing Large Language Models to Gated Recurrent Structures".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers import rope as rope_lib
from linattn_jax.layers.common import check_decoding, check_state, project_qkv
from linattn_jax.layers.feature_maps import HedgehogFeatureMap, T2RFeatureMap
from linattn_jax.layers.gates import ChannelGate, HeadGate
from linattn_jax.layers.recurrent import run_causal
from linattn_jax.layers.softmax import LINEAR_ONLY_OPTIONS, SoftmaxAttention
from linattn_jax.ops import additive, checks
from linattn_jax.ops import feature_maps as fm
from linattn_jax.ops.additive.inputs import features

LEARNED_MAPS = ("hedgehog", "t2r")
LINEARIZED_GATES = (None, "head", "channel")


class LinearizedCache(NamedTuple):
    """A ``LinearizedAttention`` layer's decoding state (without a window).

    Attributes:
      state: the recurrent (S, Z) state, ``s [b, h, f, v]``, ``z [b, h, f]``, float32.
      position: ``[b]`` int32, the real tokens seen so far: the next one's RoPE position.
    """

    state: additive.State
    position: jax.Array


@dataclasses.dataclass(frozen=True)
class RoleMaps:
    """Two feature maps as one role-aware map (``phi(x, is_query=...)``): queries through
    ``query``, keys through ``key``."""

    query: Callable[[jax.Array], jax.Array]
    key: Callable[[jax.Array], jax.Array]
    role_aware = True

    def __call__(self, x: jax.Array, is_query: bool = False) -> jax.Array:
        return self.query(x) if is_query else self.key(x)


class LinearizedAttention(SoftmaxAttention):
    """``SoftmaxAttention``'s parameters and call with a linear-attention core (the module
    docstring's equations): the student layer of a linearised transformer. Its own
    parameters are the feature maps (``q_map``, ``k_map``), the gate and the window's
    factor; the projections, norms and RoPE are the softmax layer's, so a softmax layer's
    state loads into it as it is (``experiments.linearize``).

    Args:
      width: model width (input and output features).
      num_heads: query heads.
      feature_map: ``"hedgehog"`` (learned, identity at initialisation: ``[b, t, h, 2d]``
        features), ``"t2r"`` (learned ``relu(x W + b)``, ``num_features`` per head) or the
        name of a registered map with a non-negative kernel (``"elu"``, ``"relu"``, ...).
      num_features: T2R's features per head (default ``head_dim``); other maps ignore it.
      gate: None, ``"head"`` (a learned log-decay per head and token) or ``"channel"``
        (GLA's per feature channel): the gated form of Liger and GLA.
      window: None, or ``w``: softmax's own weights on the latest ``w`` keys (LoLCATs);
        takes no gate, no ``segment_ids`` and no decoding.
      method: the linear part's form, as in ``linattn_jax.ops.additive.causal``.
      chunk_size: tokens per chunk; None: the family's default.
      eps: the denominator's epsilon (without a window).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's), as in Flax.
      param_dtype: the parameters' dtype, as in Flax.
      **softmax_options: ``SoftmaxAttention``'s (``num_kv_heads``, ``head_dim``, ``rope``,
        ``qk_norm``, ``output_gate``, ``scale``, ...), but ``sliding_window`` and
        ``causal=False``.

    Raises:
      ValueError: an unknown or signed feature map, gate or method; a window that is not a
        positive int, or one with a gate; ``sliding_window``, ``causal=False`` or another
        linear layer's option; what ``SoftmaxAttention`` refuses.
    """

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        feature_map: str = "hedgehog",
        num_features: int | None = None,
        gate: str | None = None,
        window: int | None = None,
        method: str = "chunked",
        chunk_size: int | None = None,
        eps: float = 1e-6,
        rngs: nnx.Rngs,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        **softmax_options: Any,
    ):
        refused = sorted(set(softmax_options) & LINEAR_ONLY_OPTIONS)
        if softmax_options.get("sliding_window") is not None:
            refused.append("sliding_window")
        if softmax_options.get("causal", True) is not True:
            refused.append("causal")
        if refused:
            raise ValueError(f"LinearizedAttention takes no {refused} (got {softmax_options})")
        super().__init__(
            width, num_heads, rngs=rngs, dtype=dtype, param_dtype=param_dtype, **softmax_options
        )
        _check_options(gate, method, chunk_size, eps, window)
        self.window, self.method, self.chunk_size, self.eps = window, method, chunk_size, eps
        self.feature_map_name = feature_map
        h, d = self.num_heads, self.head_dim
        maps = dict(rngs=rngs, param_dtype=param_dtype)
        q_map = k_map = None
        if feature_map == "hedgehog":
            q_map, k_map = HedgehogFeatureMap(h, d, **maps), HedgehogFeatureMap(h, d, **maps)
        elif feature_map == "t2r":
            f = d if num_features is None else num_features
            q_map, k_map = T2RFeatureMap(h, d, f, **maps), T2RFeatureMap(h, d, f, **maps)
        else:
            phi = fm.get(feature_map)  # raises on unknown names
            if getattr(phi, "signed", False) or getattr(phi, "requires_normalize", False):
                raise ValueError(
                    f"feature_map must have a non-negative kernel, got {feature_map!r}"
                )
        self.q_map, self.k_map = nnx.data(q_map), nnx.data(k_map)
        self.feature_dim = fm.feature_dim(self.phi, d, h)
        options = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate = nnx.data(
            HeadGate(width, h, **options)
            if gate == "head"
            else ChannelGate(width, h, self.feature_dim, **options)
            if gate == "channel"
            else None
        )
        self.window_factor = nnx.data(
            None if window is None else nnx.Param(jnp.zeros((h,), param_dtype))
        )

    @property
    def phi(self) -> Callable:
        """The feature map ``[..., h, d] -> [..., h, f]`` (learned: ``RoleMaps``)."""
        if self.q_map is None:
            return fm.get(self.feature_map_name)
        return RoleMaps(self.q_map, self.k_map)

    def init_state(self, batch: int, max_length: int | None = None) -> LinearizedCache:
        """The empty decoding state (``max_length`` ignored: the state has a fixed size)."""
        del max_length
        if self.window is not None:
            raise ValueError(
                f"decoding a windowed LinearizedAttention (window={self.window}) is not supported"
            )
        state = additive.init_state(batch, self.num_heads, self.feature_dim, self.head_dim)
        return LinearizedCache(state, jnp.zeros((batch,), jnp.int32))

    def heads(self, x, key_mask=None, segment_ids=None, start=None):
        """``(x, q, k, v, output gate or None, key_mask)``: q, k, v ``[b, t, h, d]`` float32
        after the QK-norms and RoPE (positions from ``start [b]``), k and v repeated from the
        key-value heads to every query head, q and k times ``sqrt(scale)``."""
        x, (q, k, v), key_mask, _ = project_qkv(self, x, None, None, key_mask, None)
        b, t, _ = x.shape
        gate = None
        if self.output_gate:
            q, gate = jnp.split(q, 2, axis=-1)
        q, k, v = (y.astype(jnp.float32) for y in (q, k, v))
        if self.q_norm is not None and self.qk_norm_over_heads:
            over = lambda norm, y: norm(y.reshape(*y.shape[:2], -1)).reshape(y.shape)
            q, k = over(self.q_norm, q), over(self.k_norm, k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim is not None:
            pos = rope_lib.token_positions(
                b, t, key_mask=key_mask, segment_ids=segment_ids, start=start
            )
            q, k = (
                rope_lib.apply_rope(y, pos, self.rotary_dim, self.rope_theta, self.rope_scaling)
                for y in (q, k)
            )
        groups = self.num_heads // self.num_kv_heads
        k, v = (jnp.repeat(y, groups, axis=2) for y in (k, v))
        root = math.sqrt(self.scale if self.scale is not None else self.head_dim**-0.5)
        return x, q * root, k * root, v, gate, key_mask

    def __call__(
        self,
        x: jax.Array,
        *,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        state: LinearizedCache | None = None,
        return_state: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        """``x [b, t, width] -> [b, t, width]`` (and the new state if ``return_state``);
        decoding as ``LinearAttention``'s (a one-token ``x`` with a state: the O(1) step).

        Raises:
          ValueError: a state of another type; a windowed layer given ``segment_ids``,
            ``state`` or ``return_state``.
        """
        check_state(state, LinearizedCache)
        check_decoding(self, state, return_state)
        if self.window is not None and (
            segment_ids is not None or state is not None or return_state
        ):
            raise ValueError(
                f"a windowed LinearizedAttention (window={self.window}) takes no segment_ids, "
                "state or return_state"
            )
        start = None if state is None else state.position
        x, q, k, v, out_gate, key_mask = self.heads(x, key_mask, segment_ids, start)
        b, t, _ = x.shape
        new_state = None
        if self.window is not None:
            out = windowed(self, q, k, v, key_mask)
        else:
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
                sharding=None,
                gate=None if self.gate is None else self.gate(x),
                options=dict(feature_map=self.phi, normalize=True, eps=self.eps),
            )
            seen = t if key_mask is None else jnp.sum(key_mask, axis=1, dtype=jnp.int32)
            position = jnp.zeros((b,), jnp.int32) if start is None else start
            new_state = LinearizedCache(s, position + seen)
        out = checks.where_token(key_mask, out)
        if out_gate is not None:
            out = out * jax.nn.sigmoid(out_gate.astype(jnp.float32))
        out = self.dropout(out.astype(x.dtype), deterministic=deterministic, rngs=rngs)
        y = self.out_proj(out.reshape(b, t, self.num_heads * self.head_dim))
        return (y, new_state) if return_state else y

    def attention_weights(self, x, key_mask=None):
        """``(softmax's, this layer's)`` attention weights ``[b, h, t, t]`` float32 on ``x
        [b, t, width]`` (rows of padded queries 0): quadratic, for the transfer loss and as a
        reference. A gated layer's are refused (its weights hold decays)."""
        return attention_weights(self, x, key_mask)


def windowed(layer: LinearizedAttention, q, k, v, key_mask) -> jax.Array:
    """A windowed ``layer``'s output ``[b, t, h, d]`` float32 from its ``heads``' q, k, v:
    softmax over each query's latest ``window`` keys beside the linear sum of the older ones."""
    w = layer.window
    phi_q, phi_k, v = features(q, k, v, layer.phi, key_mask, key_mask, heads_first=False)
    delay = lambda y: jnp.pad(y, ((0, 0), (w, 0), (0, 0), (0, 0)))[:, : y.shape[1]]
    ones = jnp.ones(v.shape[:-1] + (1,), v.dtype)
    old = additive.causal(
        phi_q, delay(phi_k), delay(jnp.concatenate([v, ones], axis=-1)),
        method=layer.method, chunk_size=layer.chunk_size, feature_map="identity",
        normalize=False,
    )  # fmt: skip
    numerator, denominator = window_sums(q, k, v, key_mask, w)
    gamma = jax.nn.sigmoid(layer.window_factor[...].astype(jnp.float32))[None, None]
    numerator = gamma[..., None] * numerator + old[..., :-1]
    denominator = gamma * denominator + old[..., -1]
    # A real query sees itself at weight gamma: the denominator is never 0 there.
    safe = jnp.where(denominator > 0, denominator, 1.0)
    return numerator / safe[..., None]


def attention_weights(layer: LinearizedAttention, x, key_mask=None):
    """``LinearizedAttention.attention_weights``: ``(softmax's, the layer's)`` weights
    ``[b, h, t, t]`` float32."""
    if layer.gate is not None:
        raise ValueError("attention_weights: a gated layer's weights are not computed")
    _, q, k, _, _, key_mask = layer.heads(x, key_mask)
    b, t = q.shape[:2]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    seen = jnp.broadcast_to((j <= i)[None, None], (b, 1, t, t))
    if key_mask is not None:
        seen = seen & key_mask[:, None, None, :] & key_mask[:, None, :, None]
    scores = jnp.einsum("bthd,bshd->bhts", q, k)
    teacher = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
    phi_q, phi_k, _ = features(q, k, k, layer.phi, key_mask, key_mask)
    student = jnp.where(seen, jnp.einsum("bhtf,bhsf->bhts", phi_q, phi_k), 0.0)
    if layer.window is not None:
        near = seen & (i - j < layer.window)[None, None]
        top = jnp.max(jnp.where(near, scores, -jnp.inf), axis=-1, keepdims=True)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        gamma = jax.nn.sigmoid(layer.window_factor[...].astype(jnp.float32))[None, :, None, None]
        softmax_part = gamma * jnp.exp(jnp.where(near, scores - top, -jnp.inf))
        student = jnp.where(near, softmax_part, student)
    total = jnp.sum(student, axis=-1, keepdims=True)
    student = student / jnp.where(total > 0, total, 1.0)
    return jnp.where(seen, teacher, 0.0), student


def _check_options(gate, method, chunk_size, eps, window) -> None:
    """A ValueError naming the first bad option of ``LinearizedAttention``'s own."""
    if gate not in LINEARIZED_GATES:
        raise ValueError(f"gate must be one of {LINEARIZED_GATES}, got {gate!r}")
    if method not in additive.METHODS:
        raise ValueError(f"method must be one of {additive.METHODS}, got {method!r}")
    if chunk_size is not None:
        checks.check_int("chunk_size", chunk_size, 1)
    checks.check_number("eps", eps, 0)
    if window is not None:
        checks.check_int("window", window, 1)
        if gate is not None:
            raise ValueError(f"a window takes no gate, got window={window}, gate={gate!r}")


def window_sums(q, k, v, key_mask, w: int) -> tuple[jax.Array, jax.Array]:
    """``(sum_j a_ij v_j [b, t, h, d], sum_j a_ij [b, t, h])`` over each query's latest ``w``
    keys, ``a_ij = exp(q_i . k_j - m_i)`` (``m_i`` the largest of its scores), in blocks of
    ``w`` queries against their block's keys and the block before: ``[b, h, n, w, 2w]``
    scores, never ``[t, t]``. q, k ``[b, t, h, d]``, v ``[b, t, h, dv]``; ``key_mask [b, t]``
    or None."""
    b, t, h, _ = q.shape
    n = -(-t // w)
    real = jnp.ones((b, t), bool) if key_mask is None else key_mask
    pad = lambda y: jnp.pad(y, [(0, 0), (0, n * w - t)] + [(0, 0)] * (y.ndim - 2))
    blocks = lambda y: pad(y).reshape(b, n, w, *y.shape[2:])

    def with_previous(y):  # [b, n, w, ...] -> [b, n, 2w, ...]: each block after the one before
        before = jnp.concatenate([jnp.zeros_like(y[:, :1]), y[:, :-1]], axis=1)
        return jnp.concatenate([before, y], axis=2)

    keys, values, seen = (with_previous(blocks(y)) for y in (k, v, real))
    scores = jnp.einsum("bnahd,bnchd->bhnac", blocks(q), keys)
    a, c = jnp.arange(w)[:, None], jnp.arange(2 * w)[None, :]
    # Key i - w < j <= i, and real.
    near = ((a < c) & (c <= a + w))[None, None, None] & seen[:, None, :, None, :]
    # Masked before the max and the exp: every factor formed is <= 1.
    top = jnp.max(jnp.where(near, scores, -jnp.inf), axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(jnp.where(near, scores - top, -jnp.inf))
    numerator = jnp.einsum("bhnac,bnchd->bnahd", weights, values).reshape(b, n * w, h, -1)
    denominator = jnp.sum(weights, axis=-1).transpose(0, 2, 3, 1).reshape(b, n * w, h)
    return numerator[:, :t], denominator[:, :t]
