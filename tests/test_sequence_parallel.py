"""Sequence-parallel causal linear attention on 8 CPU devices.

The checks need ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX
starts, so the one test that runs in the main pytest process re-runs this file in
a subprocess with it; there the device-count guard lets the real tests run. The same
process runs the other files' multi-device checks (``MULTI_DEVICE``): one process
start, JAX start and import of the library for all of them.
"""

import functools
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx
from jax.sharding import Mesh

import linattn_jax as la
from experiments.bench.comm import allgather_bytes, communication_bytes
from linattn_jax import layers
from tests import helpers

EIGHT = jax.device_count() == 8
B, H, D, DV = 2, 3, 8, 5
# The other files' tests that need more than one device (they skip on one).
MULTI_DEVICE = (
    "test_hybrid.py::test_sequence_parallel_mixed_stack_equals_one_device",
    "test_grouped_delta.py::test_grouped_sequence_parallel_equals_single_device",
)


@pytest.mark.slow
@pytest.mark.skipif(EIGHT, reason="this is the launcher; the real tests run below")
def test_in_a_process_with_eight_devices():
    here = Path(__file__).parent
    stdout = helpers.pytest_with_devices(8, __file__, *(str(here / t) for t in MULTI_DEVICE))
    assert " passed" in stdout and "1 skipped" in stdout  # only the launcher skipped


def _mesh(shards, batch=1):
    devices = np.array(jax.devices()[: shards * batch]).reshape(batch, shards)
    return Mesh(devices, ("batch", "seq"))


