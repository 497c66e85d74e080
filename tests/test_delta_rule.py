"""The delta rule (DeltaNet, Gated DeltaNet, KDA) and GLA against per-token references."""

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
from tests.reference_recurrent import delta_rule_reference, gla_reference

B, T, H, D, DV = 2, 13, 3, 8, 5
VARIANTS = ["deltanet", "gated", "kda"]


def _inputs(seed, b=B, t=T, h=H, d=D, dv=DV, variant="gated", dtype=jnp.float32):
    """q, k (L2-normalised), v, beta in (0, 1) and the variant's gate (or None)."""
    q, k, v = helpers.qkv(seed, b, t, h, d, dv)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    kb, kg = jax.random.split(jax.random.PRNGKey(seed + 100))
    beta = jax.nn.sigmoid(jax.random.normal(kb, (b, t, h)))
    gate = {
        "deltanet": None,
        "gated": -jax.nn.softplus(jax.random.normal(kg, (b, t, h))),
        "kda": -jax.nn.softplus(jax.random.normal(kg, (b, t, h, d))),
    }[variant]
    cast = lambda x: None if x is None else x.astype(dtype)
    return cast(q), cast(k), cast(v), cast(beta), gate


def _reference(q, k, v, beta, gate=None, **kwargs):
    """The float64 per-token reference, returned as float32."""
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)
    with jax.enable_x64(True):
        kwargs = {
            n: f64(x) if n != "segment_ids" and n != "key_mask" else x for n, x in kwargs.items()
        }
        out, s = delta_rule_reference(f64(q), f64(k), f64(v), f64(beta), gate=f64(gate), **kwargs)
        return np.asarray(out, np.float32), np.asarray(s, np.float32)


def _state(seed, b=B, h=H, d=D, dv=DV):
    return la.DeltaRuleState(s=0.3 * jax.random.normal(jax.random.PRNGKey(seed), (b, h, d, dv)))


