"""The feature-map zoo: identities, approximation quality, and agreement in every form."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized

import linattn_jax as la
from linattn_jax import feature_maps as fm
from tests import helpers
from tests.reference import reference_attention

B, T, H, D, DV = 2, 11, 2, 4, 3
KEY = jax.random.PRNGKey(42)

# name -> (map, expected f for d = D, normalise?). Signed estimates get no denominator.
MAPS = {
    "elu": (fm.elu, D, True),
    "relu": (fm.relu, D, True),
    "identity": (fm.identity, D, False),
    "softmax": (fm.softmax, D, True),
    "two_sided_relu": (fm.two_sided_relu, 2 * D, True),
    "dpfp": (fm.dpfp, 2 * D, True),
    "dpfp_nu3": (functools.partial(fm.dpfp, nu=3), 6 * D, True),
    "taylor": (fm.taylor, 1 + D + D * D, True),
    "favor_plus": (fm.favor_plus(KEY, D, 16), 16, True),
    "random_fourier": (fm.random_fourier(KEY, D, 8), 16, False),
    "cosformer": (fm.cosformer(max_length=32), 2 * D, True),
}

# FAVOR+ scales each query's features (exact under normalisation): compare without
# the absolute eps, whose weight relative to the denominator that scaling changes.
EPS = {"favor_plus": 0.0}


class EveryMapTest(chex.TestCase):
    @parameterized.parameters(*MAPS)
    def test_output_dimension_and_float32(self, name):
        phi, f, _ = MAPS[name]
        assert fm.feature_dim(phi, D) == f
        x = jnp.ones((B, T, H, D), jnp.bfloat16)
        out = phi(x, jnp.zeros((B, T), jnp.int32)) if name == "cosformer" else phi(x)
        chex.assert_shape(out, (B, T, H, f))
        chex.assert_type(out, jnp.float32)

    @parameterized.product(name=list(MAPS), method=["chunked", "scan", "quadratic"])
    def test_causal_forms_match_reference(self, name, method):
        phi, _, normalize = MAPS[name]
        eps = EPS.get(name, 1e-6)
        q, k, v = helpers.qkv(0, B, T, H, D, DV)
        fn = lambda phi, q, k, v: la.causal_linear_attention(
            q,
            k,
            v,
            feature_map=phi,
            method=method,
            chunk_size=4,
            normalize=normalize,
            eps=eps,
            return_state=True,
        )
        if isinstance(phi, fm.FavorPlus | fm.RandomFourier):
            out, state = jax.jit(fn)(phi, q, k, v)  # random features travel as a pytree
        else:
            out, state = jax.jit(functools.partial(fn, phi))(q, k, v)
        ref, ref_state = reference_attention(
            q, k, v, phi=phi, causal=True, normalize=normalize, eps=eps
        )
        tol = helpers.tol(jnp.float32)
        chex.assert_trees_all_close(out, ref, **tol)
        chex.assert_trees_all_close((state.s, state.z), ref_state, **tol)

    @parameterized.parameters(*MAPS)
    def test_noncausal_and_step_match_reference(self, name):
        phi, _, normalize = MAPS[name]
        eps = EPS.get(name, 1e-6)
        q, k, v = helpers.qkv(1, B, T, H, D, DV)
        tol = helpers.tol(jnp.float32)
        out = la.linear_attention(q, k, v, feature_map=phi, normalize=normalize, eps=eps)
        ref, _ = reference_attention(q, k, v, phi=phi, causal=False, normalize=normalize, eps=eps)
        chex.assert_trees_all_close(out, ref, **tol)
        full = la.causal_linear_attention(q, k, v, feature_map=phi, normalize=normalize, eps=eps)
        state = la.init_state(B, H, fm.feature_dim(phi, D), DV)
        step = jax.jit(
            functools.partial(
                la.causal_linear_attention_step, feature_map=phi, normalize=normalize, eps=eps
            )
        )
        for i in range(T):
            position = jnp.full((B,), i) if name == "cosformer" else None
            out_i, state = step(q[:, i], k[:, i], v[:, i], state, position=position)
            chex.assert_trees_all_close(out_i, full[:, i], **tol)

    @parameterized.parameters(*MAPS)
    def test_gradient_matches_reference(self, name):
        phi, _, normalize = MAPS[name]
        eps = EPS.get(name, 1e-6)
        q, k, v = helpers.qkv(2, B, T, H, D, DV)
        loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
        ours = lambda q, k, v: la.causal_linear_attention(
            q, k, v, feature_map=phi, chunk_size=4, normalize=normalize, eps=eps
        )
        ref = lambda q, k, v: reference_attention(
            q, k, v, phi=phi, causal=True, normalize=normalize, eps=eps
        )[0]
        grads = [jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v) for f in (ours, ref)]
        helpers.assert_close_normwise(grads[0], grads[1])


class AttributesTest(parameterized.TestCase):
    @parameterized.parameters(*MAPS)
    def test_signed_marks_exactly_the_maps_whose_kernel_goes_negative(self, name):
        """``signed`` (no safe denominator) iff phi(q).phi(k) < 0 for some random q, k
        (cosFormer within its range |i - j| <= max_length)."""
        phi = MAPS[name][0]
        q, k, _ = helpers.qkv(6, 1, 32, 4, D, 1)
        if name == "cosformer":
            positions = jnp.broadcast_to(jnp.arange(32), (1, 32))
            phi_q, phi_k = phi(q, positions), phi(k, positions)
        else:
            phi_q, phi_k = phi(q), phi(k)
        kernel = jnp.einsum("bthf,bshf->bhts", phi_q, phi_k)
        assert getattr(phi, "signed", False) == bool(jnp.any(kernel < 0)), name
        assert getattr(phi, "signed", False) == (name in ("identity", "random_fourier"))


class IdentitiesTest(parameterized.TestCase):
    def test_taylor_kernel_is_exact(self):
        with jax.enable_x64(True):
            q, k = jax.random.normal(KEY, (2, 5, 16), jnp.float64)
            d = q.shape[-1]
            kernel = jnp.sum(fm.taylor(q) * fm.taylor(k), axis=-1)
            dot = jnp.sum(q * k, axis=-1)
            expected = 1 + dot / math.sqrt(d) + dot**2 / (2 * d)
            chex.assert_trees_all_close(kernel, expected, rtol=1e-12)

    def test_taylor_gradient_matches_autodiff(self):
        """The hand-written gradient of taylor's outer products equals plain autodiff."""
        with jax.enable_x64(True):
            x = jax.random.normal(KEY, (3, 5, 6), jnp.float64)
            w = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 1 + 6 + 36), jnp.float64)

            def plain(x):
                d = x.shape[-1]
                outer = (x[..., :, None] * x[..., None, :]).reshape(x.shape[:-1] + (d * d,))
                ones = jnp.ones(x.shape[:-1] + (1,), x.dtype)
                scaled = outer / (math.sqrt(2.0) * math.sqrt(d))
                return jnp.concatenate([ones, x / d**0.25, scaled], axis=-1)

            chex.assert_trees_all_close(fm.taylor(x), plain(x), rtol=1e-14)
            grad = jax.grad(lambda x: jnp.sum(fm.taylor(x) * w))(x)
            expected = jax.grad(lambda x: jnp.sum(plain(x) * w))(x)
            chex.assert_trees_all_close(grad, expected, rtol=1e-12, atol=1e-12)

    def test_dpfp_nu1_is_products_of_neighbours(self):
        x = jnp.array([1.0, -2.0, 3.0])
        r = jnp.array([1.0, 0.0, 3.0, 0.0, 2.0, 0.0])
        chex.assert_trees_all_close(fm.dpfp(x), r * jnp.roll(r, 1))

    @parameterized.parameters(False, True)
    def test_cosformer_equals_its_quadratic_definition(self, causal):
        q, k, v = helpers.qkv(3, B, T, H, D, DV)
        m = 16
        i = jnp.arange(T)
        weight = jnp.cos(0.5 * math.pi * (i[:, None] - i[None, :]).astype(jnp.float32) / m)
        if causal:
            weight = jnp.where(i[:, None] >= i[None, :], weight, 0.0)
        scores = jnp.einsum("bthd,bshd->bhts", jax.nn.relu(q), jax.nn.relu(k)) * weight[None, None]
        expected = jnp.einsum("bhts,bshv->bthv", scores, v) / (
            jnp.sum(scores, -1).transpose(0, 2, 1)[..., None] + 1e-6
        )
        phi = fm.cosformer(m)
        out = (
            la.causal_linear_attention(q, k, v, feature_map=phi, chunk_size=4)
            if causal
            else la.linear_attention(q, k, v, feature_map=phi)
        )
        chex.assert_trees_all_close(out, expected, **helpers.tol(jnp.float32))

    def test_cosformer_streaming_with_positions(self):
        q, k, v = helpers.qkv(4, B, T, H, D, DV)
        phi = fm.cosformer(32)
        run = functools.partial(la.causal_linear_attention, feature_map=phi, return_state=True)
        whole, _ = run(q, k, v)
        first, state = run(q[:, :5], k[:, :5], v[:, :5])
        later = jnp.broadcast_to(jnp.arange(5, T), (B, T - 5))
        second, _ = run(q[:, 5:], k[:, 5:], v[:, 5:], initial_state=state, positions=later)
        chex.assert_trees_all_close(
            jnp.concatenate([first, second], 1), whole, **helpers.tol(jnp.float32)
        )