@pytest.mark.skipif(not EIGHT, reason="needs 8 devices (run by the launcher test)")
class SequenceParallelTest(chex.TestCase):
    # A covering set (each shard count, each option; compiling is most of the time here).
    @parameterized.parameters(
        (2, "plain"), (4, "decay"), (8, "gate_and_state"), (4, "channel_gate")
    )
    def test_equals_single_device_forward_and_gradient(self, shards, option):
        t = 6 * shards  # 6 tokens per shard: not a multiple of the chunk size 4
        q, k, v = helpers.qkv(0, B, t, H, D, DV)
        opts = {
            "plain": {},
            "decay": dict(decay=jnp.array([0.5, 0.9, 1.0])),
            "gate_and_state": dict(
                gate=helpers.gate(1, B, t, H), initial_state=helpers.random_state(2, B, H, D, DV)
            ),
            "channel_gate": dict(  # GLA: one gate per feature channel (elu: f = d)
                gate=-jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(11), (B, t, H, D)))
            ),
        }[option]
        mesh = _mesh(shards)
        single = functools.partial(la.causal_linear_attention, chunk_size=4, **opts)
        parallel = functools.partial(
            la.sequence_parallel_causal_linear_attention,
            axis_name="seq",
            mesh=mesh,
            chunk_size=4,
            **opts,
        )
        tol = helpers.tol(jnp.float32)
        out, state = jax.jit(functools.partial(parallel, return_state=True))(q, k, v)
        ref, ref_state = single(q, k, v, return_state=True)
        chex.assert_trees_all_close(out, ref, **tol)
        chex.assert_trees_all_close(state, ref_state, **tol)
        loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
        grads = [
            jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v) for fn in (parallel, single)
        ]
        helpers.assert_close_normwise(grads[0], grads[1])

    def test_traced_out_of_range_gates_agree_with_one_device(self):
        """A positive gate (clamped to 0 under jit) and -inf (a reset) as on one device."""
        q, k, v = helpers.qkv(5, B, 16, H, D, DV)
        gate = helpers.gate(6, B, 16, H).at[:, 3].set(50.0).at[:, 9].set(-jnp.inf)
        parallel = jax.jit(
            functools.partial(
                la.sequence_parallel_causal_linear_attention,
                axis_name="seq",
                mesh=_mesh(4),
                chunk_size=4,
            )
        )
        single = jax.jit(functools.partial(la.causal_linear_attention, chunk_size=4))
        out, ref = parallel(q, k, v, gate=gate), single(q, k, v, gate=gate)
        assert bool(jnp.all(jnp.isfinite(out)))
        chex.assert_trees_all_close(out, ref, **helpers.tol(jnp.float32))

    def test_two_dimensional_mesh_and_cosformer_positions(self):
        q, k, v = helpers.qkv(3, 4, 16, H, D, DV)
        phi = la.feature_maps.cosformer(64)
        out = la.sequence_parallel_causal_linear_attention(
            q,
            k,
            v,
            axis_name="seq",
            batch_axis="batch",
            mesh=_mesh(4, batch=2),
            feature_map=phi,
            chunk_size=4,
        )
        ref = la.causal_linear_attention(q, k, v, feature_map=phi, chunk_size=4)
        chex.assert_trees_all_close(out, ref, **helpers.tol(jnp.float32))

    def test_layer_with_a_sequence_axis(self):
        mesh = _mesh(4, batch=2)
        kw = dict(chunk_size=4, gate=True, decay="retnet")
        plain = layers.LinearAttention(16, 2, rngs=nnx.Rngs(0), **kw)
        sharded = layers.LinearAttention(
            16, 2, sequence_axis="seq", batch_axis="batch", mesh=mesh, rngs=nnx.Rngs(0), **kw
        )
        x = jax.random.normal(jax.random.PRNGKey(4), (4, 24, 16))
        chex.assert_trees_all_close(sharded(x), plain(x), atol=1e-5, rtol=1e-5)

    # GLA (additive, per-channel gates) and KDA (delta, per-channel gates); Gated DeltaNet's
    # per-head gate is the delta rule's test below, its layer that of KDA but for the gate.
    @parameterized.parameters("gla", "kda", "mlstm", "mamba2", "rglru", "mamba")
    def test_gated_and_delta_layers_with_a_sequence_axis(self, kind):
        mesh = _mesh(4, batch=2)
        small = {"mamba2": dict(state_dim=4), "mamba": dict(state_dim=4)}.get(kind, {})
        options = dict(chunk_size=4, rngs=nnx.Rngs(0), **small)
        plain = layers.make_attention(kind, 16, 2, **options)
        options.update(rngs=nnx.Rngs(0), sequence_axis="seq", batch_axis="batch", mesh=mesh)
        sharded = layers.make_attention(kind, 16, 2, **options)
        x = jax.random.normal(jax.random.PRNGKey(4), (4, 24, 16))
        # Jitted (the layer above runs eagerly): eager, op by op, most of the test's time.
        forward = nnx.jit(lambda layer, x: layer(x))
        chex.assert_trees_all_close(forward(sharded, x), forward(plain, x), atol=1e-5, rtol=1e-5)

    @parameterized.parameters(False, True)
    def test_communication_volume_matches_the_compiled_program(self, decayed):
        """Bytes all-gathered in the compiled HLO equal the analytic count."""
        b, t, h, d, shards = 1, 4096, 2, 16, 8
        q = jnp.ones((b, t, h, d))
        # The gate is an argument: a constant one lets XLA fold the decays away.
        gate = -jnp.ones((b, t, h)) if decayed else None
        fn = jax.jit(
            functools.partial(
                la.sequence_parallel_causal_linear_attention, axis_name="seq", mesh=_mesh(shards)
            )
        )
        hlo = fn.lower(q, q, q, gate=gate).compile().as_text()
        gathered = allgather_bytes(hlo)
        expected = communication_bytes(b, t, h, d, d, d, shards, decayed)
        # all-gather results hold all n shards; a device receives n - 1 of them.
        assert gathered * (shards - 1) // shards == expected["linear_state_allgather"]

    @parameterized.parameters((2, "channel"), (4, None), (8, "head"))
    def test_delta_rule_equals_single_device(self, shards, gate):
        t = 6 * shards  # 6 tokens per shard: not a multiple of the chunk size 4
        q, k, v = helpers.qkv(7, B, t, H, D, DV)
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        beta = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(8), (B, t, H)))
        shape = {None: None, "head": (B, t, H), "channel": (B, t, H, D)}[gate]
        g = (
            None
            if shape is None
            else -jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(9), shape))
        )
        s0 = la.DeltaRuleState(0.3 * jax.random.normal(jax.random.PRNGKey(10), (B, H, D, DV)))
        kw = dict(gate=g, chunk_size=4, initial_state=s0)
        parallel = functools.partial(
            la.sequence_parallel_delta_rule, axis_name="seq", mesh=_mesh(shards), **kw
        )
        single = functools.partial(la.delta_rule, **kw)
        out, state = jax.jit(functools.partial(parallel, return_state=True))(q, k, v, beta)
        ref, ref_state = single(q, k, v, beta, return_state=True)
        tol = helpers.tol(jnp.float32)
        chex.assert_trees_all_close(out, ref, **tol)
        chex.assert_trees_all_close(state.s, ref_state.s, **tol)
        loss = lambda fn: lambda q, k, v, beta: jnp.sum(jnp.sin(fn(q, k, v, beta)))
        grads = [
            jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2, 3)))(q, k, v, beta)
            for fn in (parallel, single)
        ]
        helpers.assert_close_normwise(grads[0], grads[1])

    def test_delta_rule_moves_only_states_and_stays_sharded(self):
        """The HLO gathers (M, S_local) and nothing else; the output stays split."""
        b, t, h, d, shards = 2, 1024, 2, 16, 4
        mesh = _mesh(shards, batch=2)
        x = jnp.ones((b, t, h, d)) / 4.0
        beta, gate = jnp.full((b, t, h), 0.5), -jnp.ones((b, t, h, d))
        fn = jax.jit(
            functools.partial(
                la.sequence_parallel_delta_rule, axis_name="seq", batch_axis="batch", mesh=mesh
            )
        )
        hlo = fn.lower(x, x, x, beta, gate=gate).compile().as_text()
        gathered = allgather_bytes(hlo)
        expected = communication_bytes(b // 2, t, h, d, d, d, shards)
        assert gathered * (shards - 1) // shards == expected["delta_state_allgather"]
        for collective in ("all-to-all", "collective-permute", "reduce-scatter", "all-reduce"):
            assert collective not in hlo, collective
        out = fn(x, x, x, beta, gate=gate)
        assert out.sharding.spec[:2] == ("batch", "seq"), out.sharding
        assert {s.data.shape for s in out.addressable_shards} == {(1, t // shards, h, d)}

    def test_empty_sequence_passes_the_state_through(self):
        q = jnp.ones((B, 0, H, D))
        s0 = helpers.random_state(12, B, H, D, D)
        out, state = la.sequence_parallel_causal_linear_attention(
            q, q, q, axis_name="seq", mesh=_mesh(4), initial_state=s0, return_state=True
        )
        chex.assert_shape(out, (B, 0, H, D))
        chex.assert_trees_all_close(state, s0)
        d0 = la.DeltaRuleState(s0.s)
        out, state = la.sequence_parallel_delta_rule(
            q, q, q, jnp.ones((B, 0, H)), axis_name="seq", mesh=_mesh(4), initial_state=d0,
            return_state=True,
        )  # fmt: skip
        chex.assert_shape(out, (B, 0, H, D))
        chex.assert_trees_all_close(state.s, s0.s)
        # An empty batch: nothing to shard either (an IndexError in the shards before).
        q = jnp.ones((0, 8, H, D))
        out = la.sequence_parallel_causal_linear_attention(q, q, q, axis_name="seq", mesh=_mesh(4))
        chex.assert_shape(out, (0, 8, H, D))

    def test_errors(self):
        q, k, v = helpers.qkv(0, B, 12, H, D, DV)
        with pytest.raises(ValueError, match=r"length t=12 must be divisible by the 8 devices"):
            la.sequence_parallel_causal_linear_attention(q, k, v, axis_name="seq", mesh=_mesh(8))
        with pytest.raises(ValueError, match=r"axis_name='x' is not an axis of the mesh"):
            la.sequence_parallel_causal_linear_attention(q, k, v, axis_name="x", mesh=_mesh(2))


@pytest.mark.skipif(not EIGHT, reason="needs 8 devices (run by the launcher test)")
def test_ssd_sequence_parallel_equals_one_device():
    """Mamba-2's SSD (``ops.ssd``): 4 shards x 2 batch shards, groups, ``D``, a given state;
    outputs, final state and gradients against the single-device chunked form."""
    b, t, h, g, p, n = 2, 12, 4, 2, 3, 5
    ks = jax.random.split(jax.random.PRNGKey(21), 7)
    inputs = dict(
        x=jax.random.normal(ks[0], (b, t, h, p)),
        dt=jax.nn.softplus(jax.random.normal(ks[1], (b, t, h))),
        A=-jax.random.uniform(ks[2], (h,), minval=0.1, maxval=2.0),
        B=jax.random.normal(ks[3], (b, t, g, n)),
        C=jax.random.normal(ks[4], (b, t, g, n)),
        D=jax.random.normal(ks[5], (h,)),
    )
    s0 = la.SSDState(0.5 * jax.random.normal(ks[6], (b, h, n, p)))
    w = jax.random.normal(jax.random.PRNGKey(22), (b, t, h, p))

    def loss(fn, inputs):
        out, state = fn(**inputs, initial_state=s0, return_state=True)
        return jnp.sum(out * w) + jnp.sum(state.s), (out, state.s)

    parallel = functools.partial(
        la.sequence_parallel_ssd, axis_name="seq", batch_axis="batch", mesh=_mesh(4, 2),
        chunk_size=2,
    )  # fmt: skip
    single = functools.partial(la.ssd, chunk_size=2)
    grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), has_aux=True))(inputs)
    (d, (out, s)), (ref_d, (ref_out, ref_s)) = grad(parallel), grad(single)
    chex.assert_trees_all_close(out, ref_out, **helpers.tol(jnp.float32))
    chex.assert_trees_all_close(s, ref_s, **helpers.tol(jnp.float32))
    helpers.assert_close_normwise(d, ref_d)