class DeltaRuleTest(chex.TestCase):
    # Every variant with every form and chunk size, jitted or eager in turn: each variant,
    # each chunk size and the scan run both ways.
    @parameterized.parameters(
        *[
            (v, method, c, (i + j) % 2 == 1)
            for i, v in enumerate(VARIANTS)
            for j, (method, c) in enumerate(
                [("chunked", 1), ("chunked", 4), ("chunked", 64), ("scan", 4)]
            )
        ]
    )
    def test_matches_reference(self, variant, method, chunk_size, jit):
        q, k, v, beta, gate = _inputs(0, variant=variant)
        s0 = _state(1)
        fn = (jax.jit if jit else lambda f: f)(
            lambda q, k, v, beta, gate, s0: la.delta_rule(
                q,
                k,
                v,
                beta,
                gate=gate,
                method=method,
                chunk_size=chunk_size,
                initial_state=s0,
                return_state=True,
            )
        )
        out, state = fn(q, k, v, beta, gate, s0)
        ref_out, ref_s = _reference(q, k, v, beta, gate, initial_state=s0.s)
        chex.assert_shape(out, (B, T, H, DV))
        chex.assert_trees_all_close(out, ref_out, **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state.s, ref_s, **helpers.tol(jnp.float32))

    @parameterized.product(variant=VARIANTS, method=["chunked", "scan"])
    def test_mask_segments_and_wide_beta(self, variant, method):
        """Padding (holding NaN and inf), packed sequences and beta in (0, 2)."""
        q, k, v, beta, gate = _inputs(2, variant=variant)
        beta = 2.0 * beta  # negative eigenvalues allowed
        mask = helpers.key_mask(3, B, T)
        seg = helpers.segment_ids(4, B, T, p=0.25)
        ref_out, ref_s = _reference(q, k, v, beta, gate, key_mask=mask, segment_ids=seg)
        pad = ~mask[:, :, None, None]
        poison = lambda x, val: jnp.where(pad if x.ndim == 4 else pad[..., 0], val, x)
        q, k, v = poison(q, jnp.nan), poison(k, jnp.inf), poison(v, jnp.nan)
        beta = poison(beta, jnp.nan)
        gate = None if gate is None else poison(gate, jnp.nan)
        kw = dict(gate=gate, method=method, chunk_size=4, key_mask=mask, segment_ids=seg)
        out, state = la.delta_rule(q, k, v, beta, return_state=True, **kw)
        chex.assert_trees_all_close(out, ref_out, **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state.s, ref_s, **helpers.tol(jnp.float32))
        grads = jax.grad(
            lambda q, k, v, beta, gate: jnp.sum(
                la.delta_rule(q, k, v, beta, **{**kw, "gate": gate})
            ),
            argnums=(0, 1, 2, 3, 4) if gate is not None else (0, 1, 2, 3),
        )(q, k, v, beta, gate)
        for g in grads:
            assert bool(jnp.all(jnp.isfinite(g)))
            assert bool(jnp.all(jnp.where(pad if g.ndim == 4 else pad[..., 0], g, 0) == 0))

    @parameterized.product(variant=VARIANTS, method=["chunked", "scan"])
    def test_gradients_match_reference(self, variant, method):
        q, k, v, beta, gate = _inputs(5, t=9, variant=variant)
        s0 = _state(6).s
        w = jax.random.normal(jax.random.PRNGKey(7), (B, 9, H, DV))

        def ours(q, k, v, beta, gate, s0):
            out, state = la.delta_rule(
                q,
                k,
                v,
                beta,
                gate=gate,
                method=method,
                chunk_size=4,
                initial_state=la.DeltaRuleState(s0),
                return_state=True,
            )
            return jnp.sum(out * w) + jnp.sum(state.s**2)

        def ref(q, k, v, beta, gate, s0):
            out, s = delta_rule_reference(q, k, v, beta, gate=gate, initial_state=s0)
            return jnp.sum(out * w) + jnp.sum(s**2)

        args = (q, k, v, beta, gate, s0)
        argnums = (0, 1, 2, 3, 5) if gate is None else (0, 1, 2, 3, 4, 5)
        got = jax.jit(jax.grad(ours, argnums=argnums))(*args)  # one program each
        want = jax.jit(jax.grad(ref, argnums=argnums))(*args)
        helpers.assert_close_normwise(got, want)

    @parameterized.parameters(*VARIANTS)
    def test_check_grads_float64(self, variant):
        with jax.enable_x64(True):
            q, k, v, beta, gate = _inputs(8, b=1, t=7, h=2, d=4, dv=3, variant=variant)
            f64 = lambda x: None if x is None else x.astype(jnp.float64)
            q, k, v, beta, gate = map(f64, (q, k, v, beta, gate))
            fn = lambda q, k, v, beta, gate: la.delta_rule(q, k, v, beta, gate=gate, chunk_size=3)
            check_grads(fn, (q, k, v, beta, gate), order=1, modes=["rev"])

    # One token, and a sequence shorter than one (default) chunk: 5 tokens added nothing.
    @parameterized.product(variant=VARIANTS, t=[1, 13])
    def test_steps_equal_full(self, variant, t):
        q, k, v, beta, gate = _inputs(9, t=t, variant=variant)
        s0 = _state(10)
        full, final = la.delta_rule(q, k, v, beta, gate=gate, initial_state=s0, return_state=True)
        state, outs = s0, []
        step = jax.jit(la.delta_rule_step)
        for i in range(t):
            g = None if gate is None else gate[:, i]
            o, state = step(q[:, i], k[:, i], v[:, i], beta[:, i], state, gate=g)
            outs.append(o)
        chex.assert_trees_all_close(jnp.stack(outs, 1), full, **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state.s, final.s, **helpers.tol(jnp.float32))

    @parameterized.parameters(*VARIANTS)
    def test_streaming_in_pieces(self, variant):
        q, k, v, beta, gate = _inputs(11, t=23, variant=variant)
        full, final = la.delta_rule(q, k, v, beta, gate=gate, chunk_size=4, return_state=True)
        state, outs = None, []
        for lo, hi in [(0, 5), (5, 6), (6, 23)]:
            g = None if gate is None else gate[:, lo:hi]
            sl = slice(lo, hi)
            o, state = la.delta_rule(
                q[:, sl],
                k[:, sl],
                v[:, sl],
                beta[:, sl],
                gate=g,
                chunk_size=4,
                initial_state=state,
                return_state=True,
            )
            outs.append(o)
        chex.assert_trees_all_close(jnp.concatenate(outs, 1), full, **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state.s, final.s, **helpers.tol(jnp.float32))

    # -inf per head and per channel; -30 per head, -20 per channel.
    @parameterized.parameters(
        ("gated", -jnp.inf), ("kda", -jnp.inf), ("gated", -30.0), ("kda", -20.0)
    )
    def test_strong_gates_and_resets(self, variant, value):
        """A gate of -inf (a full reset) or -30 / -20 per token at some tokens stays exact."""
        q, k, v, beta, gate = _inputs(12, t=16, variant=variant)
        strong = jax.random.bernoulli(jax.random.PRNGKey(13), 0.3, gate.shape)
        gate = jnp.where(strong, value, gate)
        ref_out, ref_s = _reference(q, k, v, beta, gate)
        for method in ["chunked", "scan"]:
            out, state = la.delta_rule(
                q, k, v, beta, gate=gate, method=method, chunk_size=8, return_state=True
            )
            chex.assert_trees_all_close(out, ref_out, **helpers.tol(jnp.float32))
            chex.assert_trees_all_close(state.s, ref_s, **helpers.tol(jnp.float32))
            grads = jax.jit(  # one program (eagerly: op by op)
                jax.grad(
                    lambda q, k, g, m=method: jnp.sum(
                        la.delta_rule(q, k, v, beta, gate=g, method=m)
                    ),
                    argnums=(0, 1, 2),
                )
            )(q, k, gate)
            assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)

    @parameterized.parameters(32, 64)
    def test_per_channel_gates_in_sub_chunks(self, chunk_size):
        """Chunks above 16 tokens split per-channel decays into sub-chunks: still exact,
        with strong gates and per-channel resets crossing the sub-chunk boundaries."""
        q, k, v, beta, gate = _inputs(25, t=70, variant="kda")
        strong = jax.random.bernoulli(jax.random.PRNGKey(26), 0.05, gate.shape)
        gate = jnp.where(strong, -jnp.inf, gate).at[:, 20:23].set(-30.0)
        ref_out, ref_s = _reference(q, k, v, beta, gate)
        out, state = la.delta_rule(
            q, k, v, beta, gate=gate, chunk_size=chunk_size, return_state=True
        )
        chex.assert_trees_all_close(out, ref_out, **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state.s, ref_s, **helpers.tol(jnp.float32))
        phi = feature_maps.get("elu")
        with jax.enable_x64(True):
            f64 = lambda x: np.asarray(x, np.float64)
            gla, _ = gla_reference(f64(phi(q)), f64(phi(k)), f64(v), f64(gate))
        out = la.causal_linear_attention(q, k, v, gate=gate, chunk_size=chunk_size)
        chex.assert_trees_all_close(out, np.asarray(gla, np.float32), **helpers.tol(jnp.float32))
        loss = lambda method: (
            lambda q, k, g: jnp.sum(
                la.delta_rule(q, k, v, beta, gate=g, method=method, chunk_size=chunk_size) ** 2
            )
        )
        got = jax.jit(jax.grad(loss("chunked"), argnums=(0, 1, 2)))(q, k, gate)  # one program
        want = jax.jit(jax.grad(loss("scan"), argnums=(0, 1, 2)))(q, k, gate)
        helpers.assert_close_normwise(got, want)

    def test_every_token_at_minus_thirty(self):
        """Per-channel gates of -30 on every token: the chunk's decays span -1920, still finite."""
        q, k, v, beta, _ = _inputs(14, t=70, variant="kda")
        gate = jnp.full((B, 70, H, D), -30.0)
        ref_out, _ = _reference(q, k, v, beta, gate)
        out = la.delta_rule(q, k, v, beta, gate=gate, chunk_size=64)
        chex.assert_trees_all_close(out, ref_out, **helpers.tol(jnp.float32))

    def test_bfloat16_inputs(self):
        q, k, v, beta, gate = _inputs(15, variant="gated", dtype=jnp.bfloat16)
        out = la.delta_rule(q, k, v, beta, gate=gate)
        assert out.dtype == jnp.bfloat16
        ref_out, _ = _reference(q, k, v, beta, gate)
        chex.assert_trees_all_close(out.astype(jnp.float32), ref_out, **helpers.tol(jnp.bfloat16))

    def test_empty_sequence(self):
        q, k, v, beta, gate = _inputs(16, t=0, variant="kda")
        s0 = _state(17)
        out, state = la.delta_rule(q, k, v, beta, gate=gate, initial_state=s0, return_state=True)
        chex.assert_shape(out, (B, 0, H, DV))
        chex.assert_trees_all_equal(state.s, s0.s)
        q, k, v, beta, gate = _inputs(16, b=0, variant="kda")  # an empty batch
        chex.assert_shape(la.delta_rule(q, k, v, beta, gate=gate), (0,) + q.shape[1:3] + (DV,))

    @pytest.mark.slow
    def test_long_sequence_is_finite(self):
        q, k, v, beta, gate = _inputs(18, b=1, t=65536, h=1, d=16, dv=16, variant="gated")
        out, state = jax.jit(lambda *a: la.delta_rule(*a[:4], gate=a[4], return_state=True))(
            q, k, v, beta, gate
        )
        assert bool(jnp.all(jnp.isfinite(out))) and bool(jnp.all(jnp.isfinite(state.s)))

    @parameterized.product(method=["chunked", "scan"], per_channel=[False, True])
    def test_gradient_stores_no_per_token_state(self, method, per_channel):
        """The gradient's compiled scratch grows by far less than one state per token."""
        h, d = 1, 32

        def scratch(t):
            x = jnp.ones((1, t, h, d), jnp.float32) / np.sqrt(d)
            beta = jnp.full((1, t, h), 0.5)
            gate = jnp.zeros((1, t, h, d) if per_channel else (1, t, h))
            loss = lambda q, k, v, beta, gate: jnp.sum(
                la.delta_rule(q, k, v, beta, gate=gate, method=method, chunk_size=64)
            )
            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
            return grad.lower(x, x, x, beta, gate).compile().memory_analysis().temp_size_in_bytes

        per_token = (scratch(4096) - scratch(1024)) / 3072
        state_bytes = h * d * d * 4
        assert per_token < state_bytes / 4, (per_token, state_bytes)

    def test_errors(self):
        q, k, v, beta, gate = _inputs(19, t=6)
        cases = [
            (
                dict(beta=beta[:, :, :2]),
                r"beta must have shape \[batch, length, heads\]=\(2, 6, 3\)",
            ),
            (dict(beta=beta + 2.5), r"beta must lie in \[0, 2\]"),
            (dict(beta=-beta), r"beta must lie in \[0, 2\]"),
            (dict(beta=(beta > 0.5)), r"beta must be a floating-point array"),
            (
                dict(gate=gate[..., :2]),
                r"gate must have shape \[batch, length, heads\]=\(2, 6, 3\) or",
            ),
            (
                dict(gate=jnp.zeros((B, 6, H, D + 1))),
                r"\[batch, length, heads, channels\]=\(2, 6, 3, 8\)",
            ),
            (dict(gate=-gate), r"gate must be log-decays <= 0"),
            (dict(k=k[..., :4]), r"q and k must agree in head dimension"),
            (dict(method="fast"), r"method must be one of \('chunked', 'scan'\) or 'pallas'"),
            (dict(chunk_size=0), r"chunk_size must be an int >= 1"),
            (
                dict(initial_state=la.DeltaRuleState(jnp.zeros((B, H, D, D)))),
                r"state.s must have shape",
            ),
            (dict(initial_state=la.LinearAttentionState(0, 0)), r"state must be a DeltaRuleState"),
            (dict(v=jnp.ones((B, 6, H, DV), jnp.int32)), r"v must be a floating-point array"),
        ]
        for kwargs, message in cases:
            args = dict(q=q, k=k, v=v, beta=beta, gate=gate) | kwargs
            with self.subTest(message), pytest.raises(ValueError, match=message):
                la.delta_rule(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("beta"), **args)
        s = la.init_delta_state(B, H, D, DV)
        with pytest.raises(ValueError, match=r"beta must have shape \[batch, heads\]=\(2, 3\)"):
            la.delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta, s)
        with pytest.raises(ValueError, match=r"gate must have shape \[batch, heads\]=\(2, 3\) or"):
            la.delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], s, gate=gate)
        with pytest.raises(ValueError, match=r"key_dim must be an int >= 1"):
            la.init_delta_state(B, H, 0, DV)