class RandomFeaturesTest(parameterized.TestCase):
    @parameterized.parameters((fm.favor_plus, True), (fm.random_fourier, False))
    def test_error_falls_as_num_features_grows(self, draw, normalize):
        """Mean error over 16 draws (keys folded from one fixed key) at each m."""
        d, t = 8, 16
        q, k, v = helpers.qkv(5, 1, t, 1, d, 4)
        q, k = 0.5 * q, 0.5 * k
        kernel = jnp.exp(jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d))  # exact softmax's
        if normalize:
            kernel = kernel / jnp.sum(kernel, axis=-1, keepdims=True)
        exact = jnp.einsum("bhts,bshv->bthv", kernel, v)

        @functools.partial(jax.jit, static_argnums=1)  # one program per m, not per draw
        def error(i, m):
            phi = draw(jax.random.fold_in(KEY, i), d, m)
            out = la.linear_attention(q, k, v, feature_map=phi, normalize=normalize)
            return jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact)

        def mean_error(m):
            return float(jnp.mean(jnp.stack([error(i, m) for i in range(16)])))

        errors = [mean_error(m) for m in (16, 64, 256, 1024)]
        assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors
        # Monte Carlo error goes as 1/sqrt(m) once m is large: 8x over 64x the features;
        # the normalised ratio converges more slowly at small m, so ask for 3x.
        assert errors[-1] < errors[0] / 3, errors

    @parameterized.parameters(fm.favor_plus, fm.random_fourier)
    def test_kernel_estimate_is_unbiased(self, draw):
        """Over 2000 draws the mean of phi(q).phi(k) is exp(q.k / sqrt(d)) within 4 s.e."""
        d = 8
        q, k = 0.5 * jax.random.normal(KEY, (2, d))

        def estimate(i):  # one draw's phi(q).phi(k); vectorised over the 2000 draws
            phi = draw(jax.random.fold_in(KEY, i), d, 16)
            return jnp.dot(phi(q), phi(k))

        estimates = jax.jit(jax.vmap(estimate))(jnp.arange(2000))
        standard_error = jnp.std(estimates) / math.sqrt(estimates.size)
        exact = jnp.exp(jnp.dot(q, k) / math.sqrt(d))
        assert abs(float(jnp.mean(estimates) - exact)) < 4 * float(standard_error)

    def test_favor_plus_is_positive_and_redraws(self):
        phi = fm.favor_plus(KEY, D, 32)
        x = 4.0 * jax.random.normal(KEY, (100, D))  # inside the documented range
        assert bool(jnp.all(phi(x) > 0)) and bool(jnp.all(jnp.isfinite(phi(x))))
        again = fm.favor_plus(KEY, D, 32)
        chex.assert_trees_all_equal(phi, again)  # the key alone decides the draw
        fresh = phi.redraw(jax.random.PRNGKey(7))
        assert fresh.projection.shape == phi.projection.shape
        assert not bool(jnp.allclose(fresh.projection, phi.projection))

    def test_favor_plus_does_not_overflow_when_query_and_key_align(self):
        """Key features peak at exp(|w|^2 / 2); unshifted, a query on the same w would
        square that past float32's range (d = 64: about exp(98))."""
        d, m = 64, 128
        phi = fm.favor_plus(KEY, d, m)
        w = phi.projection[jnp.argmax(jnp.linalg.norm(phi.projection, axis=-1))]
        x = jnp.broadcast_to(w * d**0.25, (1, 4, 1, d))
        v = jnp.arange(4.0).reshape(1, 4, 1, 1)
        for out in (
            la.linear_attention(x, x, v, feature_map=phi),
            la.causal_linear_attention(x, x, v, feature_map=phi),
        ):
            assert bool(jnp.all(jnp.isfinite(out))), out
        query = phi(x, is_query=True)
        assert float(jnp.max(query)) <= 1 / math.sqrt(m) + 1e-7

    def test_orthogonal_rows_within_a_block(self):
        w = fm.orthogonal_gaussian(KEY, 12, 8)
        chex.assert_shape(w, (12, 8))
        gram = w[:8] @ w[:8].T
        chex.assert_trees_all_close(gram - jnp.diag(jnp.diag(gram)), jnp.zeros((8, 8)), atol=1e-4)


