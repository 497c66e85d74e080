"""Mixed precision: bfloat16 inputs run the chunks' matmuls in bfloat16 with float32
accumulation; float32 inputs are untouched. The error is bounded against float64."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from linattn_jax.ops import chunking
from tests import helpers
from tests.reference_recurrent import delta_rule_reference, gla_reference

B, T, H, D, DV = 1, 40, 2, 8, 4  # 40 tokens: chunks of 16 and 32 leave a partial chunk
_DOT = re.compile(
    r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)"
)


def _dots(fn, *args) -> list[tuple[str, str, str]]:
    """The element types ``(lhs, rhs, result)`` of every dot in ``fn``'s lowered program."""
    text = jax.jit(fn).lower(*args).as_text()
    element = lambda t: t.rsplit("x", 1)[-1].rstrip(">")
    return [tuple(map(element, d)) for d in _DOT.findall(text)]


def _forward_and_backward(fn, args):
    """``fn`` and its backward pass alone (the vjp, forward residuals held fixed), as
    ``(function, arguments)`` pairs."""
    out, vjp = jax.vjp(fn, *args)
    return [(fn, args), (vjp, (jnp.ones_like(out),))]


def _delta_inputs(dtype):
    q, k, v = helpers.qkv(1, B, T, H, D, DV, dtype=jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(2), (B, T, H)))
    return tuple(x.astype(dtype) for x in (q, k, v, beta))


def _attention(q, k, v):
    return la.causal_linear_attention(q, k, v, chunk_size=16).astype(jnp.float32).sum()


def _delta(q, k, v, beta):
    return la.delta_rule(q, k, v, beta, chunk_size=16).astype(jnp.float32).sum()


# The dots with bfloat16 operands and float32 results. Additive form: forward 3 (q k^T,
# scores v, phi(q) S; the state's update phi(k)^T v stays float32); backward 7 (the scores
# recomputed, 4 of chunk_body_bwd's 6 products, the scores' 2 transposes; with a
# denominator dScores and d(phi(q)) keep float32 operands). Delta rule:
# forward 3 (Q K^T, Q S, (Q K^T * D) U); backward 7 (Q K^T recomputed, 2 transposes each).
@pytest.mark.parametrize(
    "name, fn, inputs, forward, backward",
    [
        ("additive", _attention, lambda dt: helpers.qkv(0, B, T, H, D, DV, dtype=dt), 3, 7),
        ("delta", _delta, _delta_inputs, 3, 7),
    ],
)
def test_bfloat16_dots_accumulate_in_float32(name, fn, inputs, forward, backward):
    passes = _forward_and_backward(fn, inputs(jnp.bfloat16))
    for (f, args), expected in zip(passes, (forward, backward), strict=True):
        dots = _dots(f, *args)
        mixed = [d for d in dots if d == ("bf16", "bf16", "f32")]
        assert len(mixed) == expected, (name, dots)
        # The rest run in float32; no dot rounds its result to bfloat16.
        assert all(d in (("bf16", "bf16", "f32"), ("f32", "f32", "f32")) for d in dots), dots
    # float32 inputs: no bfloat16 anywhere, forward or backward.
    for f, args in _forward_and_backward(fn, inputs(jnp.float32)):
        text = jax.jit(f).lower(*args).as_text()
        assert "bf16" not in text and len(_dots(f, *args)) > 0


@pytest.mark.parametrize(
    "fn, inputs",
    [(_attention, lambda dt: helpers.qkv(0, B, T, H, D, DV, dtype=dt)), (_delta, _delta_inputs)],
)
def test_float16_dots_read_float32_operands(fn, inputs):
    """float16's range (65504) holds neither a chunk's scores nor its state: no dot reads
    a float16 operand, forward or backward (bfloat16, float32's range, does above)."""
    for f, args in _forward_and_backward(fn, inputs(jnp.float16)):
        dots = _dots(f, *args)
        assert dots and all(d == ("f32", "f32", "f32") for d in dots), dots


def test_float16_additive_scores_beyond_its_range():
    """Scores ``q k^T`` of 1e5 from float16 inputs whose outputs fit float16 (gated, no
    denominator): within float16's rounding of the float64 recurrence, not inf."""
    q, k, v = helpers.qkv(4, B, T, H, D, DV, dtype=jnp.float32)
    q, k, v = ((s * x).astype(jnp.float16) for s, x in ((100.0, q), (100.0, k), (0.01, v)))
    g = -0.01 * jnp.ones((B, T, H))
    out = la.causal_linear_attention(
        q, k, v, feature_map="identity", gate=g, normalize=False, chunk_size=16
    )
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        g64 = jnp.broadcast_to(f64(g)[..., None], q.shape)
        ref = np.asarray(gla_reference(f64(q), f64(k), f64(v), g64, normalize=False)[0])
    assert np.abs(ref).max() < 2e4 and out.dtype == jnp.float16
    assert _relative(out, ref) <= float(jnp.finfo(jnp.float16).eps), _relative(out, ref)


