"""The RG-LRU (``linattn_jax.ops.rglru``) against a per-token float64 loop written here, as
Griffin and ``transformers``' RecurrentGemma write it; its forms against each other and
against its steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linattn_jax.ops import rglru
from tests import helpers

B, T, H, D = 2, 11, 2, 3
ARGS = ("x", "i", "r")


def bounded_sqrt(x):
    """sqrt(x) whose derivative is 1 / sqrt(max(4x, 1e-6)) (transformers' SqrtBoundDerivative)."""
    sg = jax.lax.stop_gradient
    return sg(jnp.sqrt(x)) + (x - sg(x)) / sg(jnp.sqrt(jnp.maximum(4.0 * x, 1e-6)))


def rglru_reference(x, i, r, a_param, h0, *, key_mask=None, segment_ids=None, reset=None):
    """Token by token: ``(out [b, t, h, d], h)``. A sequence starts at the first real token
    of a row without a state (``h0`` None), of a new segment, or where ``reset``; there the
    state is dropped and the input not normalised. Padding keeps the state, outputs 0."""
    b, t = x.shape[:2]
    h = jnp.zeros((b,) + x.shape[2:], x.dtype) if h0 is None else h0
    pending = jnp.full((b,), h0 is None)
    outs = []
    for s in range(t):
        if segment_ids is not None and s > 0:
            pending = pending | (segment_ids[:, s] != segment_ids[:, s - 1])
        live = jnp.ones((b,), bool) if key_mask is None else key_mask[:, s]
        start = pending | (False if reset is None else reset[:, s])
        start = (start & live)[:, None, None]
        pending = pending & ~live
        log_a = -8.0 * jax.nn.sigmoid(r[:, s]) * jax.nn.softplus(a_param[None])
        a = jnp.exp(log_a)
        mult = jnp.where(start, 1.0, bounded_sqrt(1.0 - jnp.exp(2.0 * log_a)))
        new = jnp.where(start, 0.0, a * h) + mult * jax.nn.sigmoid(i[:, s]) * x[:, s]
        h = jnp.where(live[:, None, None], new, h)
        outs.append(jnp.where(live[:, None, None], new, 0.0))
    return jnp.stack(outs, axis=1), h


def _inputs(seed, extreme=False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x, i, r = (jax.random.normal(k, (B, T, H, D)) for k in ks[:3])
    a_param = jax.random.normal(ks[3], (H, D)) - 2.0  # a between about 0.3 and 1
    if extreme:  # gates of +-50 and a_param of -30 (a = 1 - 1e-13) and +30 (a = 0)
        pick = jax.random.bernoulli(ks[4], 0.5, (B, T, H, D))
        i = jnp.where(pick, 50.0 * jnp.sign(i), i)
        r = jnp.where(pick, 50.0 * jnp.sign(r), r)
        a_param = a_param.at[0, 0].set(-30.0).at[1, 2].set(30.0)
    h0 = jax.random.normal(ks[5], (B, H, D))
    return dict(x=x, i=i, r=r), a_param, h0


def _dirty(inputs, key_mask):
    """The inputs with NaN, inf and 1e4 at the padding."""
    pad = (~key_mask)[..., None, None]
    junk = {"x": jnp.nan, "i": jnp.inf, "r": -1e4}
    return {name: jnp.where(pad, junk[name], x) for name, x in inputs.items()}


@pytest.mark.parametrize(
    "method, case",
    [("chunked", "extreme mask segments reset"), ("scan", "mask segments reset")],
)
def test_forms_equal_the_float64_loop_outputs_states_and_gradients(method, case):
    inputs, a_param, h0 = _inputs(3, "extreme" in case)
    options = {}
    if "mask" in case:
        options["key_mask"] = helpers.key_mask(4, B, T).at[1, 0].set(False)
    if "segments" in case:
        options["segment_ids"] = jnp.asarray([[0] * 4 + [1] * 5 + [2] * 2, [0] * 7 + [3] * 4])
    if "reset" in case:
        options["reset"] = jnp.zeros((B, T), bool).at[0, 2].set(True)
    with_state = "extreme" in case  # the other case starts with a sequence start
    kw = jax.random.split(jax.random.PRNGKey(9), 2)
    w_out, w_state = jax.random.normal(kw[0], (B, T, H, D)), jax.random.normal(kw[1], (B, H, D))

    def loss(fn, args, a_param, h0):
        out, h = fn(*args, a_param, h0)
        total = jnp.sum(out * w_out.astype(out.dtype)) + jnp.sum(h * w_state.astype(h.dtype))
        return total, (out, h)

    def run(x, i, r, a_param, h0):
        state = rglru.State(h0) if with_state else None
        out, state = rglru.causal(x, i, r, a_param=a_param, method=method, chunk_size=4,
                                  initial_state=state, return_state=True, **options)  # fmt: skip
        return out, state.h

    key_mask = options.get("key_mask")
    dirty = inputs if key_mask is None else _dirty(inputs, key_mask)
    args = tuple(dirty[name] for name in ARGS)
    grad = jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1, 2), has_aux=True))
    (d_args, d_a, d_h0), (out, h) = grad(args, a_param, h0)

    f64 = lambda y: np.asarray(y, np.float64)
    with jax.enable_x64(True):
        ref = functools.partial(rglru_reference, **{k: np.asarray(v) for k, v in options.items()})
        if not with_state:
            ref = functools.partial(lambda fn, *a: fn(*a[:-1], None), ref)
        ref_grad = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2), has_aux=True)
        clean = tuple(f64(inputs[name]) for name in ARGS)
        expected = jax.tree.map(np.asarray, ref_grad(clean, f64(a_param), f64(h0)))
    (ref_d_args, ref_d_a, ref_d_h0), (ref_out, ref_h) = expected
    assert out.shape == (B, T, H, D) and h.dtype == jnp.float32
    helpers.assert_close_normwise(out, ref_out, rtol=2e-6)
    np.testing.assert_allclose(h, ref_h, **helpers.tol(jnp.float32))
    for name, d, ref_d in zip(ARGS, d_args, ref_d_args, strict=True):
        assert np.all(np.isfinite(d)), name
        helpers.assert_close_normwise(d, ref_d)
    helpers.assert_close_normwise(d_a, ref_d_a)
    if with_state:
        helpers.assert_close_normwise(d_h0, ref_d_h0)
    if key_mask is not None:  # padding outputs exactly 0 and receives exactly no gradient
        pad = ~np.asarray(key_mask)
        assert np.all(np.asarray(out)[pad] == 0)
        for name, d in zip(ARGS, d_args, strict=True):
            assert np.all(np.asarray(d)[pad] == 0), name