class BadMapTest(parameterized.TestCase):
    def test_errors(self):
        q, k, v = helpers.qkv(0, B, T, H, D, DV)
        with pytest.raises(
            ValueError, match=r"'favor_plus' has parameters .*feature_maps.favor_plus"
        ):
            la.causal_linear_attention(q, k, v, feature_map="favor_plus")
        with pytest.raises(ValueError, match=r"random features were drawn for d=8, got inputs"):
            la.linear_attention(q, k, v, feature_map=fm.favor_plus(KEY, 8, 4))
        with pytest.raises(ValueError, match=r"num_features must be an int >= 1, got 0"):
            fm.favor_plus(KEY, D, 0)
        with pytest.raises(ValueError, match=r"nu must be an int >= 1, got 0"):
            fm.dpfp(q, nu=0)
        with pytest.raises(ValueError, match=r"only normalize=True cancels"):
            la.causal_linear_attention(
                q, k, v, feature_map=fm.favor_plus(KEY, D, 4), normalize=False
            )
        with pytest.raises(ValueError, match=r"max_length must be an int >= 1"):
            fm.cosformer(0)
        with pytest.raises(ValueError, match=r"needs positions: pass position"):
            la.causal_linear_attention_step(
                q[:, 0],
                k[:, 0],
                v[:, 0],
                la.init_state(B, H, 2 * D, DV),
                feature_map=fm.cosformer(8),
            )
        with pytest.raises(ValueError, match=r"positions must have shape \[batch, length\]"):
            la.causal_linear_attention(
                q, k, v, feature_map=fm.cosformer(8), positions=jnp.zeros((B, 3), jnp.int32)
            )
        with pytest.raises(ValueError, match=r"already registered"):
            fm.register("elu")(fm.relu)