class GatedLinearAttentionTest(chex.TestCase):
    """GLA: the additive rule with one gate per feature channel."""

    # Every form with and without the normaliser, jitted or eager in turn: each form and
    # each normaliser setting runs both ways.
    @parameterized.parameters(
        *[
            (method, normalize, (i + j) % 2 == 0)
            for i, method in enumerate(["chunked", "scan", "quadratic"])
            for j, normalize in enumerate([True, False])
        ]
    )
    def test_matches_reference(self, method, normalize, jit):
        q, k, v = helpers.qkv(20, B, T, H, D, DV)
        gate = -jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(21), (B, T, H, D)))
        s0 = helpers.random_state(22, B, H, D, DV)
        fn = (jax.jit if jit else lambda f: f)(
            lambda q, k, v, gate, s0: la.causal_linear_attention(
                q,
                k,
                v,
                gate=gate,
                method=method,
                chunk_size=4,
                normalize=normalize,
                initial_state=s0,
                return_state=True,
            )
        )
        out, state = fn(q, k, v, gate, s0)
        phi = feature_maps.get("elu")
        f64 = lambda x: np.asarray(x, np.float64)
        with jax.enable_x64(True):
            ref, (s, z) = gla_reference(
                f64(phi(q)), f64(phi(k)), f64(v), f64(gate),
                initial_state=(f64(s0.s), f64(s0.z)), normalize=normalize,
            )  # fmt: skip
        chex.assert_trees_all_close(out, np.asarray(ref, np.float32), **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state.s, np.asarray(s, np.float32), **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state.z, np.asarray(z, np.float32), **helpers.tol(jnp.float32))

    @parameterized.parameters("chunked", "scan")
    def test_gradients_and_steps(self, method):
        q, k, v = helpers.qkv(23, B, 9, H, D, DV)
        gate = -jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(24), (B, 9, H, D)))
        gate = gate.at[:, 4, 0].set(-jnp.inf)  # a full reset of one head's channels
        phi = feature_maps.get("elu")
        ours = lambda q, k, v, g: jnp.sum(
            la.causal_linear_attention(q, k, v, gate=g, method=method, chunk_size=4) ** 2
        )
        ref = lambda q, k, v, g: jnp.sum(gla_reference(phi(q), phi(k), v, g)[0] ** 2)
        got = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, gate)
        want = jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, gate)
        helpers.assert_close_normwise(got, want)
        full, final = la.causal_linear_attention(q, k, v, gate=gate, return_state=True)
        state, outs = la.init_state(B, H, D, DV), []
        for i in range(9):
            o, state = la.causal_linear_attention_step(
                q[:, i], k[:, i], v[:, i], state, gate=gate[:, i]
            )
            outs.append(o)
        chex.assert_trees_all_close(jnp.stack(outs, 1), full, **helpers.tol(jnp.float32))
        chex.assert_trees_all_close(state, final, **helpers.tol(jnp.float32))