def test_chunked_equals_steps():
    """From no state: the chunked form and the steps (a reset at token 0) agree, outputs
    and state (a given state and every form are checked against the float64 loop above)."""
    inputs, a_param, _ = _inputs(5, extreme=True)
    out, state = rglru.causal(**inputs, a_param=a_param, chunk_size=4, return_state=True)
    step = jax.jit(rglru.step)
    s, outs = rglru.init_state(B, H, D), []
    for t in range(T):
        y, s = step(**{n: x[:, t] for n, x in inputs.items()}, state=s, a_param=a_param,
                    reset=jnp.full((B,), t == 0))  # fmt: skip
        outs.append(y)
    helpers.assert_close_normwise(jnp.stack(outs, 1), out)
    np.testing.assert_allclose(s.h, state.h, **helpers.tol(jnp.float32))


def test_non_finite_inputs_spoil_only_their_channel_from_their_token_until_a_new_segment():
    inputs, a_param, _ = _inputs(6)
    dirty = dict(inputs)
    dirty["x"] = dirty["x"].at[0, 2, 0, 1].set(jnp.nan)
    dirty["r"] = dirty["r"].at[1, 4, 1, 2].set(jnp.nan)
    ids = jnp.asarray([[0] * 8 + [1] * 3] * B)
    clean = rglru.causal(**inputs, a_param=a_param, segment_ids=ids)
    for method in rglru.METHODS:
        out = rglru.causal(**dirty, a_param=a_param, method=method, chunk_size=4, segment_ids=ids)
        nan = np.isnan(np.asarray(out))
        expected = np.zeros(out.shape, bool)
        expected[0, 2:8, 0, 1] = True
        expected[1, 4:8, 1, 2] = True
        np.testing.assert_array_equal(nan, expected, err_msg=method)
        np.testing.assert_allclose(np.where(nan, 0, out), np.where(nan, 0, clean), atol=1e-6)


