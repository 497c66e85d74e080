"""The delta rule's recurrent state: its type, constructor and input checks."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax.ops import checks
from linattn_jax.typing import Array, Float


class DeltaRuleState(NamedTuple):
    """The recurrent state of the delta rule, float32 (float64 for float64 inputs).

    Attributes:
      s: ``[b, h, dk, dv]``.
    """

    s: Float[Array, "b h d v"]


State = DeltaRuleState  # the family interface's name


def init_state(batch: int, heads: int, key_dim: int, value_dim: int) -> State:
    """The empty state: ``s`` zeros ``[batch, heads, key_dim, value_dim]``, float32."""
    checks.check_sizes(batch=batch, heads=heads, key_dim=key_dim, value_dim=value_dim)
    return State(s=jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32))


def check_qkv(q, k, v, *, step: bool = False) -> tuple[tuple[int, ...], int]:
    """``(q.shape, value heads)`` of the delta rule's q, k ``[b, (t,) h, dk]`` and v
    ``[b, (t,) hv, dv]``, checked (``checks.check_qkv`` / ``check_step_qkv``).

    ``hv`` may be a multiple of ``h`` (grouped value heads, Qwen3-Next's 16 key heads and 32
    value heads): value head ``j`` reads the q and k of head ``j // (hv // h)``.
    """
    check = checks.check_step_qkv if step else functools.partial(checks.check_qkv, causal=True)
    rank = 3 if step else 4
    ranks = [len(getattr(x, "shape", ())) for x in (q, k, v)]
    if ranks != [rank] * 3 or v.shape[-2] == q.shape[-2]:
        return check(q, k, v), v.shape[-2]
    checks.check_same(("q", q), ("k", k), axes=(0, rank - 2), what="batch and heads")
    h, hv = q.shape[-2], v.shape[-2]
    if hv % h:
        raise ValueError(
            f"v's heads must be a multiple of q and k's (grouped value heads), got {hv} value "
            f"heads for {h} query and key heads (q {q.shape}, v {v.shape})"
        )
    # v with each group's heads side by side: the usual checks, and their messages, apply.
    folded = jax.ShapeDtypeStruct((*v.shape[:-2], h, v.shape[-1] * (hv // h)), v.dtype)
    return check(q, k, folded), hv


def repeat_heads(x: Array, groups: int, axis: int) -> Array:
    """``x`` with each head repeated ``groups`` times along ``axis`` (``[h] -> [h * groups]``,
    head ``i`` at ``i * groups ... i * groups + groups - 1``)."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=axis)


def check_beta(beta, shape: tuple[int, ...], layout: str, key_mask=None) -> None:
    """Shape and dtype always; the range [0, 2] of real tokens' values when concrete."""
    checks.check_shape("beta", beta, shape, layout)
    checks.check_float(("beta", beta))
    if checks.is_concrete(beta) and checks.is_concrete(key_mask) and beta.size:
        beta = np.asarray(beta)
        if key_mask is not None:
            beta = np.where(np.asarray(key_mask)[..., None], beta, 0.0)
        nan = int(np.sum(np.isnan(beta)))
        if nan:
            raise ValueError(f"beta must lie in [0, 2], got NaN in {nan} of {beta.size} values")
        lo, hi = float(np.min(beta)), float(np.max(beta))
        if not (lo >= 0.0 and hi <= 2.0):
            raise ValueError(f"beta must lie in [0, 2], got values in [{lo}, {hi}]")


def check_options(q, k, *, decay=None, scale=1.0, return_state=False) -> None:
    """The options the delta-rule forms share: q and k of one dtype, a numeric ``decay``
    (or None), a number ``scale`` and a bool ``return_state``."""
    checks.check_same_dtype(("q", q), ("k", k))
    checks.check_decay_value(decay)
    checks.check_number("scale", scale)
    checks.check_bool("return_state", return_state)


def as_internal(state: State | None, b: int, h: int, dk: int, dv: int, dtype) -> Array:
    if state is None:
        return jnp.zeros((b, h, dk, dv), dtype)
    if not isinstance(state, State):
        raise ValueError(
            f"state must be a DeltaRuleState (linattn_jax.ops.delta.State), got "
            f"{type(state).__name__}"
        )
    checks.check_shape("state.s", state.s, (b, h, dk, dv), "[batch, heads, key_dim, value_dim]")
    return state.s.astype(dtype)
