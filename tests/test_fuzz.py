"""Property-based fuzz: every chunked form against a float64 per-token loop.

Hypothesis draws the shapes, the chunk size, gates with extreme values (-1e3, -1e10,
-1e30, -inf) at random tokens, beta in [0, 2] with repeated keys, padding that holds NaN
and inf in every input, and packed segments. The loops below are the recurrences as
written in the papers, one token at a time, sharing no code with the library.
Derandomized: the same examples on every machine; a few drawn ones beside explicit
corners, each run under jit or eagerly (drawn; the corners alternate).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import linattn_jax as la
from tests import helpers

EXTREMES = (-1e3, -1e10, -1e30, -np.inf)
# Each example is a compile (its own shapes): a few drawn ones beside the corners below.
FUZZ = settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def make_case(
    family, t, h, d, dv, chunk, seed, gate_kind, extremes, repeated, beta_value, keep, new_segment
):
    """One case: ``extremes`` is ``[(token, value), ...]`` written into the gate,
    ``repeated`` (delta) one key for every token, ``beta_value`` (delta) one beta for
    every token or None, ``keep`` and ``new_segment`` the probabilities of a real token
    and of a segment's start."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, t, h, n)) for n in (d, d, dv))
    gate = None
    if gate_kind != "none":
        gate = -rng.uniform(0.0, 1.0, (1, t, h) + ((d,) if gate_kind == "channel" else ()))
        for token, value in extremes:
            gate[0, token] = value
    beta = None
    if family == "delta":
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
        if repeated:  # one key repeated: beta near 2 is then a reflection
            k = np.broadcast_to(k[:, :1], k.shape).copy()
        beta = rng.uniform(0.0, 2.0, (1, t, h))
        if beta_value is not None:
            beta[:] = beta_value
    mask = rng.uniform(size=(1, t)) < keep
    segments = np.cumsum(rng.uniform(size=(1, t)) < new_segment, axis=1)
    return dict(q=q, k=k, v=v, beta=beta, gate=gate, mask=mask, segments=segments, chunk=chunk)


@st.composite
def cases(draw, family: str):
    t = draw(st.integers(1, 18))
    h, d, dv = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    chunk = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    gate_kind = draw(st.sampled_from(["none", "head", "channel"]))
    extremes = []
    if gate_kind != "none":
        for _ in range(draw(st.integers(0, 2))):
            extremes.append((draw(st.integers(0, t - 1)), draw(st.sampled_from(EXTREMES))))
    repeated, beta_value = False, None
    if family == "delta":
        repeated = draw(st.booleans())
        if draw(st.booleans()):
            beta_value = draw(st.sampled_from([1.0, 1.9, 2.0]))
    keep = draw(st.sampled_from([1.0, 0.7]))
    new_segment = draw(st.sampled_from([0.0, 0.2]))
    return make_case(
        family, t, h, d, dv, chunk, seed, gate_kind, extremes, repeated, beta_value, keep,
        new_segment,
    )  # fmt: skip


# The corners, whatever hypothesis draws besides: every extreme gate value at a real token
# (and another at a padded one), per head and per channel; padding with packed segments;
# one token; a chunk longer than the sequence and chunks of one token; for the delta rule
# a repeated key with beta 2 (a reflection), 1.9 and 1.0.
# Each row: t, h, d, dv, chunk, seed, gate kind, extremes, repeated key, beta, keep, new
# segment (as make_case takes them).
ADDITIVE_CORNERS = [
    make_case("additive", *row)
    for row in [
        (13, 2, 3, 2, 4, 1, "head", [(2, -1e3), (6, -1e10), (10, -1e10)], False, None, 0.7, 0.2),
        (11, 1, 2, 3, 8, 2, "channel", [(4, -1e30), (7, -np.inf)], False, None, 0.7, 0.2),
        (18, 2, 1, 1, 1, 3, "channel", [(5, -np.inf), (9, -1e30), (17, -1e3)], False, None, 1, 0.2),
        (1, 1, 3, 2, 3, 4, "head", [(0, -np.inf)], False, None, 1.0, 0.0),
        (9, 2, 3, 3, 16, 5, "none", [], False, None, 0.7, 0.0),
    ]
]  # fmt: skip
DELTA_CORNERS = [
    make_case("delta", *row)
    for row in [
        (12, 2, 3, 2, 4, 6, "head", [(3, -1e10), (8, -np.inf)], True, 2.0, 0.7, 0.2),
        (10, 1, 2, 3, 3, 7, "channel", [(1, -1e30), (6, -1e3), (8, -1e10)], True, 1.9, 1.0, 0.2),
        (17, 2, 3, 1, 8, 8, "channel", [(4, -np.inf), (9, -1e10)], False, 1.0, 0.7, 0.0),
        (1, 1, 2, 2, 1, 9, "none", [], False, None, 1.0, 0.0),
        (7, 2, 1, 2, 16, 10, "head", [(0, -1e3)], True, None, 0.7, 0.2),
    ]
]  # fmt: skip


def _poisoned(case):
    """The case's float inputs as float32, with NaN and inf at every padded token."""
    out = {}
    for name in ("q", "k", "v", "beta", "gate"):
        x = case[name]
        if x is not None:
            pad = ~case["mask"].reshape(case["mask"].shape + (1,) * (x.ndim - 2))
            junk = np.where(np.arange(x.size).reshape(x.shape) % 2, np.nan, np.inf)
            x = np.where(pad, junk, x)
            out[name] = jnp.asarray(x, jnp.float32)
    return out


