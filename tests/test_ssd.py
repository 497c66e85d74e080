"""Mamba-2's SSD recurrence (``linattn_jax.ops.ssd``) against a per-token float64 loop
written here: outputs, final states and gradients, with groups, ``D``, initial states,
padding (NaN and inf in the padded x, dt, B and C), segments and a ``-inf`` reset; the
forms against each other (chunked, scan, quadratic, step by step). Sequence parallel
against one device: ``tests/test_sequence_parallel.py`` (its process with eight devices).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax.ops import chunking, ssd
from tests import helpers

B, T, H, G, P, N = 2, 13, 4, 2, 3, 5


def _inputs(seed, t=T, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    x = jax.random.normal(ks[0], (B, t, H, P))
    dt = jax.nn.softplus(jax.random.normal(ks[1], (B, t, H)) - 0.5)
    a = -jax.random.uniform(ks[2], (H,), minval=0.1, maxval=2.0)
    b_in = jax.random.normal(ks[3], (B, t, G, N))
    c_out = jax.random.normal(ks[4], (B, t, G, N))
    d = jax.random.normal(ks[5], (H,))
    s0 = ssd.State(0.5 * jax.random.normal(ks[6], (B, H, N, P)))
    cast = lambda y: y.astype(dtype)
    return dict(x=cast(x), dt=dt, A=a, B=cast(b_in), C=cast(c_out), D=d), s0


def ssd_reference(x, dt, A, B, C, D=None, s0=None, key_mask=None, segment_ids=None):
    """``h_t = exp(dt_t A) h_{t-1} + B_t (dt_t x_t)^T``, ``y_t = h_t^T C_t + D x_t``, one token
    at a time for every (batch, head); head i reads group ``i // (H / G)``. A masked token
    changes nothing and outputs 0; a new segment id zeroes the state; ``A = -inf`` keeps
    only the current token."""
    b, t, h, p = x.shape
    g, n = B.shape[2:]
    group = np.arange(h) // (h // g)
    s = jnp.zeros((b, h, n, p), x.dtype) if s0 is None else s0
    reset = jnp.isneginf(A)[None]
    ys = []
    for i in range(t):
        if segment_ids is not None and i > 0:
            new = segment_ids[:, i] != segment_ids[:, i - 1]
            s = jnp.where(new[:, None, None, None], 0.0, s)
        keep = jnp.ones((b,), bool) if key_mask is None else key_mask[:, i]
        real = lambda y, keep=keep: jnp.where(keep.reshape((b,) + (1,) * (y.ndim - 1)), y, 0.0)
        xi, dti, bi, ci = real(x[:, i]), real(dt[:, i]), real(B[:, i]), real(C[:, i])
        a = jnp.where(reset, 0.0, jnp.exp(dti * jnp.where(reset, 0.0, A[None])))  # [b, h]
        a = jnp.where(keep[:, None], a, 1.0)
        write = bi[:, group, :, None] * (dti[..., None] * xi)[:, :, None, :]
        s = a[:, :, None, None] * s + write
        y = jnp.einsum("bhnp,bhn->bhp", s, ci[:, group])
        if D is not None:
            y = y + D[None, :, None] * xi
        ys.append(real(y))
    return jnp.stack(ys, axis=1), s


def _loss_weights(seed):
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(ka, (B, T, H, P)), jax.random.normal(kb, (B, H, N, P))


ARGS = ("x", "dt", "A", "B", "C", "D")


def _case(case):
    """The inputs and options of one case of the covering set."""
    inputs, s0 = _inputs(0)
    options = {}
    if case == "mask":
        mask = helpers.key_mask(3, B, T).at[:, -2:].set(False).at[0, :2].set(False)
        options["key_mask"] = mask
        bad = ~mask
        inputs["x"] = jnp.where(bad[..., None, None], jnp.nan, inputs["x"])
        inputs["dt"] = jnp.where(bad[..., None], jnp.inf, inputs["dt"])
        inputs["B"] = jnp.where(bad[..., None, None], -jnp.inf, inputs["B"])
        inputs["C"] = jnp.where(bad[..., None, None], jnp.nan, inputs["C"])
    elif case == "segments":
        options["segment_ids"] = helpers.segment_ids(4, B, T, p=0.25)
    elif case == "reset":
        inputs["A"] = inputs["A"].at[1].set(-jnp.inf)
    return inputs, s0, options


@pytest.mark.parametrize(
    "method, case",
    [
        ("chunked", "plain"),
        ("scan", "plain"),
        ("quadratic", "plain"),
        ("chunked", "mask"),
        ("scan", "mask"),
        ("chunked", "segments"),
        ("scan", "reset"),
        ("chunked", "reset"),
    ],
)
def test_forms_equal_the_float64_loop_outputs_states_and_gradients(method, case):
    inputs, s0, options = _case(case)
    w_out, w_s = _loss_weights(1)

    def loss(fn, args, s0):
        out, s = fn(**dict(zip(ARGS, args, strict=True)), s0=s0)
        return jnp.sum(out * w_out.astype(out.dtype)) + jnp.sum(s * w_s.astype(s.dtype)), (out, s)

    def run(x, dt, A, B, C, D, s0):
        out, state = ssd.causal(
            x, dt, A, B, C, D=D, method=method, chunk_size=4, initial_state=ssd.State(s0),
            return_state=True, **options,
        )  # fmt: skip
        return out, state.s

    args = tuple(inputs[name] for name in ARGS)
    grad = jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1), has_aux=True))
    (d_args, d_s0), (out, s) = grad(args, s0.s)

    f64 = lambda y: np.asarray(y, np.float64)
    with jax.enable_x64(True):
        ref_options = {k: np.asarray(v) for k, v in options.items()}
        ref = functools.partial(ssd_reference, **ref_options)
        ref_grad = jax.grad(functools.partial(loss, ref), argnums=(0, 1), has_aux=True)
        (ref_d_args, ref_d_s0), (ref_out, ref_s) = ref_grad(tuple(f64(y) for y in args), f64(s0.s))
        expected = jax.tree.map(np.asarray, (ref_out, ref_s, ref_d_args, ref_d_s0))
    assert out.shape == (B, T, H, P) and s.shape == (B, H, N, P) and s.dtype == jnp.float32
    np.testing.assert_allclose(out, expected[0], **helpers.tol(jnp.float32))
    np.testing.assert_allclose(s, expected[1], **helpers.tol(jnp.float32))
    for name, d, ref_d in zip(ARGS, d_args, expected[2], strict=True):
        assert np.all(np.isfinite(d)), name
        helpers.assert_close_normwise(d, ref_d)
    helpers.assert_close_normwise(d_s0, expected[3])
    if case == "mask":  # padding outputs exactly 0 and receives exactly no gradient
        pad = ~np.asarray(options["key_mask"])
        assert np.all(np.asarray(out)[pad] == 0)
        for name, d in zip(ARGS[:5], d_args, strict=False):
            if name != "A":
                assert np.all(np.asarray(d)[pad] == 0), name


def test_step_by_step_equals_the_chunked_form():
    inputs, s0 = _inputs(2)
    out, state = ssd.causal(**inputs, chunk_size=5, initial_state=s0, return_state=True)
    step = jax.jit(ssd.step)
    s, outs = s0, []
    for i in range(T):
        token = {k: inputs[k][:, i] for k in ("x", "dt", "B", "C")}
        y, s = step(**token, A=inputs["A"], state=s, D=inputs["D"])
        outs.append(y)
    np.testing.assert_allclose(jnp.stack(outs, 1), out, **helpers.tol(jnp.float32))
    np.testing.assert_allclose(s.s, state.s, **helpers.tol(jnp.float32))
    # And a sequence in two pieces, the state carried over.
    first, state_1 = ssd.causal(
        **{k: v[:, :6] if v.ndim > 1 else v for k, v in inputs.items()},
        initial_state=s0, return_state=True, chunk_size=5,
    )  # fmt: skip
    second = ssd.causal(
        **{k: v[:, 6:] if v.ndim > 1 else v for k, v in inputs.items()},
        initial_state=state_1, chunk_size=5,
    )  # fmt: skip
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), out, **helpers.tol(jnp.float32))


@pytest.mark.parametrize("name", ["x", "dt", "B"])
def test_a_nan_spoils_only_its_own_and_later_tokens(name):
    inputs, _ = _inputs(5)
    clean = ssd.causal(**inputs, chunk_size=4)
    spoilt = dict(inputs)
    spoilt[name] = inputs[name].at[0, 6].set(jnp.nan)
    out = np.asarray(ssd.causal(**spoilt, chunk_size=4))
    np.testing.assert_array_equal(out[0, :6], np.asarray(clean)[0, :6])
    np.testing.assert_array_equal(out[1], np.asarray(clean)[1])
    assert np.isnan(out[0, 6:]).any()


def test_bfloat16_operands_float32_state():
    inputs, s0 = _inputs(6, dtype=jnp.bfloat16)
    out, state = ssd.causal(**inputs, initial_state=s0, return_state=True, chunk_size=4)
    assert out.dtype == jnp.bfloat16 and state.s.dtype == jnp.float32
    f32 = {k: v.astype(jnp.float32) for k, v in inputs.items()}
    ref, ref_s = ssd.causal(**f32, initial_state=s0, return_state=True, method="scan")
    helpers.assert_close_normwise(out.astype(jnp.float32), ref, rtol=1e-2)
    helpers.assert_close_normwise(state.s, ref_s.s, rtol=1e-2)


@pytest.mark.parametrize("case", ["scores", "state"])
def test_float16_holds_scores_and_states_beyond_its_range(case):
    """float16 inputs whose outputs fit float16 (peaks of a few thousand) while a chunk's
    scores ``C B^T`` ("scores") or the state ("state") pass its largest value, 65504: the
    chunked form reads those in float32 (before: inf, and NaN where a mask met it)."""
    t, h, g, p, n = 32, 2, 1, 4, 8
    ks = jax.random.split(jax.random.PRNGKey(11), 5)
    x_std, dt_scale, b_std, c_std = (
        (0.03, 1.0, 100.0, 100.0) if case == "scores" else (20.0, 3.0, 100.0, 0.01)
    )
    x = (x_std * jax.random.normal(ks[0], (1, t, h, p))).astype(jnp.float16)
    dt = dt_scale * jax.nn.softplus(jax.random.normal(ks[1], (1, t, h)))
    a = -jax.random.uniform(ks[2], (h,), minval=1e-3, maxval=1e-2)
    b_in = (b_std * jax.random.normal(ks[3], (1, t, g, n))).astype(jnp.float16)
    c_out = (c_std * jax.random.normal(ks[4], (1, t, g, n))).astype(jnp.float16)
    with jax.enable_x64(True):
        f64 = lambda y: jnp.asarray(np.asarray(y, np.float64))
        ref, ref_s = ssd_reference(*(f64(y) for y in (x, dt, a, b_in, c_out)))
        ref, ref_s = np.asarray(ref), np.asarray(ref_s)
    scores = np.einsum("tn,sn->ts", *(np.asarray(y[0, :, 0], np.float64) for y in (c_out, b_in)))
    assert np.abs(ref).max() < 2e4  # the outputs fit float16, what passes 65504 does not
    assert np.abs(scores if case == "scores" else ref_s).max() > 65504
    u = float(jnp.finfo(jnp.float16).eps) / 2
    for method in ("chunked", "quadratic"):
        out, s = ssd.causal(x, dt, a, b_in, c_out, method=method, chunk_size=8, return_state=True)
        assert out.dtype == jnp.float16
        helpers.assert_close_normwise(out, ref, rtol=2 * u)
        helpers.assert_close_normwise(s.s, ref_s, rtol=1e-5)


def test_bad_inputs_raise_naming_the_argument():
    inputs, _ = _inputs(0)
    cases = [
        (dict(A=-inputs["A"]), "A must be <= 0"),
        (dict(dt=-inputs["dt"]), "dt must be >= 0"),
        (
            dict(B=inputs["B"][:, :, :1].repeat(3, 2), C=inputs["C"][:, :, :1].repeat(3, 2)),
            "groups",
        ),
        (dict(D=inputs["D"][:2]), "D must have shape"),
        (dict(C=inputs["C"][..., :2]), "B and C must agree"),
        (dict(method="fast"), "method must be one of"),
        (dict(initial_state=la.init_ssd_state(B, H, P, N)), "state.s must have shape"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            ssd.causal(**{**inputs, **change})
    with pytest.raises(ValueError, match="state must be the SSDState"):
        ssd.step(**{k: v[:, 0] if v.ndim > 1 else v for k, v in inputs.items()}, state=None)


def test_groups_of_chunks_as_on_gpu_equal_the_scan(monkeypatch):
    # On GPU and TPU the chunked form runs several chunks at once (chunking.GROUP_TOKENS);
    # on CPU one (GROUP_TOKENS_CPU): run the grouped path here, padding and segments on.
    monkeypatch.setattr(chunking, "GROUP_TOKENS_CPU", 12)
    inputs, s0, options = _case("mask")
    options["segment_ids"] = helpers.segment_ids(4, B, T, p=0.25)
    w_out, _ = _loss_weights(1)

    def loss(method, inputs):
        out = ssd.causal(**inputs, method=method, chunk_size=4, initial_state=s0, **options)
        return jnp.sum(out * w_out), out

    grads = [jax.jit(jax.grad(functools.partial(loss, m), has_aux=True))(inputs) for m in
             ("chunked", "scan")]  # fmt: skip
    (d, out), (ref_d, ref_out) = grads
    np.testing.assert_allclose(out, ref_out, **helpers.tol(jnp.float32))
    helpers.assert_close_normwise(d, ref_d)


def test_heads_sharing_b_and_c_form_their_scores_once():
    # Eight heads reading one group of B and C: the chunks' C B^T is formed once for the
    # group, so the compiled forward costs fewer FLOPs than with a group per head.
    x, dt, A = jnp.ones((1, 128, 8, 16)), jnp.ones((1, 128, 8)), -jnp.ones((8,))
    fn = jax.jit(lambda x, dt, A, B, C: ssd.causal(x, dt, A, B, C, chunk_size=32))

    def flops(groups):
        B = jnp.ones((1, 128, groups, 16))
        cost = fn.lower(x, dt, A, B, B).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops(1) < 0.85 * flops(8)
