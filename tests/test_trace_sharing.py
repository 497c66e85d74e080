"""The chunked forms are their own jitted functions: a model's identical layers trace their
chunk loops once (8 layers, forward+backward trace + lower on one core: linear 3.38 -> 0.67
s, Mamba-2 7.7 -> 2.4 s; docs/benchmarks.md). Without that, two calls of the same shapes
trace the loop twice; ``tests/test_delta_rule.py`` checks the delta rule's."""

import jax
import jax.numpy as jnp
import pytest

import linattn_jax as la
from linattn_jax.ops import chunking


def _additive(t):
    q, k, v = (jnp.ones((1, t, 2, 8)) for _ in range(3))
    return lambda q: la.causal_linear_attention(q, k, v, method="chunked"), q


def _gla(t):
    q, k, v = (jnp.ones((1, t, 2, 8)) for _ in range(3))
    g = -jnp.ones((1, t, 2, 8))
    return lambda q: la.causal_linear_attention(q, k, v, gate=g, method="chunked"), q


def _ssd(t):
    x = jnp.ones((1, t, 2, 8))
    dt, a = jnp.full((1, t, 2), 0.5), -jnp.ones((2,))
    b = c = jnp.ones((1, t, 1, 4))
    return lambda x: la.ssd(x, dt, a, b, c), x


def _mlstm(t):
    q, k, v = (jnp.ones((1, t, 2, 8)) for _ in range(3))
    i, f = jnp.zeros((1, t, 2)), jnp.full((1, t, 2), 3.0)
    return lambda q: la.mlstm(q, k, v, i, f), q


@pytest.mark.parametrize("make", [_additive, _gla, _ssd, _mlstm], ids=lambda f: f.__name__[1:])
def test_identical_calls_share_one_trace_of_the_chunked_form(make, monkeypatch):
    traced = []
    scan = chunking.scan
    monkeypatch.setattr(chunking, "scan", lambda *a, **k: traced.append(1) or scan(*a, **k))
    fn, x = make(61)  # a length no other test uses: nothing comes from jit's cache
    jax.jit(lambda x: fn(x + fn(x))).lower(x)
    two = len(traced)
    traced.clear()
    fn, x = make(67)
    jax.jit(fn).lower(x)
    assert two == len(traced) > 0