@pytest.mark.skipif(not EIGHT, reason="needs 8 devices (run by the launcher test)")
def test_mlstm_sequence_parallel_equals_one_device():
    """The mLSTM (``ops.mlstm``): 4 shards x 2 batch shards, gates of +-50 among ordinary
    ones, a given state; outputs, final (C, n, m) and gradients against one device."""
    b, t, h, d, dv = 2, 12, 2, 4, 3
    ks = jax.random.split(jax.random.PRNGKey(23), 9)
    extreme = lambda key: 50.0 * jnp.sign(jax.random.normal(key, (b, t, h)))
    pick = jax.random.bernoulli(ks[0], 0.4, (b, t, h))
    inputs = dict(
        q=jax.random.normal(ks[1], (b, t, h, d)),
        k=jax.random.normal(ks[2], (b, t, h, d)),
        v=jax.random.normal(ks[3], (b, t, h, dv)),
        i=jnp.where(pick, extreme(ks[4]), jax.random.normal(ks[5], (b, t, h))),
        f=jnp.where(pick, extreme(ks[6]), 2.0 + jax.random.normal(ks[7], (b, t, h))),
    )
    s0 = la.init_mlstm_state(b, h, d, dv)._replace(m=jax.random.normal(ks[8], (b, h)))
    w = jax.random.normal(jax.random.PRNGKey(24), (b, t, h, dv))

    def loss(fn, inputs):
        out, state = fn(**inputs, initial_state=s0, return_state=True)
        return jnp.sum(out * w) + jnp.sum(state.c) + jnp.sum(state.m), (out, state)

    parallel = functools.partial(
        la.sequence_parallel_mlstm, axis_name="seq", batch_axis="batch", mesh=_mesh(4, 2),
        chunk_size=2,
    )  # fmt: skip
    single = functools.partial(la.mlstm, chunk_size=2)
    grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), has_aux=True))(inputs)
    (d, (out, s)), (ref_d, (ref_out, ref_s)) = grad(parallel), grad(single)
    helpers.assert_close_normwise(out, ref_out)
    chex.assert_trees_all_close(tuple(s), tuple(ref_s), **helpers.tol(jnp.float32))
    helpers.assert_close_normwise(d, ref_d)