def test_errors():
    inputs, a_param, _ = _inputs(8)
    bad = lambda **kw: rglru.causal(**{**inputs, "a_param": a_param, **kw})
    with pytest.raises(ValueError, match=r"i must have shape \[batch, length, heads, width\]"):
        bad(i=inputs["i"][..., :1])
    with pytest.raises(ValueError, match=r"a_param must have shape \[heads, width\]"):
        bad(a_param=a_param[0])
    with pytest.raises(ValueError, match=r"r must be a floating-point array"):
        bad(r=jnp.zeros((B, T, H, D), jnp.int32))
    with pytest.raises(ValueError, match=r"method must be one of"):
        bad(method="fast")
    with pytest.raises(ValueError, match=r"reset must be bool"):
        bad(reset=jnp.zeros((B, T), jnp.int32))
    with pytest.raises(ValueError, match=r"state.h must have shape \[batch, heads, width\]"):
        bad(initial_state=rglru.State(jnp.zeros((B, H))))
    with pytest.raises(ValueError, match=r"state must be the RGLRUState after the previous"):
        rglru.step(**{n: x[:, 0] for n, x in inputs.items()}, state=None, a_param=a_param)
    state = rglru.init_rglru_state(B, H, D)
    assert state.h.shape == (B, H, D) and np.all(np.asarray(state.h) == 0)


def test_recurrent_block_decodes_pads_and_packs_like_its_full_forward():
    """``RGLRUBlock``: a prefill then steps equals the full forward (state included); a
    left-padded row (NaN at the padding) equals the row alone; two packed segments equal
    each run alone."""
    from flax import nnx

    from linattn_jax.layers import RGLRUBlock

    block = RGLRUBlock(8, 2, lru_width=6, conv_size=3, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m, x, mask, ids: m(x, key_mask=mask, segment_ids=ids))
    layer = functools.partial(forward, block)  # one compile: every call [B, T] with both
    decode = functools.partial(nnx.jit(lambda m, x, s: m(x, state=s, return_state=True)), block)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, 8))
    full, end = decode(x, block.init_state(B))
    state, outs = block.init_state(B), []
    for piece in (slice(0, 5), *(slice(t, t + 1) for t in range(5, T))):
        y, state = decode(x[:, piece], state)
        outs.append(y)
    helpers.assert_close_normwise(jnp.concatenate(outs, 1), full)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(end), strict=True):
        np.testing.assert_allclose(got, want, **helpers.tol(jnp.float32))
    padded = jnp.concatenate([jnp.full((B, 3, 8), jnp.nan), x[:, : T - 3]], axis=1)
    mask, ids = jnp.ones((B, T), bool).at[:, :3].set(False), jnp.zeros((B, T), jnp.int32)
    out = layer(padded, mask, ids)
    helpers.assert_close_normwise(out[:, 3:], full[:, : T - 3])  # full: causal
    assert np.all(np.asarray(out[:, :3]) == 0)
    packed = layer(x, jnp.ones((B, T), bool), ids.at[:, T - 5 :].set(1))
    second, _ = decode(x[:, T - 5 :], block.init_state(B))  # the prefill's shape: compiled
    helpers.assert_close_normwise(packed, jnp.concatenate([full[:, : T - 5], second], 1))
