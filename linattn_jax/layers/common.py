"""Small pieces shared by the attention layers: heads, projections, positions, checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.ops import checks


def split_heads(x: jax.Array, heads: int) -> jax.Array:
    """``[b, t, h * d] -> [b, t, h, d]``."""
    return x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads))


def projection(
    n_in: int, n_out: int, *axes: str | None, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32
) -> nnx.Linear:
    """A linear map ``n_in -> n_out`` without bias, its kernel's dims named ``axes``
    (``linattn_jax.sharding``): the layers' q, k, v, gate and output projections."""
    return nnx.Linear(
        n_in, n_out, use_bias=False, kernel_init=sharding.kernel(*axes), dtype=dtype,
        param_dtype=param_dtype, rngs=rngs,
    )  # fmt: skip


def check_width(width: int, num_heads: int) -> None:
    checks.check_int("width", width, 1)
    checks.check_int("num_heads", num_heads, 1)
    if width % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide the width {width}")


def check_head_dim(width: int, num_heads: int, head_dim: int | None) -> int:
    """``head_dim``, checked, or (None) ``width / num_heads``, which must then divide."""
    if head_dim is None:
        check_width(width, num_heads)
        return width // num_heads
    checks.check_sizes(width=width, num_heads=num_heads)
    checks.check_int("head_dim", head_dim, 1)
    return head_dim


def check_tokens(x: jax.Array, width: int) -> None:
    if x.ndim != 3 or x.shape[-1] != width:
        raise ValueError(f"x must have shape [batch, length, {width}], got {x.shape}")


def check_dropout_rate(rate) -> None:
    """A rate in [0, 1). The layers' ``nnx.Dropout`` holds an RNG stream only when the
    rate is above 0, so a layer without dropout has no RNG state."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ValueError(f"dropout_rate must be a number in [0, 1), got {rate!r}")


def check_decoding(layer, state, return_state: bool) -> None:
    """Decoding (``state=`` or ``return_state=``) needs a causal layer."""
    if (state is not None or return_state) and not layer.causal:
        raise ValueError("decoding (state=, return_state=) needs a causal layer (causal=True)")


def check_state(state, expected: type, article: str = "a") -> None:
    """A layer's decoding ``state``: None or an ``expected`` (its ``init_state``'s type), or
    a ValueError naming that type (``article`` before its name)."""
    if state is not None and not isinstance(state, expected):
        raise ValueError(f"state must be {article} {expected.__name__}, got {type(state).__name__}")


def check_can_decode(layer) -> None:
    """``init_state`` needs a causal layer."""
    if not layer.causal:
        raise ValueError("decoding needs a causal layer (causal=True)")


def next_position(
    position: jax.Array | None, b: int, t: int, key_mask: jax.Array | None
) -> jax.Array:
    """``[b]`` int32: the position after a call of ``t`` tokens from ``position [b]`` (None:
    0), counting real tokens only (``key_mask [b, t]``)."""
    start = jnp.zeros((b,), jnp.int32) if position is None else position
    return start + (t if key_mask is None else jnp.sum(key_mask, axis=1, dtype=jnp.int32))


def positions(
    position: jax.Array | None, b: int, t: int, key_mask: jax.Array | None = None
) -> jax.Array:
    """``[b, t]`` positions from ``position [b]`` on; with a ``key_mask``, only real
    tokens count (a left-padded prompt's first real token sits where it would alone)."""
    start = jnp.zeros((b,), jnp.int32) if position is None else position
    if key_mask is None or key_mask.shape != (b, t):  # a bad mask: the maths reports it
        return start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return start[:, None] + jnp.cumsum(key_mask, axis=1, dtype=jnp.int32) - 1


def project_qkv(layer, x, inputs_k, inputs_v, key_mask, query_mask):
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
    kv_heads = getattr(layer, "num_kv_heads", layer.num_heads)  # fewer with GQA
    heads = lambda proj, y, mask, n: split_heads(proj(checks.where_token(mask, y)), n)
    q = heads(layer.q_proj, x, None, layer.num_heads)
    k, v = (
        heads(p, y, key_mask, kv_heads)
        for p, y in [(layer.k_proj, inputs_k), (layer.v_proj, inputs_v)]
    )
    return x, (q, k, v), key_mask, query_mask
