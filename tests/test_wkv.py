"""RWKV-4's WKV (``linattn_jax.ops.wkv``) against a per-token float64 loop written here,
and against the plain unstabilised sums; its forms against each other and its steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax.ops import wkv
from tests import helpers

B, T, H, D = 2, 11, 2, 3
ARGS = ("k", "v", "time_decay", "time_first")


def wkv_reference(k, v, time_decay, time_first, num, den, m, *, key_mask=None,
                  segment_ids=None):  # fmt: skip
    """The WKV token by token with the running maximum (Peng et al. 2023, RWKV-4's
    numerically stable form): ``(out [b, t, h, d], (num, den, m))``. A masked token leaves
    the state as it is and outputs 0; a new segment starts from the empty state."""
    w, u = -jnp.exp(time_decay)[None], time_first[None]  # [1, h, d]
    outs = []
    for s in range(k.shape[1]):
        if segment_ids is not None and s > 0:
            new = (segment_ids[:, s] != segment_ids[:, s - 1])[:, None, None]
            num, den = jnp.where(new, 0.0, num), jnp.where(new, 0.0, den)
            m = jnp.where(new, -1e38, m)
        kt, vt = k[:, s], v[:, s]
        p = jnp.maximum(m, u + kt)
        a, b = jnp.exp(m - p), jnp.exp(u + kt - p)
        out = (a * num + b * vt) / (a * den + b)
        m_new = jnp.maximum(m + w, kt)
        a, b = jnp.exp(m + w - m_new), jnp.exp(kt - m_new)
        num_new, den_new = a * num + b * vt, a * den + b
        if key_mask is not None:
            live = key_mask[:, s, None, None]
            num_new, den_new = jnp.where(live, num_new, num), jnp.where(live, den_new, den)
            m_new, out = jnp.where(live, m_new, m), jnp.where(live, out, 0.0)
        num, den, m = num_new, den_new, m_new
        outs.append(out)
    return jnp.stack(outs, axis=1), (num, den, m)


def _inputs(seed, scale=1.0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    normal = lambda key, shape: jax.random.normal(key, shape)
    inputs = dict(
        k=scale * normal(ks[0], (B, T, H, D)),
        v=normal(ks[1], (B, T, H, D)),
        time_decay=normal(ks[2], (H, D)),
        time_first=normal(ks[3], (H, D)),
    )
    state = wkv.State(
        num=normal(ks[4], (B, H, D)),
        den=1.0 + jnp.abs(normal(ks[5], (B, H, D))),
        m=normal(ks[6], (B, H, D)),
    )
    return inputs, state


def _case(case):
    inputs, s0 = _inputs(3, scale=30.0 if "large" in case else 1.0)
    options = {}
    if "mask" in case:
        options["key_mask"] = helpers.key_mask(4, B, T).at[:, 0].set(True)
    if "segments" in case:
        options["segment_ids"] = jnp.asarray([[0] * 4 + [1] * 5 + [2] * 2, [0] * 7 + [3] * 4])
    return inputs, s0, options


@pytest.mark.parametrize(
    "method, case",
    [
        ("scan", "plain"),
        ("scan", "plain whole chunks"),
        ("chunked", "plain"),
        ("chunked", "large mask segments"),
        ("quadratic", "mask"),
    ],
)
def test_forms_equal_the_float64_loop_outputs_states_and_gradients(method, case):
    """Keys up to ~90 in the large case (30 sigma): nothing overflows in float32. Chunks of
    4 pad the last of T = 11 tokens (a zero token is not inert: its key weighs exp(0)); the
    whole-chunks case runs none padded, without the mask."""
    inputs, s0, options = _case(case)
    chunk_size = T if "whole" in case else 4
    key_mask = options.get("key_mask")
    kw = jax.random.split(jax.random.PRNGKey(9), 4)
    w_out = jax.random.normal(kw[0], (B, T, H, D))
    w_state = tuple(jax.random.normal(key, (B, H, D)) for key in kw[1:])

    def loss(fn, args, s0):
        out, state = fn(*args, *s0)
        total = jnp.sum(out * w_out.astype(out.dtype))
        total += sum(jnp.sum(s * w.astype(s.dtype)) for s, w in zip(state, w_state, strict=True))
        return total, (out, state)

    def run(k, v, time_decay, time_first, *s0):
        out, state = wkv.causal(
            k, v, time_decay=time_decay, time_first=time_first, method=method,
            chunk_size=chunk_size, initial_state=wkv.State(*s0), return_state=True, **options,
        )  # fmt: skip
        return out, tuple(state)

    dirty = dict(inputs)
    if key_mask is not None:  # NaN and inf at the padding reach nothing
        pad = ~key_mask[:, :, None, None]
        dirty["k"], dirty["v"] = (
            jnp.where(pad, jnp.inf, inputs["k"]),
            jnp.where(pad, jnp.nan, inputs["v"]),
        )
    args = tuple(dirty[name] for name in ARGS)
    grad = jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1), has_aux=True))
    (d_args, d_s0), (out, state) = grad(args, tuple(s0))

    f64 = lambda y: np.asarray(y, np.float64)
    with jax.enable_x64(True):
        ref = functools.partial(wkv_reference, **{k: np.asarray(v) for k, v in options.items()})
        ref_grad = jax.grad(functools.partial(loss, ref), argnums=(0, 1), has_aux=True)
        clean = tuple(f64(inputs[name]) for name in ARGS)
        (ref_d_args, ref_d_s0), (ref_out, ref_state) = ref_grad(clean, tuple(map(f64, s0)))
        expected = jax.tree.map(np.asarray, (ref_out, ref_state, ref_d_args, ref_d_s0))
    assert out.shape == (B, T, H, D) and all(s.dtype == jnp.float32 for s in state)
    helpers.assert_close_normwise(out, expected[0], rtol=2e-6)
    for s, ref_s in zip(state, expected[1], strict=True):
        helpers.assert_close_normwise(s, ref_s, rtol=2e-6)
    for name, d, ref_d in zip(ARGS, d_args, expected[2], strict=True):
        assert np.all(np.isfinite(d)), name
        helpers.assert_close_normwise(d, ref_d)
    helpers.assert_close_normwise(d_s0, expected[3])
    if key_mask is not None:  # padding outputs exactly 0 and receives exactly no gradient
        pad = ~np.asarray(key_mask)
        assert np.all(np.asarray(out)[pad] == 0)
        for name, d in zip(ARGS[:2], d_args[:2], strict=True):
            assert np.all(np.asarray(d)[pad] == 0), name


def test_the_stable_form_equals_the_plain_sums_and_the_steps():
    """The defining sums, computed without a stabiliser in float64 (keys up to ~40 fit),
    equal the chunked form and the scan in float32 from the empty state; the steps equal
    the scan, outputs and state (a given state's continuation: the float64 loop's test)."""
    inputs, _ = _inputs(5, scale=15.0)
    k, v, td, tf = (np.asarray(inputs[name], np.float64) for name in ARGS)
    w = -np.exp(td)
    ages = np.arange(T)[:, None] - 1 - np.arange(T)[None, :]  # [t, j]: t - 1 - j
    weights = np.exp(k[:, None] + ages[None, :, :, None, None] * w)  # [b, t, j, h, d]
    weights = np.where((ages >= 0)[None, :, :, None, None], weights, 0.0)
    bonus = np.exp(tf + k)
    plain = (np.einsum("btjhd,bjhd->bthd", weights, v) + bonus * v) / (weights.sum(2) + bonus)
    out, state = jax.jit(functools.partial(la.wkv, method="scan", return_state=True))(**inputs)
    chunked = jax.jit(functools.partial(la.wkv, method="chunked", chunk_size=4))(**inputs)
    helpers.assert_close_normwise(out, plain, rtol=2e-6)
    helpers.assert_close_normwise(chunked, plain, rtol=2e-6)
    step = jax.jit(la.wkv_step)
    s, outs = la.init_wkv_state(B, H, D), []
    for t in range(T):
        y, s = step(**{n: x[:, t] if n in "kv" else x for n, x in inputs.items()}, state=s)
        outs.append(y)
    helpers.assert_close_normwise(jnp.stack(outs, 1), out)
    for a, e in zip(s, state, strict=True):
        helpers.assert_close_normwise(a, e)


def test_non_finite_inputs_spoil_only_their_channel_from_their_token_on():
    inputs, _ = _inputs(6)
    dirty = dict(inputs)
    dirty["k"] = dirty["k"].at[0, 6, 1, 0].set(jnp.inf)
    dirty["v"] = dirty["v"].at[1, 4, 0, 2].set(jnp.nan)
    clean = la.wkv(**inputs)
    for method in ("chunked", "scan"):
        out, state = la.wkv(**dirty, method=method, chunk_size=4, return_state=True)
        nan = np.isnan(np.asarray(out))
        expected = np.zeros(out.shape, bool)
        expected[0, 6:, 1, 0] = True
        expected[1, 4:, 0, 2] = True
        np.testing.assert_array_equal(nan, expected, err_msg=method)
        np.testing.assert_allclose(np.where(nan, 0, out), np.where(nan, 0, clean), atol=1e-5)
        assert np.isnan(state.m[0, 1, 0]) and np.isfinite(state.m[0, 1, 1]), method
        assert np.isnan(state.num[1, 0, 2]) and np.isfinite(state.num[1, 0, 1]), method


def test_errors():
    inputs, s0 = _inputs(8)
    bad = lambda **kw: la.wkv(**{**inputs, **kw})
    with pytest.raises(ValueError, match=r"v must have shape \[batch, length, heads, dim\]"):
        bad(v=inputs["v"][:, :, :1])
    with pytest.raises(ValueError, match=r"time_first must have shape \[heads, dim\]"):
        bad(time_first=inputs["time_first"][None])
    with pytest.raises(ValueError, match=r"time_decay must be a floating-point array"):
        bad(time_decay=jnp.zeros((H, D), jnp.int32))
    with pytest.raises(ValueError, match=r"method must be one of"):
        bad(method="fast")
    with pytest.raises(ValueError, match=r"state.m must have shape \[batch, heads, dim\]"):
        bad(initial_state=s0._replace(m=s0.m[..., None]))
    with pytest.raises(ValueError, match=r"state must be a WKVState"):
        bad(initial_state=la.init_state(B, H, D, D))
    with pytest.raises(ValueError, match=r"state must be the WKVState after the previous"):
        la.wkv_step(inputs["k"][:, 0], inputs["v"][:, 0], None, time_decay=inputs["time_decay"],
                    time_first=inputs["time_first"])  # fmt: skip
    state = la.init_wkv_state(B, H, D)
    assert [x.shape for x in state] == [(B, H, D)] * 3
    assert np.all(np.asarray(state.m) == wkv.EMPTY) and np.all(np.asarray(state.num) == 0)