def _additive_loop(q, k, v, gate, mask, segments):
    """``S_i = a_i S_{i-1} + phi(k_i) v_i^T``, ``Z`` likewise, ``out = phi(q)^T S / phi(q)^T Z``,
    elu + 1 features, float64."""
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    _, t, h, d = q.shape
    s, z = np.zeros((h, d, v.shape[-1])), np.zeros((h, d))
    out = np.zeros((1, t, h, v.shape[-1]))
    for i in range(t):
        if i and segments[0, i] != segments[0, i - 1]:  # a new segment, padding or not
            s, z = np.zeros_like(s), np.zeros_like(z)
        if not mask[0, i]:
            continue
        if gate is not None:
            a = np.exp(gate[0, i])
            a = a[:, None] * np.ones((h, d)) if a.ndim == 1 else a
            s, z = a[..., None] * s, a * z
        fk, fq = phi(k[0, i]), phi(q[0, i])
        s, z = s + fk[..., None] * v[0, i][:, None, :], z + fk
        num, den = np.einsum("hf,hfv->hv", fq, s), np.einsum("hf,hf->h", fq, z)
        out[0, i] = num / (den[:, None] + 1e-6)
    return out


def _delta_loop(q, k, v, beta, gate, mask, segments):
    """``S_t = (I - beta k k^T) Diag(alpha) S + beta k v^T`` (alpha per head or channel),
    ``o = S^T q``, float64."""
    _, t, h, d = q.shape
    s = np.zeros((h, d, v.shape[-1]))
    out = np.zeros((1, t, h, v.shape[-1]))
    for i in range(t):
        if i and segments[0, i] != segments[0, i - 1]:  # a new segment, padding or not
            s = np.zeros_like(s)
        if not mask[0, i]:
            continue
        if gate is not None:
            a = np.exp(gate[0, i])
            s = (a[:, None, None] if a.ndim == 1 else a[..., None]) * s
        ki, bi = k[0, i], beta[0, i]
        erase = np.eye(d)[None] - bi[:, None, None] * ki[:, :, None] * ki[:, None, :]
        s = erase @ s + bi[:, None, None] * ki[:, :, None] * v[0, i][:, None, :]
        out[0, i] = np.einsum("hkv,hk->hv", s, q[0, i])
    return out


def _check(out, ref, mask):
    assert bool(jnp.all(jnp.isfinite(out))), "padding (NaN, inf) reached an output"
    assert bool(jnp.all(jnp.where(mask[..., None, None], True, out == 0)))
    helpers.assert_close_normwise(np.asarray(out, np.float64), ref, rtol=1e-4)


def _with_examples(corners, *extra):
    """Explicit examples: each corner, with ``extra``'s lists' values in turn beside it."""

    def wrap(test):
        for i, corner in enumerate(corners):
            test = example(corner, *(values[i % len(values)] for values in extra))(test)
        return test

    return wrap


def _compiled_or_eager(fn, jit, **static):
    """``fn`` with ``static`` bound, under jit or not (eager runs op by op: a compile of
    each op per shape)."""
    bound = functools.partial(fn, **static)
    return jax.jit(bound) if jit else bound


# Jitted or eager in turn: each corner alternates, hypothesis draws the rest.
@pytest.mark.slow
@FUZZ
@given(cases("additive"), st.sampled_from(["chunked", "quadratic"]), st.booleans())
@_with_examples(ADDITIVE_CORNERS, ["chunked", "quadratic"], [False, True])
def test_additive_chunked_forms_equal_the_float64_loop(case, method, jit):
    x = _poisoned(case)
    fn = _compiled_or_eager(
        la.causal_linear_attention, jit, method=method, chunk_size=case["chunk"]
    )
    out = fn(
        x["q"],
        x["k"],
        x["v"],
        gate=x.get("gate"),
        key_mask=jnp.asarray(case["mask"]),
        segment_ids=jnp.asarray(case["segments"], jnp.int32),
    )
    ref = _additive_loop(*(case[n] for n in ("q", "k", "v", "gate", "mask", "segments")))
    _check(out, ref, case["mask"])


@pytest.mark.slow
@FUZZ
@given(cases("delta"), st.booleans())
@_with_examples(DELTA_CORNERS, [True, False])
def test_delta_rule_chunked_form_equals_the_float64_loop(case, jit):
    x = _poisoned(case)
    fn = _compiled_or_eager(la.delta_rule, jit, chunk_size=case["chunk"])
    out = fn(
        x["q"],
        x["k"],
        x["v"],
        x["beta"],
        gate=x.get("gate"),
        key_mask=jnp.asarray(case["mask"]),
        segment_ids=jnp.asarray(case["segments"], jnp.int32),
    )
    ref = _delta_loop(*(case[n] for n in ("q", "k", "v", "beta", "gate", "mask", "segments")))
    _check(out, ref, case["mask"])


def test_the_loops_agree_with_the_scan_forms_on_plain_inputs():
    """The loops themselves, on inputs without extremes, against the library's per-token
    scan forms (a check of the checkers)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 9, 2, 3)) for _ in range(3))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    gate, beta = -rng.uniform(size=(1, 9, 2)), rng.uniform(size=(1, 9, 2))
    mask, segments = np.ones((1, 9), bool), np.zeros((1, 9), int)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    out = la.causal_linear_attention(f32(q), f32(k), f32(v), gate=f32(gate), method="scan")
    helpers.assert_close_normwise(out, _additive_loop(q, k, v, gate, mask, segments), 1e-5)
    out = la.delta_rule(f32(q), f32(k), f32(v), f32(beta), gate=f32(gate), method="scan")
    helpers.assert_close_normwise(out, _delta_loop(q, k, v, beta, gate, mask, segments), 1e-5)