def _relative(x, ref) -> float:
    """The normwise relative error ``||x - ref|| / ||ref||``, in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _check_against_float64(ours, ref, args, dtype):
    """``ours(*args)`` and its gradient (for a fixed random cotangent of the output)
    within a few unit roundoffs of ``ref`` run in float64 on the same rounded inputs.

    The output is itself rounded to ``dtype`` (half a unit roundoff u, normwise); each
    matmul operand is rounded once more (u), and the gradient's products twice over
    (forward and transposed), so the bounds are 2u for the output and 4u for gradients.
    """
    u = float(jnp.finfo(dtype).eps) / 2  # 2^-8 for bfloat16
    w = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, DV))

    def grads_and_out(fn, w, x):
        def loss(*x):
            out = fn(*x)
            return jnp.sum(out.astype(w.dtype) * w), out

        return jax.grad(loss, argnums=tuple(range(len(x))), has_aux=True)(*x)

    got_grads, got = jax.jit(functools.partial(grads_and_out, ours))(w, args)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        x64 = tuple(f64(x) for x in args)
        want_grads, want = jax.jit(functools.partial(grads_and_out, ref))(f64(w), x64)
        want, want_grads = np.asarray(want), [np.asarray(g) for g in want_grads]
    assert got.dtype == dtype
    errors = [_relative(got, want)] + [
        _relative(g, h) for g, h in zip(got_grads, want_grads, strict=True)
    ]
    assert errors[0] <= 2 * u, errors
    assert max(errors[1:]) <= 4 * u, errors
    return errors


_GATE = -jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(3), (B, T, H, D)))


@pytest.mark.parametrize(
    "gate, normalize, chunk_size, dtype",
    [
        (None, True, 16, jnp.bfloat16),
        (None, False, 16, jnp.bfloat16),
        ("head", True, 16, jnp.bfloat16),
        ("channel", True, 32, jnp.bfloat16),  # per-channel in sub-chunks of 16
        ("channel", True, 16, jnp.bfloat16),  # the [c, c, f] decays, kept in float32
        (None, True, 16, jnp.float16),
    ],
)
def test_additive_chunked_error_against_float64(gate, normalize, chunk_size, dtype):
    q, k, v = helpers.qkv(0, B, T, H, D, DV, dtype=dtype)
    g = {None: None, "head": _GATE[..., 0], "channel": _GATE}[gate]

    def ours(q, k, v):
        return la.causal_linear_attention(
            q, k, v, gate=g, normalize=normalize, chunk_size=chunk_size
        )

    def ref(q, k, v):
        g64 = jnp.zeros(q.shape, q.dtype) if g is None else np.asarray(g, np.float64)
        g64 = jnp.broadcast_to(g64[..., None] if g64.ndim == 3 else g64, q.shape)
        phi = lambda x: jax.nn.elu(x) + 1.0
        return gla_reference(phi(q), phi(k), v, g64, normalize=normalize)[0]

    _check_against_float64(ours, ref, (q, k, v), dtype)


@pytest.mark.parametrize("variant", ["deltanet", "gated", "kda"])
def test_delta_rule_chunked_error_against_float64(variant):
    args = _delta_inputs(jnp.bfloat16)
    g = {"deltanet": None, "gated": _GATE[..., 0], "kda": _GATE}[variant]
    chunk_size = 32 if variant == "kda" else 16

    def ours(q, k, v, beta):
        return la.delta_rule(q, k, v, beta, gate=g, chunk_size=chunk_size)

    def ref(q, k, v, beta):
        gate = None if g is None else jnp.asarray(np.asarray(g, np.float64))
        return delta_rule_reference(q, k, v, beta, gate=gate)[0]

    _check_against_float64(ours, ref, args, jnp.bfloat16)


def test_mixed_einsum_gradient_is_the_einsums():
    """``chunking.einsum``'s hand-written gradient: the transposed products, float32
    cotangents, equal to autodiff's to bfloat16 accuracy (and exactly without a cast)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 3))
    b = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 3))
    w = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 7))
    plain = lambda a, b: jnp.sum(jnp.einsum("nif,njf->nij", a, b) * w)
    mixed = lambda a, b: jnp.sum(chunking.einsum("nif,njf->nij", a, b, dtype=jnp.bfloat16) * w)
    want = jax.grad(plain, (0, 1))(a, b)
    got = jax.grad(mixed, (0, 1))(a, b)
    chex.assert_type(got, jnp.float32)
    chex.assert_trees_all_close(got, want, atol=3e-2, rtol=3e-2)
    assert not np.array_equal(np.asarray(got[0]), np.asarray(want[0]))  # it did round
    none = lambda a, b: jnp.sum(chunking.einsum("nif,njf->nij", a, b) * w)
    chex.assert_trees_all_equal(jax.grad(none, (0, 1))(a, b), want)