@pytest.mark.skipif(not EIGHT, reason="needs 8 devices (run by the launcher test)")
def test_wkv_sequence_parallel_equals_one_device():
    """RWKV-4's WKV (``ops.wkv``): 4 shards x 2 batch shards, keys up to ~60 and a given
    state; outputs, final (num, den, m) and gradients against one device."""
    b, t, h, d = 2, 12, 2, 3
    ks = jax.random.split(jax.random.PRNGKey(25), 7)
    inputs = dict(
        k=20.0 * jax.random.normal(ks[0], (b, t, h, d)),
        v=jax.random.normal(ks[1], (b, t, h, d)),
        time_decay=jax.random.normal(ks[2], (h, d)),
        time_first=jax.random.normal(ks[3], (h, d)),
    )
    s0 = la.WKVState(
        num=jax.random.normal(ks[4], (b, h, d)),
        den=1.0 + jnp.abs(jax.random.normal(ks[5], (b, h, d))),
        m=jax.random.normal(ks[6], (b, h, d)),
    )
    w = jax.random.normal(jax.random.PRNGKey(26), (b, t, h, d))

    def loss(fn, inputs):
        out, state = fn(**inputs, initial_state=s0, return_state=True)
        return jnp.sum(out * w) + jnp.sum(state.num) + jnp.sum(state.m), (out, state)

    parallel = functools.partial(
        la.ops.wkv.sequence_parallel, axis_name="seq", batch_axis="batch", mesh=_mesh(4, 2),
        chunk_size=2,
    )  # fmt: skip
    single = functools.partial(la.wkv, chunk_size=2)
    grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), has_aux=True))(inputs)
    (g, (out, s)), (ref_g, (ref_out, ref_s)) = grad(parallel), grad(single)
    helpers.assert_close_normwise(out, ref_out)
    for a, e in zip(s, ref_s, strict=True):
        helpers.assert_close_normwise(a, e)
    helpers.assert_close_normwise(g, ref_g)


