"""No silent wrong answers at the edges: extreme gates, beta near 2, non-finite inputs.

Every chunked form is checked against the per-token forms (the ``"scan"`` method and the
float64 loops of ``tests/reference_recurrent.py``), which meet none of these problems.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from tests import helpers
from tests.reference_recurrent import delta_rule_reference

B, T, H, D, C = 1, 24, 2, 4, 8


def _unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _gates(position: int, value: float, channels: int | None = None):
    """Mild log-decays ``[B, T, H(, channels)]`` with ``value`` at token ``position``."""
    shape = (B, T, H) if channels is None else (B, T, H, channels)
    g = -0.3 * jax.random.uniform(jax.random.PRNGKey(3), shape, jnp.float32)
    return g.at[:, position].set(value)


EXTREME_GATES = [-1e3, -1e10, -1e30, -jnp.inf]


@pytest.mark.parametrize("value", EXTREME_GATES)
@pytest.mark.parametrize("position", [0, 5, 15])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("method", ["chunked", "quadratic"])
def test_additive_forms_equal_the_scan_for_any_gate(value, position, per_channel, method):
    q, k, v = helpers.qkv(0, B, T, H, D, D)
    gate = _gates(position, value, D if per_channel else None)
    run = lambda m: la.causal_linear_attention(
        q, k, v, gate=gate, method=m, chunk_size=C, return_state=True
    )
    (out, state), (ref, ref_state) = run(method), run("scan")
    chex.assert_trees_all_close(out, ref, **helpers.tol(jnp.float32))
    chex.assert_trees_all_close(state, ref_state, **helpers.tol(jnp.float32))


@pytest.mark.parametrize("value", EXTREME_GATES)
@pytest.mark.parametrize("position", [0, 5, 15])
@pytest.mark.parametrize("per_channel", [False, True])
def test_delta_rule_chunked_equals_the_float64_loop_for_any_gate(value, position, per_channel):
    q, k, v = helpers.qkv(1, B, T, H, D, D)
    k = _unit(k)
    beta = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(4), (B, T, H)))
    gate = _gates(position, value, D if per_channel else None)
    out = la.delta_rule(q, k, v, beta, gate=gate, chunk_size=C)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x), jnp.float64)
        ref, _ = delta_rule_reference(f64(q), f64(k), f64(v), f64(beta), gate=f64(gate))
    chex.assert_trees_all_close(out, np.asarray(ref, np.float32), **helpers.tol(jnp.float32))


@pytest.mark.parametrize("beta_value", [1.0, 1.5, 1.9, 2.0])
@pytest.mark.parametrize("keys", ["repeated", "near_parallel"])
def test_delta_rule_chunked_equals_the_scan_with_beta_up_to_2_and_aligned_keys(beta_value, keys):
    """With beta = 2 and one key repeated, ``I - beta k k^T`` is a reflection: the chunk's
    triangular system has entries of +-2 all the way down, where a series solve cancels."""
    t, d = 64, 1 if keys == "repeated" else 4
    q, k, v = helpers.qkv(5, 1, t, 1, d, 3)
    if keys == "repeated":
        k = jnp.ones_like(k)
    else:
        k = _unit(jnp.ones_like(k) + 1e-3 * k)
    beta = jnp.full((1, t, 1), beta_value)
    out, state = la.delta_rule(q, k, v, beta, chunk_size=64, return_state=True)
    ref, ref_state = la.delta_rule(q, k, v, beta, method="scan", return_state=True)
    scale = float(jnp.max(jnp.abs(ref))) + 1.0
    np.testing.assert_allclose(out, ref, atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(state.s, ref_state.s, atol=1e-5 * scale, rtol=0)


def _poisoned(x, position, value):
    return x.at[:, position, 0, 0].set(value)


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("family", ["additive", "gated_additive", "delta", "kda"])
def test_a_non_finite_input_reaches_no_earlier_output(value, which, family):
    """Causal means causal: a NaN or inf at token 13 (chunk 1, not its first token) leaves
    outputs 0..12 as they are without it, and makes the later ones non-finite."""
    pos = 13
    q, k, v = helpers.qkv(7, B, T, H, D, D)
    k = _unit(k)
    beta = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(8), (B, T, H)))
    inputs = dict(k=k, v=v)
    inputs[which] = _poisoned(inputs[which], pos, value)

    def run(k, v, method="chunked"):
        if family == "additive":
            return la.causal_linear_attention(q, k, v, method=method, chunk_size=C)
        if family == "gated_additive":
            gate = _gates(2, -0.5, D)
            return la.causal_linear_attention(q, k, v, gate=gate, method=method, chunk_size=C)
        gate = _gates(2, -0.5, D if family == "kda" else None)
        return la.delta_rule(q, k, v, beta, gate=gate, method=method, chunk_size=C)

    out, clean = run(**inputs), run(k, v)
    chex.assert_trees_all_close(out[:, :pos], clean[:, :pos], **helpers.tol(jnp.float32))
    assert not bool(jnp.all(jnp.isfinite(out[:, pos:])))
    scan = run(**inputs, method="scan")  # the reference recurrence agrees on what is finite
    np.testing.assert_array_equal(jnp.isfinite(out), jnp.isfinite(scan))


def test_a_positive_gate_at_a_padded_token_is_not_validated():
    """Padding may hold anything: a masked token's gate (like its beta) is never checked."""
    q, k, v = helpers.qkv(9, B, T, H, D, D)
    mask = jnp.ones((B, T), bool).at[:, 3].set(False)
    gate = _gates(3, 5.0)  # positive, but at a padded token
    out = la.causal_linear_attention(q, k, v, gate=gate, key_mask=mask, chunk_size=C)
    ref = la.causal_linear_attention(
        q, k, v, gate=gate.at[:, 3].set(0.0), key_mask=mask, chunk_size=C
    )
    chex.assert_trees_all_close(out, ref)
    beta = jnp.full((B, T, H), 0.5)
    out = la.delta_rule(_unit(q), _unit(k), v, beta, gate=gate, key_mask=mask, chunk_size=C)
    assert bool(jnp.all(jnp.isfinite(out)))
    with pytest.raises(ValueError, match=r"gate must be log-decays <= 0, got a maximum of 5"):
        la.causal_linear_attention(q, k, v, gate=gate, chunk_size=C)
