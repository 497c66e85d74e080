"""The mLSTM (``linattn_jax.ops.mlstm``) against a per-token float64 loop written here, with
the stabiliser of the xLSTM papers; its forms against each other and against its steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax.ops import mlstm
from tests import helpers

B, T, H, D, DV = 2, 11, 2, 4, 3
ARGS = ("q", "k", "v", "i", "f")


def mlstm_reference(q, k, v, i, f, c0, n0, m0, *, forget_gate="sigmoid", key_mask=None,
                    segment_ids=None, eps=1e-6):  # fmt: skip
    """xLSTM's mLSTM token by token (Beck et al. 2024, eqs. 19-27, with the stabiliser m):
    ``(out [b, t, h, dv], (C, n, m))``. A masked token leaves the state as it is and
    outputs 0; a new segment starts from the zero state (m = 0)."""
    c, n, m = c0, n0, m0
    outs = []
    for s in range(q.shape[1]):
        if segment_ids is not None and s > 0:
            new = segment_ids[:, s] != segment_ids[:, s - 1]
            c = jnp.where(new[:, None, None, None], 0.0, c)
            n = jnp.where(new[:, None, None], 0.0, n)
            m = jnp.where(new[:, None], 0.0, m)
        log_f = -jnp.logaddexp(0.0, -f[:, s]) if forget_gate == "sigmoid" else f[:, s]
        log_i = i[:, s]
        m_new = jnp.maximum(log_f + m, log_i)
        f_bar = jnp.exp(log_f + m - m_new)
        i_bar = jnp.exp(log_i - m_new)
        kv = k[:, s, :, :, None] * v[:, s, :, None, :]
        c_new = f_bar[..., None, None] * c + i_bar[..., None, None] * kv
        n_new = f_bar[..., None] * n + i_bar[..., None] * k[:, s]
        qs = q[:, s] / np.sqrt(q.shape[-1])
        num = jnp.einsum("bhd,bhdv->bhv", qs, c_new)
        den = jnp.abs(jnp.einsum("bhd,bhd->bh", qs, n_new))
        out = num / (jnp.maximum(den, jnp.exp(-m_new)) + eps)[..., None]
        if key_mask is not None:
            live = key_mask[:, s]
            c_new = jnp.where(live[:, None, None, None], c_new, c)
            n_new = jnp.where(live[:, None, None], n_new, n)
            m_new = jnp.where(live[:, None], m_new, m)
            out = jnp.where(live[:, None, None], out, 0.0)
        c, n, m = c_new, n_new, m_new
        outs.append(out)
    return jnp.stack(outs, axis=1), (c, n, m)


def _inputs(seed, gates="normal"):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q, k, v = helpers.qkv(seed, B, T, H, D, DV)
    if gates == "extreme":  # pre-activations of +-50 mixed with ordinary ones
        sign = lambda key: jnp.where(jax.random.bernoulli(key, 0.5, (B, T, H)), 50.0, -50.0)
        pick = jax.random.bernoulli(ks[0], 0.6, (B, T, H))
        i = jnp.where(pick, sign(ks[1]), jax.random.normal(ks[2], (B, T, H)))
        f = jnp.where(pick, sign(ks[3]), 2.0 + jax.random.normal(ks[4], (B, T, H)))
    else:
        i = jax.random.normal(ks[1], (B, T, H))
        f = 2.0 + jax.random.normal(ks[3], (B, T, H))
    state = mlstm.State(
        c=jax.random.normal(ks[5], (B, H, D, DV)),
        n=jax.random.normal(ks[6], (B, H, D)),
        m=jax.random.normal(ks[7], (B, H)),
    )
    return dict(q=q, k=k, v=v, i=i, f=f), state


def _case(case):
    gates = "extreme" if "extreme" in case else "normal"
    inputs, s0 = _inputs(3, gates)
    options = {}
    if "mask" in case:
        options["key_mask"] = helpers.key_mask(4, B, T).at[:, 0].set(True)
    if "segments" in case:
        options["segment_ids"] = jnp.asarray([[0] * 4 + [1] * 5 + [2] * 2, [0] * 7 + [3] * 4])
    if "exp" in case:
        options["forget_gate"] = "exp"
        inputs["f"] = -jnp.abs(inputs["f"])  # exp(f) <= 1: a decay
        inputs["f"] = inputs["f"].at[0, 2].set(0.7)  # and once above 1: the state grows
    return inputs, s0, options


def _dirty(inputs, key_mask):
    """The inputs with +-1e4, inf and NaN at the padding."""
    if key_mask is None:
        return inputs
    pad = ~key_mask
    junk = {"q": jnp.nan, "k": jnp.inf, "v": jnp.nan, "i": 1e4, "f": -1e4}
    return {
        name: jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), junk[name], x)
        for name, x in inputs.items()
    }


@pytest.mark.parametrize(
    "method, case",
    [
        ("chunked", "plain"),
        pytest.param("scan", "plain", marks=pytest.mark.slow),
        ("quadratic", "extreme"),
        ("chunked", "extreme mask"),
        pytest.param("scan", "mask segments", marks=pytest.mark.slow),
        ("chunked", "mask segments"),
        pytest.param("chunked", "exp", marks=pytest.mark.slow),
    ],
)
def test_forms_equal_the_float64_loop_outputs_states_and_gradients(method, case):
    inputs, s0, options = _case(case)
    key_mask = options.get("key_mask")
    kw = jax.random.split(jax.random.PRNGKey(9), 4)
    w_out = jax.random.normal(kw[0], (B, T, H, DV))
    w_state = tuple(jax.random.normal(key, x.shape) for key, x in zip(kw[1:], s0, strict=True))

    def loss(fn, args, s0):
        out, state = fn(*args, *s0)
        total = jnp.sum(out * w_out.astype(out.dtype))
        total += sum(jnp.sum(s * w.astype(s.dtype)) for s, w in zip(state, w_state, strict=True))
        return total, (out, state)

    def run(q, k, v, i, f, c0, n0, m0):
        out, state = mlstm.causal(
            q, k, v, i, f, method=method, chunk_size=4, initial_state=mlstm.State(c0, n0, m0),
            return_state=True, **options,
        )  # fmt: skip
        return out, tuple(state)

    args = tuple(_dirty(inputs, key_mask)[name] for name in ARGS)
    grad = jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1), has_aux=True))
    (d_args, d_s0), (out, state) = grad(args, tuple(s0))

    f64 = lambda y: np.asarray(y, np.float64)
    with jax.enable_x64(True):
        ref_options = {k: np.asarray(v) if k != "forget_gate" else v for k, v in options.items()}
        ref = functools.partial(mlstm_reference, **ref_options)
        ref_grad = jax.grad(functools.partial(loss, ref), argnums=(0, 1), has_aux=True)
        clean = tuple(f64(inputs[name]) for name in ARGS)
        (ref_d_args, ref_d_s0), (ref_out, ref_state) = ref_grad(clean, tuple(map(f64, s0)))
        expected = jax.tree.map(np.asarray, (ref_out, ref_state, ref_d_args, ref_d_s0))
    assert out.shape == (B, T, H, DV) and all(s.dtype == jnp.float32 for s in state)
    helpers.assert_close_normwise(out, expected[0], rtol=2e-6)
    np.testing.assert_allclose(out, expected[0], **helpers.tol(jnp.float32))
    for s, ref_s in zip(state, expected[1], strict=True):
        np.testing.assert_allclose(s, ref_s, **helpers.tol(jnp.float32))
    for name, d, ref_d in zip(ARGS, d_args, expected[2], strict=True):
        assert np.all(np.isfinite(d)), name
        helpers.assert_close_normwise(d, ref_d)
    helpers.assert_close_normwise(d_s0, expected[3])
    if key_mask is not None:  # padding outputs exactly 0 and receives exactly no gradient
        pad = ~np.asarray(key_mask)
        assert np.all(np.asarray(out)[pad] == 0)
        for name, d in zip(ARGS, d_args, strict=True):
            assert np.all(np.asarray(d)[pad] == 0), name


def test_chunked_equals_scan_equals_steps_at_extreme_gates():
    """Gates of +-50: the chunked form, the scan and the steps agree to float32 rounding
    (an exponent of 50 is rounded to 4e-6: the weights' relative rounding), outputs and
    state (the stabiliser included), also in two pieces."""
    inputs, s0 = _inputs(5, "extreme")
    chunked = jax.jit(functools.partial(la.mlstm, chunk_size=4, return_state=True))
    out, state = chunked(**inputs, initial_state=s0)
    scan_out, scan_state = la.mlstm(**inputs, method="scan", initial_state=s0, return_state=True)
    step = jax.jit(la.mlstm_step)
    s, outs = s0, []
    for t in range(T):
        y, s = step(**{name: x[:, t] for name, x in inputs.items()}, state=s)
        outs.append(y)
    for other, other_state in [(scan_out, scan_state), (jnp.stack(outs, 1), s)]:
        helpers.assert_close_normwise(other, out)  # both float32: 1e-5
        for a, e in zip(other_state, state, strict=True):
            np.testing.assert_allclose(a, e, **helpers.tol(jnp.float32))
    first, middle = chunked(**{name: x[:, :6] for name, x in inputs.items()}, initial_state=s0)
    second, end = chunked(**{name: x[:, 6:] for name, x in inputs.items()}, initial_state=middle)
    helpers.assert_close_normwise(jnp.concatenate([first, second], 1), out)
    for a, e in zip(end, state, strict=True):
        np.testing.assert_allclose(a, e, **helpers.tol(jnp.float32))


def test_non_finite_inputs_spoil_only_their_own_and_later_outputs():
    """A NaN query spoils its own output; an inf key from its token on; a NaN value its
    channel from its token on; the chunked form and the scan agree, and earlier outputs
    equal the clean run's."""
    inputs, s0 = _inputs(6)
    dirty = dict(inputs)
    dirty["q"] = dirty["q"].at[0, 2, 0, 1].set(jnp.nan)
    dirty["k"] = dirty["k"].at[0, 6, 1, 0].set(jnp.inf)
    dirty["v"] = dirty["v"].at[1, 4, 0, 2].set(jnp.nan)
    dirty["i"] = dirty["i"].at[1, 9, 1].set(jnp.nan)
    clean = la.mlstm(**inputs, chunk_size=4)
    for method in ("chunked", "scan"):
        out, state = la.mlstm(**dirty, method=method, chunk_size=4, return_state=True)
        nan = np.isnan(np.asarray(out))
        expected = np.zeros(out.shape, bool)
        expected[0, 2, 0] = True
        expected[0, 6:, 1] = True
        expected[1, 4:, 0, 2] = True
        expected[1, 9:, 1] = True
        np.testing.assert_array_equal(nan, expected, err_msg=method)
        np.testing.assert_allclose(np.where(nan, 0, out), np.where(nan, 0, clean), atol=1e-5)
        assert np.isnan(state.m[0, 1]) and np.isfinite(state.m[0, 0]), method
        assert np.all(np.isnan(state.c[1, 0, :, 2])) and np.all(np.isfinite(state.c[1, 0, :, :2]))


def test_chunk_backward_equals_autodiff_of_the_chunk():
    """``chunked.chunk_body_bwd`` (hand-written) against ``jax.vjp`` of ``chunk_body`` on one
    chunk of 8: gates of +-50 among ordinary ones, dead tokens, a segment reset, a given
    state in one row and none (``m = -inf``, a sequence-parallel shard's start) in the other,
    cotangents of the outputs (m included) and of the state after the chunk."""
    b, h, c, d, dv = 2, 2, 8, 4, 3
    ks = jax.random.split(jax.random.PRNGKey(11), 16)
    big = lambda key: 50.0 * jnp.sign(jax.random.normal(key, (b, h, c)))
    pick = jax.random.bernoulli(ks[0], 0.4, (b, h, c))
    log_i = jnp.where(pick, big(ks[1]), jax.random.normal(ks[2], (b, h, c)))
    log_f = jax.nn.log_sigmoid(
        jnp.where(pick, big(ks[3]), 2.0 + jax.random.normal(ks[4], (b, h, c)))
    )
    live = jnp.asarray([[[True] * 5 + [False, True, False]], [[True] * 8]])
    reset = jnp.zeros((b, 1, c), bool).at[1, 0, 4].set(True)
    q, k = (jax.random.normal(key, (b, h, c, d)) for key in ks[5:7])
    v = jax.random.normal(ks[7], (b, h, c, dv))
    state = (
        jax.random.normal(ks[8], (b, h, d, dv)),
        jax.random.normal(ks[9], (b, h, d)),
        jnp.asarray([[0.5, -1.0], [-jnp.inf, -jnp.inf]]),
    )
    floats = (q, k, v, log_i, log_f)
    body = lambda s, x: mlstm.chunked.chunk_body(s, (*x, live, reset))

    @jax.jit
    def both(state, floats):
        out, vjp = jax.vjp(body, state, floats)
        leaves, tree = jax.tree.flatten(out)
        keys = jax.random.split(ks[10], len(leaves))
        d_out = jax.tree.unflatten(
            tree, [jax.random.normal(j, y.shape) for j, y in zip(keys, leaves, strict=True)]
        )
        ours = mlstm.chunked.chunk_body_bwd(
            d_out[0], (state, (*floats, live, reset), out[1], d_out[1])
        )
        return ours, vjp(d_out)

    (d_state, d_x), (ref_d_state, ref_d_x) = both(state, floats)
    assert d_x[5].dtype == jax.dtypes.float0 and d_x[6].dtype == jax.dtypes.float0
    for name, a, e in zip(ARGS, d_x[:5], ref_d_x, strict=True):
        assert np.all(np.isfinite(a)), name
        helpers.assert_close_normwise(a, e)
    helpers.assert_close_normwise(d_state[:2], ref_d_state[:2])
    helpers.assert_close_normwise(d_state[2][0], ref_d_state[2][0])
    assert np.all(np.asarray(d_state[2][1]) == 0)  # no state: m_in reaches nothing


def test_long_chunk_of_strong_then_weak_forgetting_equals_the_float64_loop():
    """One chunk of 16 tokens: 8 forget gates of -300 (the chunk's sum of log forget gates
    reaches -2400, whose float32 rounding is 1e-4), then 8 near 1. The weights among the
    later tokens are O(1) and their log-decays small: formed as differences of the
    chunk's cumulative sums they would carry that 1e-4 (measured: 4.4e-5 normwise error in the
    outputs); ``split_cumsum``'s exact differences keep outputs and gradients within 1e-5.
    The earlier gates' gradient is 0: as the transpose of those differences (row sums minus
    column sums, summed from the end) it came out as the rounding of the later pairs' O(1)
    sums, 1.5-2e-5 of the forget gates' gradient's norm (jax 0.10 and 0.12);
    ``interval_sums``' transpose sums each gate's pairs directly (4e-7-1e-6)."""
    t = 16
    ks = jax.random.split(jax.random.PRNGKey(12), 6)
    q, k, v = (jax.random.normal(key, (1, t, 2, 4)) for key in ks[:3])
    i = jax.random.normal(ks[3], (1, t, 2))
    f = jnp.where(jnp.arange(t)[None, :, None] < t // 2, -300.0, 4.0)
    f = f + jax.random.normal(ks[4], (1, t, 2))
    w = jax.random.normal(ks[5], (1, t, 2, 4))
    loss = lambda fn, *x: jnp.sum(fn(*x) * w.astype(x[0].dtype))
    run = functools.partial(la.mlstm, chunk_size=t)
    out, grads = jax.jit(
        lambda *x: (run(*x), jax.grad(functools.partial(loss, run), (0, 1, 2, 3, 4))(*x))
    )(q, k, v, i, f)
    with jax.enable_x64(True):
        x64 = tuple(np.asarray(x, np.float64) for x in (q, k, v, i, f))
        s0 = (np.zeros((1, 2, 4, 4)), np.zeros((1, 2, 4)), np.zeros((1, 2)))
        ref = lambda *x: mlstm_reference(*x, *s0)[0]
        expected = np.asarray(ref(*x64))
        ref_grads = jax.grad(functools.partial(loss, ref), (0, 1, 2, 3, 4))(*x64)
    helpers.assert_close_normwise(out, expected)
    for name, g, e in zip(ARGS, grads, ref_grads, strict=True):
        assert np.all(np.isfinite(g)), name
        helpers.assert_close_normwise(g, np.asarray(e))


@pytest.mark.parametrize("c", [7, 64])
def test_interval_sums_transpose_is_the_differences_transpose(c):
    """``chunked.interval_sums``' hand-written transpose (each gate's rectangle of pairs)
    equals autodiff's of ``Lo_i - Lo_j`` for any cotangent, above the diagonal too."""
    lo = jax.random.normal(jax.random.PRNGKey(3), (2, 3, c))
    d = jax.random.normal(jax.random.PRNGKey(4), (2, 3, c, c))
    out, vjp = jax.vjp(mlstm.chunked.interval_sums, lo)
    differences = lambda x: jnp.cumsum(x, -1)[..., :, None] - jnp.cumsum(x, -1)[..., None, :]
    expected, vjp_ref = jax.vjp(differences, lo)
    helpers.assert_close_normwise(out, expected)
    helpers.assert_close_normwise(vjp(d)[0], vjp_ref(d)[0])


@pytest.mark.slow
def test_segments_restart_from_the_empty_state():
    """Packed rows: each segment equals its own sequence run from ``init_state``."""
    inputs, _ = _inputs(7)
    ids = jnp.asarray([[0] * 5 + [1] * 6] * B)
    out = la.mlstm(**inputs, chunk_size=4, segment_ids=ids)
    part = lambda sl: la.mlstm(**{name: x[:, sl] for name, x in inputs.items()}, chunk_size=4)
    whole = jnp.concatenate([part(slice(0, 5)), part(slice(5, T))], 1)
    np.testing.assert_allclose(out, whole, **helpers.tol(jnp.float32))


@pytest.mark.parametrize("form", ["causal", "sequence_parallel"])
def test_default_chunk_size_is_the_compiled_backends(form):
    """``chunk_size=None``: chunks of 32 on CPU (the faster there), 64 on GPU and TPU, in
    the causal form and in each shard of the sequence-parallel one (a one-device mesh)."""
    q, k, v = helpers.qkv(3, 1, 100, 2, 8, 8)
    i, f = jax.random.normal(jax.random.PRNGKey(4), (2, 1, 100, 2))
    fn = mlstm.causal
    if form == "sequence_parallel":
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
        fn = functools.partial(mlstm.sequence_parallel, mesh=mesh, axis_name="seq")
    run = jax.jit(fn, static_argnames="chunk_size")
    default = np.asarray(run(q, k, v, i, f))
    size = 32 if jax.default_backend() == "cpu" else 64
    np.testing.assert_array_equal(default, run(q, k, v, i, f, chunk_size=size))
    other = np.asarray(run(q, k, v, i, f, chunk_size=96 - size))
    assert not np.array_equal(default, other)  # the sizes' roundings differ: the check bites


def test_errors():
    inputs, s0 = _inputs(8)
    bad = lambda **kw: la.mlstm(**{**inputs, **kw})
    with pytest.raises(ValueError, match=r"i must have shape \[batch, length, heads\]"):
        bad(i=inputs["i"][..., None])
    with pytest.raises(ValueError, match=r"f must be a floating-point array"):
        bad(f=jnp.zeros((B, T, H), jnp.int32))
    with pytest.raises(ValueError, match=r"forget_gate must be one of"):
        bad(forget_gate="tanh")
    with pytest.raises(ValueError, match=r"method must be one of"):
        bad(method="fast")
    with pytest.raises(ValueError, match=r"state.m must have shape \[batch, heads\]"):
        bad(initial_state=s0._replace(m=s0.m[..., None]))
    with pytest.raises(ValueError, match=r"state must be an MLSTMState"):
        bad(initial_state=la.init_state(B, H, D, DV))
    with pytest.raises(ValueError, match=r"state must be the MLSTMState after the previous"):
        la.mlstm_step(**{name: x[:, 0] for name, x in inputs.items()}, state=None)
    state = la.init_mlstm_state(B, H, D, DV)
    assert [x.shape for x in state] == [(B, H, D, DV), (B, H, D), (B, H)]
    assert all(np.all(np.asarray(x) == 0) for x in state)
