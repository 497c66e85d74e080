"""The mLSTM's inputs: checks, the log-space gates, padding and non-finite tokens, and the
normalised output."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import checks, chunking, feature_maps

FORGET_GATES = ("sigmoid", "exp")


def check(q, k, v, i, f, *, step: bool, forget_gate: str, scale, eps) -> tuple[int, ...]:
    """Validates the inputs (``step``: one token, no length axis); returns ``q.shape``."""
    if step:
        shape = checks.check_step_qkv(q, k, v)
        gates, layout = shape[:2], "[batch, heads]"
    else:
        shape = checks.check_qkv(q, k, v, causal=True)
        gates, layout = shape[:3], "[batch, length, heads]"
    for name, g in (("i", i), ("f", f)):
        checks.check_shape(name, g, gates, layout)
    checks.check_float(("i", i), ("f", f))
    if forget_gate not in FORGET_GATES:
        raise ValueError(f"forget_gate must be one of {FORGET_GATES}, got {forget_gate!r}")
    if scale is not None:
        checks.check_number("scale", scale)
    checks.check_number("eps", eps, minimum=0.0)
    return shape


def operands(q, k, v, i, f, key_mask, *, forget_gate: str, scale):
    """``(q * scale, k, v, log input gate i, log forget gate, first bad token [b,1,h],
    first spoilt value channel [b,1,h,v])``, time-major, in the accumulation dtype.

    Padding (``key_mask`` False) is replaced, never multiplied, by zeros first. Then, once
    over the whole sequence, a real token whose key or gates are not finite has them
    replaced by zeros (and a value channel likewise): the chunks' masked matmuls then
    never meet ``0 * NaN``, and ``spoil`` sets what the per-token recurrence would make
    NaN (every output from that token on, or one value channel).
    """
    dtype = feature_maps.accumulation_dtype(jnp.result_type(q, k, v))
    q, k, v, i, f = (checks.where_token(key_mask, x).astype(dtype) for x in (q, k, v, i, f))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # A padded token does not decay the state: log f = 0 there (log_sigmoid(0) is not).
    log_f = checks.where_token(key_mask, log_forget(f, forget_gate))
    ok = jnp.all(jnp.isfinite(k), axis=-1) & jnp.isfinite(i) & jnp.isfinite(log_f)
    k = jnp.where(ok[..., None], k, 0.0)
    i, log_f = (jnp.where(ok, x, 0.0) for x in (i, log_f))
    good_v = ok[..., None] & jnp.isfinite(v)
    v = jnp.where(good_v, v, 0.0)
    first = chunking.first_index(~ok, 1)
    first_v = chunking.first_index(~good_v, 1)
    return q * scale, k, v, i, log_f, first, first_v


def log_forget(f, forget_gate: str):
    """The log forget gate: ``log_sigmoid(f)`` or (``"exp"``) ``f`` itself."""
    return jax.nn.log_sigmoid(f) if forget_gate == "sigmoid" else f


def finish(num, den, m, eps: float, dtype):
    """``num / (max(|den|, exp(-m)) + eps)``: the normaliser with its lower bound.

    Its gradient sums ``d out * num`` over the value channels as a product with ones
    (``chunking.scaled``): as a plain reduction XLA:CPU's YNNPACK took a third of the
    chunked form's forward+backward time at t=2048 (docs/benchmarks.md).
    """
    bound = jnp.maximum(jnp.abs(den), jnp.exp(-m)) + eps
    return chunking.scaled(num, 1.0 / bound[..., None]).astype(dtype)


def spoil(out, state, first, first_v, key_mask):
    """NaN from the first bad token on (``operands``), in the outputs ``[b,t,h,v]`` and the
    final state; then zeros at the padding."""
    t = out.shape[1]
    out = chunking.nan_from(first_v, chunking.nan_from(first, out, 1), 1)
    out = checks.where_token(key_mask, out)
    c, n, m = state
    bad, bad_v = first[:, 0] < t, first_v[:, 0] < t  # [b, h], [b, h, v]
    nan = jnp.full((), jnp.nan, c.dtype)
    c = jnp.where(bad[..., None, None] | bad_v[:, :, None], nan, c)
    n = jnp.where(bad[..., None], nan, n)
    m = jnp.where(bad, nan, m)
    return out, (c, n, m)
