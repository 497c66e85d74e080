"""Mamba-1's selective scan (``linattn_jax.ops.selective``) against a per-token float64 loop
written here; its forms against each other and against its steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax.ops import selective
from tests import helpers

B, T, D, N = 2, 11, 3, 4
ARGS = ("x", "dt", "A", "B", "C", "D")


def selective_reference(x, dt, A, B, C, D, h0, *, key_mask=None, segment_ids=None):
    """Mamba's selective scan token by token (Gu and Dao 2023, Algorithm 2):
    ``h = exp(dt A) h + dt x B``, ``y = h C + D x``. A masked token leaves the state as it
    is and outputs 0; a new segment starts from zeros."""
    h, ys = h0, []
    for s in range(x.shape[1]):
        if segment_ids is not None and s > 0:
            new = segment_ids[:, s] != segment_ids[:, s - 1]
            h = jnp.where(new[:, None, None], 0.0, h)
        a = jnp.exp(dt[:, s, :, None] * A[None])
        h_new = a * h + (dt[:, s] * x[:, s])[:, :, None] * B[:, s, None, :]
        y = jnp.einsum("bdn,bn->bd", h_new, C[:, s]) + D[None] * x[:, s]
        if key_mask is not None:
            live = key_mask[:, s]
            h_new = jnp.where(live[:, None, None], h_new, h)
            y = jnp.where(live[:, None], y, 0.0)
        h = h_new
        ys.append(y)
    return jnp.stack(ys, axis=1), h


def _inputs(seed, t=T, extreme=False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    dt = jax.nn.softplus(jax.random.normal(ks[1], (B, t, D)) - 1.0)
    A = -jnp.exp(jax.random.normal(ks[2], (D, N)))
    if extreme:  # steps of 1e-6 and 30, rates of -1e-4 and -200: decays of 1 and 0
        dt = jnp.where(jax.random.bernoulli(ks[0], 0.3, dt.shape), 30.0, dt).at[:, 3].set(1e-6)
        A = A.at[0].set(-200.0).at[1, 0].set(-1e-4)
    inputs = dict(
        x=jax.random.normal(ks[0], (B, t, D)),
        dt=dt,
        A=A,
        B=jax.random.normal(ks[3], (B, t, N)),
        C=jax.random.normal(ks[4], (B, t, N)),
        D=jax.random.normal(ks[5], (D,)),
    )
    return inputs, jax.random.normal(ks[6], (B, D, N))


def _dirty(inputs, key_mask):
    """The inputs with NaN, inf and 1e4 at the padding."""
    if key_mask is None:
        return inputs
    pad = ~key_mask[..., None]
    junk = {"x": jnp.nan, "dt": 1e4, "B": jnp.inf, "C": jnp.nan}
    return {k: jnp.where(pad, junk[k], v) if k in junk else v for k, v in inputs.items()}


@pytest.mark.parametrize(
    "method, case",
    [("chunked", "plain"), ("scan", "mask segments"), ("chunked", "extreme mask segments")],
)
def test_forms_equal_the_float64_loop_outputs_states_and_gradients(method, case):
    inputs, h0 = _inputs(3, extreme="extreme" in case)
    options = {}
    if "mask" in case:
        options["key_mask"] = helpers.key_mask(4, B, T).at[:, 0].set(True)
    if "segments" in case:
        options["segment_ids"] = jnp.asarray([[0] * 4 + [1] * 5 + [2] * 2, [0] * 7 + [3] * 4])
    kw = jax.random.split(jax.random.PRNGKey(9), 2)
    w_out, w_state = jax.random.normal(kw[0], (B, T, D)), jax.random.normal(kw[1], (B, D, N))

    def loss(fn, args, h0):
        y, h = fn(*args, h0)
        total = jnp.sum(y * w_out.astype(y.dtype)) + jnp.sum(h * w_state.astype(h.dtype))
        return total, (y, h)

    def run(x, dt, A, B_, C, D_, h0):
        y, state = selective.causal(
            x, dt, A, B_, C, D=D_, method=method, chunk_size=4,
            initial_state=selective.State(h0), return_state=True, **options,
        )  # fmt: skip
        return y, state.h

    args = tuple(_dirty(inputs, options.get("key_mask"))[name] for name in ARGS)
    grad = jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1), has_aux=True))
    (d_args, d_h0), (y, h) = grad(args, h0)

    f64 = lambda v: np.asarray(v, np.float64)
    with jax.enable_x64(True):
        ref = functools.partial(
            selective_reference, **{k: np.asarray(v) for k, v in options.items()}
        )
        ref_grad = jax.grad(functools.partial(loss, ref), argnums=(0, 1), has_aux=True)
        clean = tuple(f64(inputs[name]) for name in ARGS)
        (ref_d_args, ref_d_h0), (ref_y, ref_h) = ref_grad(clean, f64(h0))
        expected = jax.tree.map(np.asarray, (ref_y, ref_h, ref_d_args, ref_d_h0))
    assert y.shape == (B, T, D) and h.dtype == jnp.float32
    helpers.assert_close_normwise(y, expected[0], rtol=2e-6)
    helpers.assert_close_normwise(h, expected[1], rtol=2e-6)
    for name, d, ref_d in zip(ARGS, d_args, expected[2], strict=True):
        assert np.all(np.isfinite(d)), name
        helpers.assert_close_normwise(d, ref_d)
    helpers.assert_close_normwise(d_h0, expected[3])
    if "mask" in case:  # padding outputs exactly 0 and receives exactly no gradient
        pad = ~np.asarray(options["key_mask"])
        assert np.all(np.asarray(y)[pad] == 0)
        for name, d in zip(ARGS[:2] + ARGS[3:5], d_args[:2] + d_args[3:5], strict=True):
            assert np.all(np.asarray(d)[pad] == 0), name


def test_chunked_equals_scan_equals_steps():
    """Chunks of 32 (and the default 16), extreme steps and rates: the chunked form,
    the scan and the steps agree, outputs and state, also in two pieces."""
    inputs, h0 = _inputs(5, t=40, extreme=True)
    s0 = selective.State(h0)
    chunked = jax.jit(functools.partial(la.selective_scan, chunk_size=32, return_state=True))
    y, state = chunked(**inputs, initial_state=s0)
    scan_y, scan_state = la.selective_scan(**inputs, method="scan", initial_state=s0,
                                           return_state=True)  # fmt: skip
    step = jax.jit(la.selective_scan_step)
    s, ys = s0, []
    per_token = {k: v for k, v in inputs.items() if k not in ("A", "D")}
    for t in range(40):
        y_t, s = step(**{k: v[:, t] for k, v in per_token.items()}, A=inputs["A"], D=inputs["D"],
                      state=s)  # fmt: skip
        ys.append(y_t)
    default = la.selective_scan(**inputs, initial_state=s0, return_state=True)
    for other, other_state in [(scan_y, scan_state), (jnp.stack(ys, 1), s), default]:
        helpers.assert_close_normwise(other, y)
        helpers.assert_close_normwise(other_state.h, state.h)
    cut = lambda sl: {k: v[:, sl] if k in per_token else v for k, v in inputs.items()}
    first, middle = chunked(**cut(slice(0, 13)), initial_state=s0)
    second, end = chunked(**cut(slice(13, 40)), initial_state=middle)
    helpers.assert_close_normwise(jnp.concatenate([first, second], 1), y)
    helpers.assert_close_normwise(end.h, state.h)


def test_non_finite_inputs_spoil_only_their_own_and_later_outputs():
    """A NaN x spoils its channel from its token on; an inf B every channel from its token
    on; a NaN C only its own token; earlier outputs equal the clean run's."""
    inputs, _ = _inputs(6)
    dirty = dict(inputs)
    dirty["x"] = dirty["x"].at[0, 2, 1].set(jnp.nan)
    dirty["B"] = dirty["B"].at[1, 6, 0].set(jnp.inf)
    dirty["C"] = dirty["C"].at[0, 8, 2].set(jnp.nan)
    clean = la.selective_scan(**inputs, chunk_size=4)
    for method in ("chunked", "scan"):
        y, state = la.selective_scan(**dirty, method=method, chunk_size=4, return_state=True)
        nan = np.isnan(np.asarray(y))
        expected = np.zeros(y.shape, bool)
        expected[0, 2:, 1] = True
        expected[0, 8] = True
        expected[1, 6:] = True
        np.testing.assert_array_equal(nan, expected, err_msg=method)
        np.testing.assert_allclose(np.where(nan, 0, y), np.where(nan, 0, clean), atol=1e-5)
        assert np.all(np.isnan(state.h[0, 1])) and np.all(np.isfinite(state.h[0, ::2]))


