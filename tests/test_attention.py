"""Every form of linear attention against the naive reference (tests/reference.py)."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized

import linattn_jax as la
from linattn_jax import feature_maps
from tests import helpers
from tests.reference import reference_attention

B, H, D, DV = 2, 3, 8, 5  # d != dv on purpose


class NonCausalTest(chex.TestCase):
    @parameterized.product(
        feature_map=["elu", "relu"],
        lengths=[(1, 1), (7, 13), (16, 5)],  # t != s
        masked=[False, True],
        dtype=[jnp.float32, jnp.bfloat16],
    )
    def test_matches_reference(self, feature_map, lengths, masked, dtype):
        t, s = lengths
        q, k, v = helpers.qkv(0, B, t, H, D, DV, s=s, dtype=dtype)
        mask = helpers.key_mask(1, B, s) if masked else None
        fn = jax.jit(
            lambda q, k, v, m: la.linear_attention(q, k, v, feature_map=feature_map, key_mask=m)
        )
        out = fn(q, k, v, mask)
        ref, _ = reference_attention(
            q, k, v, phi=feature_maps.get(feature_map), causal=False, key_mask=mask
        )
        chex.assert_shape(out, (B, t, H, DV))
        chex.assert_type(out, dtype)
        chex.assert_trees_all_close(out.astype(jnp.float32), ref, **helpers.tol(dtype))

    def test_identity_unnormalized_is_plain_linear_kernel(self):
        q, k, v = helpers.qkv(2, B, 6, H, D, DV, s=9)
        out = la.linear_attention(q, k, v, feature_map="identity", normalize=False)
        expected = jnp.einsum("bthd,bshd,bshv->bthv", q, k, v)
        chex.assert_trees_all_close(out, expected, **helpers.tol(jnp.float32))

    def test_padding_never_changes_real_tokens(self):
        q, k, v = helpers.qkv(3, B, 10, H, D, DV)
        out = la.linear_attention(q, k, v)
        pad = lambda x: jnp.concatenate([x, 100.0 * jnp.ones_like(x[:, :4])], axis=1)
        mask = jnp.concatenate([jnp.ones((B, 10), bool), jnp.zeros((B, 4), bool)], axis=1)
        padded = la.linear_attention(pad(q), pad(k), pad(v), key_mask=mask)
        chex.assert_trees_all_close(padded[:, :10], out, **helpers.tol(jnp.float32))

    def test_gradient_matches_reference(self):
        q, k, v = helpers.qkv(4, B, 7, H, D, DV, s=11)
        mask = helpers.key_mask(5, B, 11)
        loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
        grad = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))  # one program each
        ours = grad(lambda q, k, v: la.linear_attention(q, k, v, key_mask=mask))(q, k, v)
        ref = grad(
            lambda q, k, v: reference_attention(
                q, k, v, phi=feature_maps.elu, causal=False, key_mask=mask
            )[0]
        )(q, k, v)
        helpers.assert_close_normwise(ours, ref)


class CausalTest(chex.TestCase):
    @parameterized.product(
        method=["chunked", "scan"],
        t=[1, 13, 32],
        chunk_size=[1, 5, 16],
        dtype=[jnp.float32, jnp.bfloat16],
    )
    def test_matches_reference(self, method, t, chunk_size, dtype):
        q, k, v = helpers.qkv(10, B, t, H, D, DV, dtype=dtype)
        fn = jax.jit(
            lambda q, k, v: la.causal_linear_attention(
                q, k, v, method=method, chunk_size=chunk_size
            )
        )
        out = fn(q, k, v)
        ref, _ = reference_attention(q, k, v, phi=feature_maps.elu, causal=True)
        chex.assert_shape(out, (B, t, H, DV))
        chex.assert_type(out, dtype)
        chex.assert_trees_all_close(out.astype(jnp.float32), ref, **helpers.tol(dtype))

    @parameterized.product(
        method=["chunked", "scan", "quadratic"],
        feature_map=["elu", "relu", "identity"],
        masked=[False, True],
        with_state=[False, True],
    )
    def test_options_match_reference(self, method, feature_map, masked, with_state):
        t = 11
        q, k, v = helpers.qkv(11, B, t, H, D, DV)
        mask = helpers.key_mask(12, B, t) if masked else None
        state = helpers.random_state(13, B, H, D, DV) if with_state else None
        normalize = feature_map != "identity"  # a signed kernel has no safe denominator
        fn = jax.jit(
            lambda q, k, v, m, s: la.causal_linear_attention(
                q,
                k,
                v,
                feature_map=feature_map,
                method=method,
                chunk_size=4,
                key_mask=m,
                initial_state=s,
                return_state=True,
                normalize=normalize,
            )
        )
        out, final = fn(q, k, v, mask, state)
        ref, (ref_s, ref_z) = reference_attention(
            q,
            k,
            v,
            phi=feature_maps.get(feature_map),
            causal=True,
            key_mask=mask,
            initial_state=state,
            normalize=normalize,
        )
        tol = helpers.tol(jnp.float32)
        chex.assert_trees_all_close(out, ref, **tol)
        chex.assert_trees_all_close((final.s, final.z), (ref_s, ref_z), **tol)
        chex.assert_type((final.s, final.z), jnp.float32)

    @parameterized.parameters("chunked", "scan", "quadratic")
    def test_gradient_matches_reference(self, method):
        t = 13
        q, k, v = helpers.qkv(14, B, t, H, D, DV)
        state = helpers.random_state(15, B, H, D, DV)

        def loss(fn, q, k, v, s, z):
            out, (s1, z1) = fn(q, k, v, la.LinearAttentionState(s, z))
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(s1)) + jnp.sum(z1**2)

        ours = lambda q, k, v, s: la.causal_linear_attention(
            q, k, v, method=method, chunk_size=4, initial_state=s, return_state=True
        )
        ref = lambda q, k, v, s: reference_attention(
            q, k, v, phi=feature_maps.elu, causal=True, initial_state=s
        )
        grads = [
            jax.jit(jax.grad(functools.partial(loss, fn), argnums=range(5)))(
                q, k, v, state.s, state.z
            )
            for fn in (ours, ref)
        ]
        helpers.assert_close_normwise(grads[0], grads[1])

    @parameterized.product(method=["chunked", "scan", "quadratic"], split=[1, 6, 9])
    def test_streaming_in_two_pieces_equals_whole(self, method, split):
        t = 14
        q, k, v = helpers.qkv(16, B, t, H, D, DV)
        run = functools.partial(
            la.causal_linear_attention, method=method, chunk_size=4, return_state=True
        )
        whole, final = run(q, k, v)
        first, mid = run(q[:, :split], k[:, :split], v[:, :split])
        second, end = run(q[:, split:], k[:, split:], v[:, split:], initial_state=mid)
        tol = helpers.tol(jnp.float32)
        chex.assert_trees_all_close(jnp.concatenate([first, second], axis=1), whole, **tol)
        chex.assert_trees_all_close(end, final, **tol)

    @parameterized.parameters(jnp.float32, jnp.bfloat16)
    def test_step_decoding_equals_full(self, dtype):
        t = 9
        q, k, v = helpers.qkv(17, B, t, H, D, DV, dtype=dtype)
        state0 = helpers.random_state(18, B, H, D, DV)
        full, final = la.causal_linear_attention(
            q, k, v, initial_state=state0, return_state=True, chunk_size=4
        )
        step = jax.jit(la.causal_linear_attention_step)
        state, outs = state0, []
        for i in range(t):
            out, state = step(q[:, i], k[:, i], v[:, i], state)
            chex.assert_shape(out, (B, H, DV))
            chex.assert_type(out, dtype)
            outs.append(out)
        tol = helpers.tol(dtype)
        chex.assert_trees_all_close(
            jnp.stack(outs, 1).astype(jnp.float32), full.astype(jnp.float32), **tol
        )
        chex.assert_trees_all_close(state, final, **helpers.tol(jnp.float32))

    def test_init_state(self):
        state = la.init_state(2, 3, 4, 5)
        chex.assert_shape((state.s, state.z), ((2, 3, 4, 5), (2, 3, 4)))
        chex.assert_type((state.s, state.z), jnp.float32)
        chex.assert_trees_all_equal(state, jax.tree.map(jnp.zeros_like, state))

    def test_padding_never_changes_real_tokens(self):
        q, k, v = helpers.qkv(19, B, 10, H, D, DV)
        out = la.causal_linear_attention(q, k, v, chunk_size=4)
        pad = lambda x: jnp.concatenate([100.0 * jnp.ones_like(x[:, :3]), x], axis=1)
        mask = jnp.concatenate([jnp.zeros((B, 3), bool), jnp.ones((B, 10), bool)], axis=1)
        padded = la.causal_linear_attention(pad(q), pad(k), pad(v), key_mask=mask, chunk_size=4)
        chex.assert_trees_all_close(padded[:, 3:], out, **helpers.tol(jnp.float32))


class EagerTest(chex.TestCase):
    """The forms called without jit agree as they do compiled: one shape each, in both
    dtypes (the parameterised tests above run under jit)."""

    @parameterized.product(dtype=[jnp.float32, jnp.bfloat16], masked=[False, True])
    def test_eager_matches_reference(self, dtype, masked):
        q, k, v = helpers.qkv(22, B, 11, H, D, DV, s=11, dtype=dtype)
        mask = helpers.key_mask(23, B, 11) if masked else None
        tol = helpers.tol(dtype)
        ref, _ = reference_attention(q, k, v, phi=feature_maps.elu, causal=False, key_mask=mask)
        out = la.linear_attention(q, k, v, key_mask=mask)
        chex.assert_trees_all_close(out.astype(jnp.float32), ref, **tol)
        ref, _ = reference_attention(q, k, v, phi=feature_maps.elu, causal=True, key_mask=mask)
        for method in ("chunked", "scan", "quadratic"):
            out = la.causal_linear_attention(q, k, v, method=method, chunk_size=4, key_mask=mask)
            chex.assert_type(out, dtype)
            chex.assert_trees_all_close(out.astype(jnp.float32), ref, **tol)


class TransformsTest(chex.TestCase):
    def test_no_retrace_on_second_call(self):
        fn = jax.jit(
            chex.assert_max_traces(
                lambda q, k, v: la.causal_linear_attention(q, k, v, chunk_size=4), n=1
            )
        )
        for seed in range(3):
            fn(*helpers.qkv(seed, B, 10, H, D, DV))
        noncausal = jax.jit(chex.assert_max_traces(la.linear_attention, n=1))
        for seed in range(3):
            noncausal(*helpers.qkv(seed, B, 10, H, D, DV))

    def test_jit_with_static_options(self):
        q, k, v = helpers.qkv(20, B, 10, H, D, DV)
        fn = jax.jit(
            la.causal_linear_attention,
            static_argnames=("feature_map", "method", "chunk_size", "return_state"),
        )
        out, state = fn(q, k, v, method="scan", chunk_size=3, return_state=True)
        chex.assert_trees_all_close(
            out, la.causal_linear_attention(q, k, v), **helpers.tol(jnp.float32)
        )
        chex.assert_shape(state.s, (B, H, D, DV))

    @parameterized.parameters("chunked", "scan", "quadratic")
    def test_vmap_over_an_extra_axis(self, method):
        q, k, v = helpers.qkv(21, 4 * B, 6, H, D, DV)
        split = lambda x: x.reshape((4, B) + x.shape[1:])
        fn = functools.partial(la.causal_linear_attention, method=method, chunk_size=4)
        out = jax.vmap(fn)(split(q), split(k), split(v))
        chex.assert_trees_all_close(out, split(fn(q, k, v)), **helpers.tol(jnp.float32))


class BadInputTest(parameterized.TestCase):
    def test_causal_errors(self):
        q, k, v = helpers.qkv(0, B, 6, H, D, DV)
        cases = [
            (
                dict(q=q[0]),
                r"q must have rank 4 \[batch, length, heads, dim\], got shape \(6, 3, 8\)",
            ),
            (dict(k=k[:1]), r"q and k and v must agree in batch and heads"),
            (dict(k=k[:, :, :2]), r"q and k and v must agree in batch and heads"),
            (dict(v=v[:, :4]), r"k and v must agree in key length"),
            (dict(k=k[..., :4], q=q[..., :4], v=v[:, :5]), r"key length"),
            (dict(k=k[..., :4]), r"q and k must agree in head dimension"),
            (dict(q=q[:, :5]), r"length \(causal attention\).*q \(2, 5, 3, 8\)"),
            (dict(method="fft"), r"method must be one of \('chunked', 'scan', 'quadratic'\)"),
            (dict(chunk_size=0), r"chunk_size must be an int >= 1, got 0"),
            (dict(chunk_size=2.5), r"chunk_size must be an int >= 1, got 2.5"),
            (dict(feature_map="nope"), r"feature_map must be one of .*'elu'.*got 'nope'"),
            (dict(feature_map=lambda x: x[..., 0]), r"feature_map must map \[\.\.\., d\]"),
            (
                dict(key_mask=jnp.ones((B, 5), bool)),
                r"key_mask must have shape .*\(2, 6\), got \(2, 5\)",
            ),
            (dict(key_mask=jnp.ones((B, 6), jnp.int32)), r"key_mask must be bool"),
            (dict(initial_state=la.init_state(B, H, D, DV + 1)), r"state.s must have shape"),
            (dict(initial_state=(1, 2)), r"state must be a LinearAttentionState"),
        ]
        for overrides, message in cases:
            args = dict(q=q, k=k, v=v) | overrides
            with self.subTest(message), pytest.raises(ValueError, match=message):
                la.causal_linear_attention(**args)

    def test_noncausal_errors(self):
        q, k, v = helpers.qkv(0, B, 6, H, D, DV, s=4)
        with pytest.raises(ValueError, match=r"k and v must agree in key length"):
            la.linear_attention(q, k, v[:, :3])
        with pytest.raises(ValueError, match=r"key_mask must have shape .*\(2, 4\), got \(2, 6\)"):
            la.linear_attention(q, k, v, key_mask=jnp.ones((B, 6), bool))
        with pytest.raises(ValueError, match=r"segment_ids .*self-attention"):
            la.linear_attention(q, k, v, segment_ids=jnp.zeros((B, 6), jnp.int32))

    def test_step_errors(self):
        q, k, v = (x[:, 0] for x in helpers.qkv(0, B, 1, H, D, DV))
        state = la.init_state(B, H, D, DV)
        with pytest.raises(ValueError, match=r"q must have rank 3 \[batch, heads, dim\]"):
            la.causal_linear_attention_step(q[:, None], k, v, state)
        with pytest.raises(ValueError, match=r"q and k and v must agree in batch and heads"):
            la.causal_linear_attention_step(q, k[:1], v, state)
        with pytest.raises(ValueError, match=r"state.z must have shape"):
            la.causal_linear_attention_step(q, k, v, state._replace(z=state.z[..., :2]))

    def test_init_state_errors(self):
        with pytest.raises(ValueError, match=r"value_dim must be an int >= 1, got 0"):
            la.init_state(1, 2, 3, 0)
