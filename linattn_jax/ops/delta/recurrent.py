"""The delta rule one token at a time: the reference recurrence (the ``"scan"`` form)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linattn_jax.ops import chunking
from linattn_jax.typing import Array


def token_step(s: Array, x) -> tuple[Array, Array]:
    """``S = a S; S += k (beta (v - S^T k))^T; o = S^T q`` for one token of every (b, h)."""
    q, k, v, beta, a = x  # [b,h,dk], [b,h,dk], [b,h,dv], [b,h], [b,h,1|dk] | None
    if a is not None:
        s = a[..., None] * s
    u = beta[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., :, None] * u[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q)


def scan_body(s: Array, x) -> tuple[Array, Array]:
    """One block of tokens, one ``lax.scan`` step each (the reference recurrence)."""
    q, k, v, beta, g, r = x
    a = chunking.token_decays(g, r, q.shape[:3], q.dtype)
    seq = functools.partial(jnp.moveaxis, source=2, destination=0)
    a = None if a is None else seq(a)
    s, out = jax.lax.scan(token_step, s, (seq(q), seq(k), seq(v), seq(beta), a))
    return s, jnp.moveaxis(out, 0, 2)
