"""Decay, gating, normalisation, packed sequences and memory-lean gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.test_util import check_grads

import linattn_jax as la
from linattn_jax import feature_maps
from tests import helpers
from tests.reference import reference_attention

B, T, H, D, DV = 2, 13, 3, 8, 5
METHODS = ["chunked", "scan", "quadratic"]
DECAY = jnp.array([0.5, 0.9, 1.0])  # one per head; 1.0 is plain linear attention


def _options(name):
    """The keyword arguments of one option set, shared by ours and the reference."""
    return {
        "decay": dict(decay=DECAY),
        "scalar_decay": dict(decay=0.8),
        "gate": dict(gate=helpers.gate(1, B, T, H)),
        "decay_and_gate": dict(decay=DECAY, gate=helpers.gate(2, B, T, H)),
        "segments": dict(segment_ids=helpers.segment_ids(3, B, T, p=0.25)),
        "everything": dict(
            decay=DECAY,
            gate=helpers.gate(4, B, T, H),
            segment_ids=helpers.segment_ids(5, B, T, p=0.25),
            key_mask=helpers.key_mask(6, B, T),
        ),
    }[name]


OPTIONS = ["decay", "scalar_decay", "gate", "decay_and_gate", "segments", "everything"]


class CausalOptionsTest(chex.TestCase):
    # Under jit (the streaming test below calls every form and option without it). The
    # normaliser with an initial state, and neither: each path once per form and option.
    @parameterized.product(
        method=METHODS,
        option=OPTIONS,
        normalize_with_state=[(True, True), (False, False)],
    )
    def test_matches_reference(self, method, option, normalize_with_state):
        normalize, with_state = normalize_with_state
        q, k, v = helpers.qkv(0, B, T, H, D, DV)
        opts = _options(option)
        state = helpers.random_state(7, B, H, D, DV) if with_state else None
        fn = jax.jit(
            lambda q, k, v, s, opts: la.causal_linear_attention(
                q,
                k,
                v,
                method=method,
                chunk_size=4,
                initial_state=s,
                return_state=True,
                normalize=normalize,
                **opts,
            )
        )
        out, final = fn(q, k, v, state, opts)
        ref, ref_state = reference_attention(
            q,
            k,
            v,
            phi=feature_maps.elu,
            causal=True,
            initial_state=state,
            normalize=normalize,
            **opts,
        )
        tol = helpers.tol(jnp.float32)
        chex.assert_trees_all_close(out, ref, **tol)
        chex.assert_trees_all_close((final.s, final.z), ref_state, **tol)

    @parameterized.product(method=METHODS, option=["decay", "gate", "segments", "everything"])
    def test_gradient_matches_reference(self, method, option):
        q, k, v = helpers.qkv(8, B, T, H, D, DV)
        opts = _options(option)
        state = helpers.random_state(9, B, H, D, DV)
        decay, gate = opts.pop("decay", None), opts.pop("gate", None)

        def loss(fn, q, k, v, s, z, decay, gate):
            out, (s1, z1) = fn(q, k, v, la.LinearAttentionState(s, z), decay=decay, gate=gate)
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(s1)) + jnp.sum(z1**2)

        ours = functools.partial(
            la.causal_linear_attention, method=method, chunk_size=4, return_state=True, **opts
        )
        ours = lambda q, k, v, s, ours=ours, **kw: ours(q, k, v, initial_state=s, **kw)
        ref = lambda q, k, v, s, **kw: reference_attention(
            q, k, v, phi=feature_maps.elu, causal=True, initial_state=s, **opts, **kw
        )
        args = (q, k, v, state.s, state.z, decay, gate)
        grads = [
            jax.jit(jax.grad(functools.partial(loss, fn), argnums=range(7)))(*args)
            for fn in (ours, ref)
        ]
        helpers.assert_close_normwise(grads[0], grads[1])

    @parameterized.parameters("chunked", "scan")
    def test_check_grads_float64(self, method):
        with jax.enable_x64(True):
            rng = np.random.default_rng(0)
            q, k, v = (jnp.asarray(rng.normal(size=(1, 7, 2, 3))) for _ in range(3))
            gate = jnp.asarray(-rng.uniform(0.05, 1.0, size=(1, 7, 2)))
            s0 = jnp.asarray(rng.normal(size=(1, 2, 3, 3)))
            z0 = jnp.asarray(rng.uniform(0.5, 1.0, size=(1, 2, 3)))
            decay = jnp.asarray([0.7, 0.95])

            def fn(q, k, v, gate, s0, z0, decay):
                out, state = la.causal_linear_attention(
                    q,
                    k,
                    v,
                    method=method,
                    chunk_size=3,
                    gate=gate,
                    decay=decay,
                    initial_state=la.LinearAttentionState(s0, z0),
                    return_state=True,
                )
                return out, state.s, state.z

            check_grads(fn, (q, k, v, gate, s0, z0, decay), order=1, modes=["rev"])

    # Every form and option, split mid-chunk (5) or at a chunk boundary (8) in turn: each
    # form meets both splits, and each option both splits across the forms.
    @parameterized.parameters(
        *[
            (method, option, (5, 8)[(i + j) % 2])
            for i, method in enumerate(METHODS)
            for j, option in enumerate(OPTIONS)
        ]
    )
    def test_streaming_in_two_pieces_equals_whole(self, method, option, split):
        q, k, v = helpers.qkv(10, B, T, H, D, DV)
        opts = _options(option)
        if "segment_ids" in opts:  # the second piece's state continues its first segment
            opts["segment_ids"] = (
                opts["segment_ids"].at[:, split].set(opts["segment_ids"][:, split - 1])
            )
        run = functools.partial(
            la.causal_linear_attention, method=method, chunk_size=4, return_state=True
        )
        cut = lambda x, lo, hi: x if x is None or jnp.ndim(x) < 2 else x[:, lo:hi]
        piece = lambda lo, hi: {n: cut(x, lo, hi) for n, x in opts.items()}
        whole, final = run(q, k, v, **opts)
        first, mid = run(q[:, :split], k[:, :split], v[:, :split], **piece(0, split))
        second, end = run(
            q[:, split:], k[:, split:], v[:, split:], initial_state=mid, **piece(split, T)
        )
        tol = helpers.tol(jnp.float32)
        chex.assert_trees_all_close(jnp.concatenate([first, second], axis=1), whole, **tol)
        chex.assert_trees_all_close(end, final, **tol)

    @parameterized.product(
        option=["decay", "scalar_decay", "gate", "decay_and_gate"], normalize=[True, False]
    )
    def test_step_decoding_equals_full(self, option, normalize):
        q, k, v = helpers.qkv(11, B, T, H, D, DV)
        opts = _options(option)
        full, final = la.causal_linear_attention(
            q, k, v, return_state=True, chunk_size=4, normalize=normalize, **opts
        )
        step = jax.jit(functools.partial(la.causal_linear_attention_step, normalize=normalize))
        gate = opts.get("gate")
        state, outs = la.init_state(B, H, D, DV), []
        for i in range(T):
            out, state = step(
                q[:, i],
                k[:, i],
                v[:, i],
                state,
                decay=opts.get("decay"),
                gate=None if gate is None else gate[:, i],
            )
            outs.append(out)
        tol = helpers.tol(jnp.float32)
        chex.assert_trees_all_close(jnp.stack(outs, 1), full, **tol)
        chex.assert_trees_all_close(state, final, **tol)

    def test_segments_reset_the_state(self):
        """Packed sequences equal the same sequences run one at a time."""
        q, k, v = helpers.qkv(12, 1, 12, H, D, DV)
        seg = jnp.array([[0] * 5 + [1] * 4 + [2] * 3], jnp.int32)
        packed = la.causal_linear_attention(q, k, v, segment_ids=seg, decay=DECAY, chunk_size=4)
        alone = [
            la.causal_linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], decay=DECAY)
            for a, b in [(0, 5), (5, 9), (9, 12)]
        ]
        chex.assert_trees_all_close(
            packed, jnp.concatenate(alone, axis=1), **helpers.tol(jnp.float32)
        )

    @pytest.mark.slow
    @parameterized.product(method=["chunked", "scan"], dtype=[jnp.float32, jnp.bfloat16])
    def test_long_sequence_denominator_stays_finite(self, method, dtype):
        t = 65536
        q, k, v = helpers.qkv(13, 1, t, 1, 8, 8, dtype=dtype)
        out, state = jax.jit(
            functools.partial(
                la.causal_linear_attention, method=method, chunk_size=256, return_state=True
            )
        )(q, k, v)
        assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
        z = state.z
        assert bool(jnp.all(jnp.isfinite(z)) & jnp.all(z > 0)), z
        # The running denominator equals the plain sum of phi(k) to float32 accuracy.
        expected = jnp.sum(feature_maps.elu(k), axis=1)
        chex.assert_trees_all_close(z, expected, rtol=1e-4)


class NonCausalSegmentsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(masked=[False, True], normalize=[True, False])
    def test_block_diagonal_matches_reference(self, masked, normalize):
        t = 21
        q, k, v = helpers.qkv(14, B, t, H, D, DV)
        seg = helpers.segment_ids(15, B, t, p=0.2)
        mask = helpers.key_mask(16, B, t) if masked else None
        fn = self.variant(
            lambda q, k, v, seg, m: la.linear_attention(
                q, k, v, segment_ids=seg, key_mask=m, normalize=normalize
            )
        )
        ref, _ = reference_attention(
            q,
            k,
            v,
            phi=feature_maps.elu,
            causal=False,
            segment_ids=seg,
            key_mask=mask,
            normalize=normalize,
        )
        chex.assert_trees_all_close(fn(q, k, v, seg, mask), ref, **helpers.tol(jnp.float32))

    def test_gradient_matches_reference(self):
        q, k, v = helpers.qkv(17, B, 10, H, D, DV)
        seg = helpers.segment_ids(18, B, 10, p=0.3)
        loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
        grad = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))  # one program each
        ours = grad(lambda q, k, v: la.linear_attention(q, k, v, segment_ids=seg))(q, k, v)
        ref = grad(
            lambda q, k, v: reference_attention(
                q, k, v, phi=feature_maps.elu, causal=False, segment_ids=seg
            )[0]
        )(q, k, v)
        helpers.assert_close_normwise(ours, ref)


class MemoryTest(parameterized.TestCase):
    @parameterized.parameters("chunked", "scan")
    def test_gradient_stores_no_per_token_state(self, method):
        """Compiled scratch memory of the gradient, far below one state per token."""
        b, t, h, d = 1, 2048, 1, 32
        x = jnp.ones((b, t, h, d), jnp.float32)
        loss = lambda q, k, v: jnp.sum(
            la.causal_linear_attention(
                q, k, v, method=method, chunk_size=64, gate=jnp.zeros((b, t, h))
            )
        )
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
        scratch = compiled.memory_analysis().temp_size_in_bytes
        per_token_states = t * h * d * (d + 1) * 4
        assert scratch < per_token_states / 4, (scratch, per_token_states)


class BadOptionsTest(parameterized.TestCase):
    def test_errors(self):
        q, k, v = helpers.qkv(0, B, 6, H, D, DV)
        cases = [
            (
                dict(decay=jnp.ones(2)),
                r"decay must be a scalar or \[heads\]=\(3,\), got shape \(2,\)",
            ),
            (dict(decay=1.5), r"decay must lie in \(0, 1\]"),
            (dict(decay=jnp.array([0.5, 0.0, 0.9])), r"decay must lie in \(0, 1\]"),
            (
                dict(gate=jnp.zeros((B, 6))),
                r"gate must have shape \[batch, length, heads\]=\(2, 6, 3\)",
            ),
            (dict(segment_ids=jnp.zeros((B, 5), jnp.int32)), r"segment_ids must have shape"),
            (dict(segment_ids=jnp.zeros((B, 6))), r"segment_ids must be integers"),
        ]
        for overrides, message in cases:
            with self.subTest(message), pytest.raises(ValueError, match=message):
                la.causal_linear_attention(q, k, v, **overrides)
        with pytest.raises(ValueError, match=r"gate must have shape \[batch, heads\]"):
            la.causal_linear_attention_step(
                q[:, 0], k[:, 0], v[:, 0], la.init_state(B, H, D, DV), gate=jnp.zeros((B, 6, H))
            )