@pytest.mark.parametrize(
    "x_shape, scale_shape",
    [((2, 3, 5, 8), (2, 3, 5, 1)), ((2, 3, 5, 8), (2, 1, 5, 1)), ((2, 3, 5, 8), (2, 3, 5, 8))],
)
def test_row_scaling_sums_its_gradient_as_a_product(x_shape, scale_shape):
    """``chunking.scaled``, the chunks' per-token factors (decays, beta): the product and its
    gradient equal plain broadcasting's, and a factor per row gets its gradient from a
    ``dot_general`` with ones, not a ``reduce_sum`` (XLA:CPU's YNNPACK ran those row sums
    an order of magnitude slower inside the chunk loop)."""
    from linattn_jax.ops import chunking

    x = jax.random.normal(jax.random.PRNGKey(0), x_shape)
    scale = jax.random.normal(jax.random.PRNGKey(1), scale_shape)
    weight = jax.random.normal(jax.random.PRNGKey(2), x_shape)
    loss = lambda fn: lambda x, s: jnp.sum(fn(x, s) * weight)
    got = jax.grad(loss(chunking.scaled), argnums=(0, 1))(x, scale)
    want = jax.grad(loss(jnp.multiply), argnums=(0, 1))(x, scale)
    helpers.assert_close_normwise(got, want, 1e-6)
    backward = str(jax.make_jaxpr(jax.grad(loss(chunking.scaled), argnums=1))(x, scale))
    per_row = scale_shape[-1] == 1
    assert ("dot_general" in backward) == per_row
    if per_row:  # a sum over leading axes (a factor shared across heads) may remain
        assert f"axes=({len(x_shape) - 1},)" not in backward


