"""The WKV's inputs: checks, the per-token log decays, padding and non-finite tokens."""

from __future__ import annotations

import jax.numpy as jnp

from linattn_jax.ops import checks, chunking, feature_maps
from linattn_jax.ops.wkv.state import EMPTY
from linattn_jax.typing import Array


def check(k, v, time_decay, time_first, *, step: bool) -> tuple[int, ...]:
    """Validates the inputs (``step``: one token, no length axis); returns ``k.shape``."""
    layout = "[batch, heads, dim]" if step else "[batch, length, heads, dim]"
    checks.check_rank("k", k, 3 if step else 4, layout)
    checks.check_shape("v", v, k.shape, f"{layout}, as k")
    for name, x in (("time_decay", time_decay), ("time_first", time_first)):
        checks.check_shape(name, x, k.shape[-2:], "[heads, dim]")
    checks.check_float(("k", k), ("v", v), ("time_decay", time_decay), ("time_first", time_first))
    return k.shape


def operands(k, v, time_decay, time_first, key_mask):
    """``(k, v, log decay w [b,t,h,d], bonus u [b,t,h,d], first spoilt token [b,1,h,d])``,
    time-major, in the accumulation dtype.

    Padding (``key_mask`` False) is replaced, never multiplied, by zeros, and its log
    decay is 0: a padded token neither writes nor decays the state. Then, once over the
    whole sequence, a real token whose key or value is not finite in a channel has both
    replaced by zeros there, and ``spoil`` sets that channel NaN from that token on, as
    the per-token recurrence would.
    """
    dtype = feature_maps.accumulation_dtype(jnp.result_type(k, v))
    k, v = (checks.where_token(key_mask, x).astype(dtype) for x in (k, v))
    w = -jnp.exp(time_decay.astype(dtype))
    log_w = checks.where_token(key_mask, jnp.broadcast_to(w[None, None], k.shape))
    u = jnp.broadcast_to(time_first.astype(dtype)[None, None], k.shape)
    ok = jnp.isfinite(k) & jnp.isfinite(v)
    k, v = (jnp.where(ok, x, jnp.zeros((), dtype)) for x in (k, v))
    return k, v, log_w, u, chunking.first_index(~ok, 1)


def live(key_mask, b: int, t: int, chunk_size: int) -> Array | None:
    """The real tokens, ``[b, t, 1]`` bool, for the chunk bodies; None when every token is
    real and ``chunking.scan`` pads no chunk. A zero token is not inert here (its key
    weighs ``exp(0)``), so a padded last chunk needs the mask; otherwise an all-true mask
    would only cost masking operations."""
    if key_mask is not None:
        return key_mask[:, :, None]
    c, n = chunking.chunk_count(chunk_size, t)
    return None if n * c == t else jnp.ones((b, t, 1), bool)


def finish(num, den, dtype):
    """``num / den``: ``den >= 1`` (its largest weight is 1), so no bound is needed."""
    return (num / den).astype(dtype)


def spoil(out, state, first, key_mask):
    """NaN from the first bad token on (``operands``), in the outputs ``[b,t,h,d]`` and the
    final state's channels; then zeros at the padding."""
    out = checks.where_token(key_mask, chunking.nan_from(first, out, 1))
    bad = first[:, 0] < out.shape[1]  # [b, h, d]
    nan = jnp.full((), jnp.nan, state[0].dtype)
    return out, tuple(jnp.where(bad, nan, x) for x in state)


def floor(m):
    """``m`` no lower than ``EMPTY``: a run without keys keeps the empty state's ``m``."""
    return jnp.maximum(m, jnp.asarray(EMPTY, m.dtype))