@pytest.mark.skipif(not EIGHT, reason="needs 8 devices (run by the launcher test)")
def test_rglru_sequence_parallel_equals_one_device():
    """The RG-LRU (``ops.rglru``): 4 shards x 2 batch shards, a reset inside a shard, from
    no state (token 0 a sequence start) and from a given one; outputs, final state and
    gradients against one device."""
    b, t, h, d = 2, 12, 2, 3
    ks = jax.random.split(jax.random.PRNGKey(25), 5)
    args = tuple(jax.random.normal(key, (b, t, h, d)) for key in ks[:3])
    kw = dict(a_param=jax.random.normal(ks[3], (h, d)) - 2.0, chunk_size=2, return_state=True)
    kw["reset"] = jnp.zeros((b, t), bool).at[0, 5].set(True)
    parallel = functools.partial(
        la.sequence_parallel_rglru, axis_name="seq", batch_axis="batch", mesh=_mesh(4, 2)
    )
    for s0 in (None, la.RGLRUState(jax.random.normal(ks[4], (b, h, d)))):

        def loss(fn, args, s0=s0):
            out, state = fn(*args, initial_state=s0, **kw)
            return jnp.sum(out * args[0]) + jnp.sum(state.h), (out, state)

        grad = lambda fn, loss=loss: jax.jit(jax.grad(functools.partial(loss, fn), has_aux=True))
        (d, (out, s)), (ref_d, (ref_out, ref_s)) = grad(parallel)(args), grad(la.rglru)(args)
        helpers.assert_close_normwise(out, ref_out)
        chex.assert_trees_all_close(s.h, ref_s.h, **helpers.tol(jnp.float32))
        helpers.assert_close_normwise(d, ref_d)


@pytest.mark.skipif(not EIGHT, reason="needs 8 devices (run by the launcher test)")
def test_selective_scan_sequence_parallel_equals_one_device():
    """Mamba-1's selective scan (``ops.selective``): 4 shards x 2 batch shards, a given
    state, ``D``; outputs, final state and gradients against one device."""
    b, t, d, n = 2, 12, 3, 4
    ks = jax.random.split(jax.random.PRNGKey(25), 7)
    inputs = dict(
        x=jax.random.normal(ks[0], (b, t, d)),
        dt=jax.nn.softplus(jax.random.normal(ks[1], (b, t, d))),
        A=-jnp.exp(jax.random.normal(ks[2], (d, n))),
        B=jax.random.normal(ks[3], (b, t, n)),
        C=jax.random.normal(ks[4], (b, t, n)),
        D=jnp.ones((d,)),
    )
    s0 = la.SelectiveState(jax.random.normal(ks[5], (b, d, n)))
    w = jax.random.normal(ks[6], (b, t, d))

    def loss(fn, inputs):
        y, state = fn(**inputs, initial_state=s0, return_state=True)
        return jnp.sum(y * w) + jnp.sum(state.h), (y, state)

    parallel = functools.partial(
        la.sequence_parallel_selective_scan, axis_name="seq", batch_axis="batch",
        mesh=_mesh(4, 2), chunk_size=2,
    )  # fmt: skip
    single = functools.partial(la.selective_scan, chunk_size=2)
    grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), has_aux=True))(inputs)
    (d_in, (y, s)), (ref_d, (ref_y, ref_s)) = grad(parallel), grad(single)
    helpers.assert_close_normwise(y, ref_y)
    helpers.assert_close_normwise(s.h, ref_s.h)
    helpers.assert_close_normwise(d_in, ref_d)