def test_the_chunks_scale_their_rows_through_scaled():
    """Gated DeltaNet's chunk-local pieces (its decays into and out of the chunk, beta on
    the solve's system and right-hand side) run through ``chunking.scaled``, so their
    gradient's row sums are products (the test above)."""
    q, beta, gate = jnp.ones((1, 40, 2, 8)), jnp.full((1, 40, 2), 0.5), -jnp.ones((1, 40, 2))
    loss = lambda q, k, v, beta, gate: jnp.sum(la.delta_rule(q, k, v, beta, gate=gate))
    program = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, q, q, beta, gate))
    assert "name=_scaled" in program


def test_identical_calls_share_one_trace_of_the_chunked_form(monkeypatch):
    # The chunked form is its own jitted function: a model's identical layers trace its
    # chunk loop once (the loaded 8-layer model's trace + lower fell from 0.70 to 0.31 s).
    # Without that, two calls of the same shapes trace it twice.
    from linattn_jax.ops import chunking

    traced = []
    scan = chunking.scan
    monkeypatch.setattr(chunking, "scan", lambda *a, **k: traced.append(1) or scan(*a, **k))

    def inputs(t):  # lengths no other test uses: nothing comes from jit's cache
        q, k, v = (jnp.ones((1, t, 2, 8)) for _ in range(3))
        return q, k, v, jnp.full((1, t, 2), 0.5), -jnp.ones((1, t, 2))

    def twice(q, k, v, beta, gate):
        out = la.delta_rule(q, k, v, beta, gate=gate)
        return la.delta_rule(q + out, k, v, beta, gate=gate)

    jax.jit(twice).lower(*inputs(53))
    two = len(traced)
    traced.clear()
    jax.jit(lambda *x: la.delta_rule(*x[:4], gate=x[4])).lower(*inputs(59))
    assert two == len(traced) > 0
