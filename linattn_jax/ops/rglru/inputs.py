"""The RG-LRU's inputs: checks, the gates in log space, the normalised input, the resets."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linattn_jax.ops import checks

MAX_SQRT_GRADIENT = 1000.0  # Griffin's bound on the derivative of sqrt(1 - a^2)


def check(x, i, r, a_param, c, reset, *, step: bool) -> tuple[int, ...]:
    """Validates the inputs (``step``: one token, no length axis); returns ``x.shape``."""
    layout = "[batch, heads, width]" if step else "[batch, length, heads, width]"
    checks.check_rank("x", x, 3 if step else 4, layout)
    for name, g in (("i", i), ("r", r)):
        checks.check_shape(name, g, x.shape, layout)
    checks.check_shape("a_param", a_param, x.shape[-2:], "[heads, width]")
    checks.check_float(("x", x), ("i", i), ("r", r), ("a_param", a_param))
    checks.check_number("c", c, minimum=0.0)
    if reset is not None:
        tokens = x.shape[:1] if step else x.shape[:2]
        checks.check_shape("reset", reset, tokens, "[batch]" if step else "[batch, length]")
        if reset.dtype != jnp.bool_:
            raise ValueError(f"reset must be bool (True = a sequence start), got {reset.dtype}")
    return x.shape


@jax.custom_jvp
def bounded_sqrt(x):
    """``sqrt(x)`` whose derivative is capped at ``MAX_SQRT_GRADIENT`` (Griffin's, so that
    ``sqrt(1 - a^2)`` near ``a = 1`` gives no inf or NaN gradient)."""
    return jnp.sqrt(x)


@bounded_sqrt.defjvp
def _bounded_sqrt_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    floor = jnp.asarray(1.0 / MAX_SQRT_GRADIENT**2, x.dtype)
    return jnp.sqrt(x), dx / jnp.sqrt(jnp.maximum(4.0 * x, floor))


def gated(x, i, r, a_param, c, reset):
    """``(u, log a)`` of each token (any leading shape, ``a_param`` broadcast on the last
    two axes): ``log a = -c * sigmoid(r) * softplus(a_param)``, ``u = sqrt(1 - a^2) *
    sigmoid(i) * x``, with ``sqrt(1 - a^2)`` replaced by 1 where ``reset [...]`` is True
    (there ``a`` multiplies no state: the caller drops it)."""
    a_param = a_param.reshape((1,) * (r.ndim - 2) + a_param.shape)
    log_a = -c * jax.nn.sigmoid(r) * jax.nn.softplus(a_param)
    norm = bounded_sqrt(-jnp.expm1(2.0 * log_a))  # 1 - a^2 without cancellation
    if reset is not None:
        norm = jnp.where(reset.reshape(reset.shape + (1, 1)), jnp.ones((), norm.dtype), norm)
    return norm * (jax.nn.sigmoid(i) * x), log_a


def sequence_resets(live, runs, reset, fresh: bool):
    """``[b, t]`` bool: the tokens that start a sequence, each the first real token of its
    segment (a segment that starts on padding starts at its first real token).

    Args:
      live: ``[b, t]`` bool, False at padding.
      runs: ``[b, t]`` int32 segment runs (``checks.segment_runs``), or None.
      reset: ``[b, t]`` bool, the caller's own sequence starts, or None.
      fresh: the row starts with no state: its first real token starts a sequence.
    """
    b, t = live.shape
    runs = jnp.zeros((b, t), jnp.int32) if runs is None else runs
    index = jnp.where(live, jnp.arange(t, dtype=jnp.int32)[None, :], -1)
    last = jax.lax.cummax(index, axis=1)  # the last real token at or before each token
    before = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), last[:, :-1]], axis=1)
    run_before = jnp.take_along_axis(runs, jnp.maximum(before, 0), axis=1)
    new = jnp.where(before < 0, fresh | (runs > 0), runs != run_before)
    if reset is not None:
        new = new | reset
    return live & new
