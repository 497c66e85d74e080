"""Grouped value heads of the delta rule (``hv`` a multiple of ``h``): each value head reads
the q and k of its group, as the same rule with q and k repeated explicitly.

The sequence-parallel check needs two devices: tests/test_sequence_parallel.py's launcher runs
it in its process with ``--xla_force_host_platform_device_count=8`` (one process for every
multi-device check, rather than one each).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import linattn_jax as la
from tests import helpers
from tests.reference_recurrent import delta_rule_reference

B, T, H, G, DK, DV = 2, 11, 2, 3, 8, 5
HV = H * G


def _inputs(seed, gate_kind="head", t=T):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, t, H, DK))
    k = jax.random.normal(ks[1], (B, t, H, DK))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, t, HV, DV))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, t, HV)))
    shape = {"head": (B, t, HV), "channel": (B, t, HV, DK)}.get(gate_kind)
    gate = None if shape is None else -jax.nn.softplus(jax.random.normal(ks[4], shape))
    return q, k, v, beta, gate


def _repeat(x):
    """Head i of ``x [b, t, h, d]`` at heads ``i * G ... i * G + G - 1`` (independent of the
    library's own repeat)."""
    return jnp.stack([x] * G, axis=3).reshape(x.shape[0], x.shape[1], -1, x.shape[-1])


@pytest.mark.parametrize("gate_kind", ["none", "head", "channel"])
@pytest.mark.parametrize("method", ["chunked", "scan"])
def test_grouped_equals_float64_reference_with_repeated_qk(gate_kind, method):
    q, k, v, beta, gate = _inputs(0, gate_kind)
    s0 = la.DeltaRuleState(0.3 * jax.random.normal(jax.random.PRNGKey(9), (B, HV, DK, DV)))
    out, state = la.delta_rule(
        q, k, v, beta, gate=gate, method=method, chunk_size=4, initial_state=s0,
        return_state=True, scale=0.5,
    )  # fmt: skip
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)
    with jax.enable_x64(True):
        ref_out, ref_s = delta_rule_reference(
            f64(_repeat(q)), f64(_repeat(k)), f64(v), f64(beta), gate=f64(gate),
            initial_state=f64(s0.s), scale=0.5,
        )  # fmt: skip
        ref_out, ref_s = np.asarray(ref_out, np.float32), np.asarray(ref_s, np.float32)
    assert out.shape == (B, T, HV, DV) and state.s.shape == (B, HV, DK, DV)
    np.testing.assert_allclose(out, ref_out, **helpers.tol(jnp.float32))
    np.testing.assert_allclose(state.s, ref_s, **helpers.tol(jnp.float32))


def test_grouped_gradients_equal_repeated_with_mask_and_segments():
    q, k, v, beta, gate = _inputs(1, "channel")
    mask = helpers.key_mask(3, B, T)
    seg = helpers.segment_ids(4, B, T, p=0.2)

    def loss(fn_q, fn_k, q, k, v, beta, gate):
        out, s = la.delta_rule(
            fn_q(q), fn_k(k), v, beta, gate=gate, chunk_size=4, key_mask=mask,
            segment_ids=seg, return_state=True,
        )  # fmt: skip
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(s.s))

    args = (q, k, v, beta, gate)
    grouped = jax.grad(functools.partial(loss, lambda x: x, lambda x: x), argnums=range(5))(*args)
    repeated = jax.grad(functools.partial(loss, _repeat, _repeat), argnums=range(5))(*args)
    helpers.assert_close_normwise(grouped, repeated)


def test_grouped_steps_equal_the_sequence():
    q, k, v, beta, gate = _inputs(2, "head")
    out, final = la.delta_rule(q, k, v, beta, gate=gate, chunk_size=4, return_state=True)
    state, outs = la.init_delta_state(B, HV, DK, DV), []
    step = jax.jit(la.delta_rule_step)
    for i in range(T):
        o, state = step(q[:, i], k[:, i], v[:, i], beta[:, i], state, gate=gate[:, i])
        outs.append(o)
    np.testing.assert_allclose(jnp.stack(outs, 1), out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state.s, final.s, atol=1e-5, rtol=1e-5)
    # The step's gradient, against the step on repeated q and k.
    g_loss = lambda fn, q, k: jnp.sum(
        la.delta_rule_step(fn(q), fn(k), v[:, 0], beta[:, 0], final, gate=gate[:, 0])[0] ** 2
    )
    rep = lambda x: _repeat(x[:, None])[:, 0]
    grad = lambda fn: jax.jit(jax.grad(functools.partial(g_loss, fn), argnums=(0, 1)))
    helpers.assert_close_normwise(grad(lambda x: x)(q[:, 0], k[:, 0]), grad(rep)(q[:, 0], k[:, 0]))


def test_grouped_heads_errors():
    q, k, v, beta, _ = _inputs(0)
    with pytest.raises(ValueError, match=r"v's heads must be a multiple of q and k's"):
        la.delta_rule(q, k, v[:, :, :5], beta[:, :, :5])
    with pytest.raises(ValueError, match=r"q and k must agree in batch and heads"):
        la.delta_rule(q, k[:, :, :1], v, beta)
    with pytest.raises(ValueError, match=r"beta must have shape \[batch, length, heads\]"):
        la.delta_rule(q, k, v, beta[:, :, :H])
    with pytest.raises(ValueError, match=r"v's heads must be a multiple"):
        la.delta_rule_step(q[:, 0], k[:, 0], v[:, 0, :5], beta[:, 0, :5], None)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (run by the launcher)")
def test_grouped_sequence_parallel_equals_single_device():
    q, k, v, beta, gate = _inputs(5, "channel", t=12)
    mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
    s0 = la.DeltaRuleState(0.3 * jax.random.normal(jax.random.PRNGKey(9), (B, HV, DK, DV)))
    single = functools.partial(la.delta_rule, chunk_size=4, initial_state=s0, return_state=True)
    parallel = functools.partial(
        la.sequence_parallel_delta_rule, axis_name="seq", mesh=mesh, chunk_size=4,
        initial_state=s0, return_state=True,
    )  # fmt: skip
    out, s = single(q, k, v, beta, gate=gate)
    out_p, s_p = jax.jit(parallel)(q, k, v, beta, gate=gate)
    np.testing.assert_allclose(out_p, out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(s_p.s, s.s, atol=2e-5, rtol=2e-5)
    loss = lambda fn, q, k, v: jnp.sum(jnp.sin(fn(q, k, v, beta, gate=gate)[0]))
    helpers.assert_close_normwise(
        jax.grad(functools.partial(loss, jax.jit(parallel)), argnums=(0, 1, 2))(q, k, v),
        jax.grad(functools.partial(loss, single), argnums=(0, 1, 2))(q, k, v),
    )