def test_errors():
    inputs, h0 = _inputs(8)
    bad = lambda **kw: la.selective_scan(**{**inputs, **kw})
    with pytest.raises(ValueError, match=r"A must have shape \[channels, state_dim\]"):
        bad(A=inputs["A"][0])
    with pytest.raises(ValueError, match=r"A must be <= 0"):
        bad(A=-inputs["A"])
    with pytest.raises(ValueError, match=r"dt must have shape \[batch, length, channels\]"):
        bad(dt=inputs["dt"][..., :1])
    with pytest.raises(ValueError, match=r"method must be one of"):
        bad(method="fast")
    with pytest.raises(ValueError, match=r"state must be a SelectiveState"):
        bad(initial_state=h0)
    with pytest.raises(ValueError, match=r"state must be the SelectiveState after the previous"):
        la.selective_scan_step(**{k: v[:, 0] for k, v in inputs.items() if k not in "AD"},
                               A=inputs["A"], state=None)  # fmt: skip
    state = la.init_selective_state(B, D, N)
    assert state.h.shape == (B, D, N) and np.all(np.asarray(state.h) == 0)
    # A negative step is a decay above one: refused at real tokens, allowed at padding.
    negative = inputs["dt"].at[1, 4, 2].set(-0.5)
    with pytest.raises(ValueError, match=r"^dt must be >= 0 \(a softplus\), got a minimum of -0.5"):
        bad(dt=negative)
    key_mask = jnp.ones((B, T), bool).at[1, 4].set(False)
    assert np.all(np.isfinite(bad(dt=negative, key_mask=key_mask)))
    one = {k: v[:, 4] for k, v in inputs.items() if k not in "AD"}
    with pytest.raises(ValueError, match=r"^dt must be >= 0"):
        la.selective_scan_step(**{**one, "dt": negative[:, 4]}, A=inputs["A"], state=state)


def test_bfloat16_inputs_with_float32_steps():
    """bfloat16 x, B, C beside float32 dt (``MambaMixer(dtype=bfloat16)``'s): bfloat16 out,
    float32 state, the float32 result to bfloat16's rounding."""
    inputs, h0 = _inputs(10)
    half = {k: v.astype(jnp.bfloat16) if k in ("x", "B", "C") else v for k, v in inputs.items()}
    y, state = la.selective_scan(**half, chunk_size=4, return_state=True)
    ref = la.selective_scan(**{k: v.astype(jnp.float32) for k, v in half.items()}, chunk_size=4)
    assert y.dtype == jnp.bfloat16 and state.h.dtype == jnp.float32
    helpers.assert_close_normwise(y.astype(jnp.float32), ref, 1e-2)
