"""The chunked forms lower into GPU and TPU programs (``jax.export``, no device needed) with
no per-token loop and no buffer that grows as t^2: every loop runs at most one step per
chunk, and the largest buffer grows linearly with the length; and they are chunk-parallel
there: the loops over chunks carry only the state, every product with a chunk's tokens
(scores, the triangular system, W and U, the outputs) runs batched outside them."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la

C, D = 64, 8  # no width equals a chunk's tokens (16 per channel, 64)
PLATFORMS = ("cuda", "tpu")
_CONSTANT = re.compile(r"(%[\w#]+) = stablehlo\.constant dense<(\d+)> : tensor<i32>")
_BOUND = re.compile(r"stablehlo\.compare\s+LT, %iterArg\w*, (%[\w#]+)")
_TENSOR = re.compile(r"tensor<((?:\d+x)+)[a-z]+\d*>")


def _case(family: str, t: int):
    """``(fn, args)``: the chunked form of ``family`` on ``t`` tokens, b = h = 1."""
    keys = jax.random.split(jax.random.PRNGKey(t), 5)
    q, k, v = (jax.random.normal(key, (1, t, 1, D)) for key in keys[:3])
    per_channel = family in ("gla", "kda")
    gate = -jax.nn.softplus(jax.random.normal(keys[3], (1, t, 1, D) if per_channel else (1, t, 1)))
    if family in ("additive_decay", "gla"):
        return (lambda q, k, v, g: la.causal_linear_attention(q, k, v, gate=g)), (q, k, v, gate)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, t, 1)))
    fn = lambda q, k, v, beta, g: la.delta_rule(q, k, v, beta, gate=g, chunk_size=C)
    return fn, (q, k / jnp.linalg.norm(k, axis=-1, keepdims=True), v, beta, gate)


def _program(family: str, t: int, gradient: bool) -> str:
    fn, args = _case(family, t)
    if gradient:
        loss = lambda *a, fn=fn: jnp.sum(jnp.sin(fn(*a)))
        fn = jax.grad(loss, argnums=tuple(range(len(args))))
    return jax.export.export(jax.jit(fn), platforms=PLATFORMS)(*args).mlir_module()


def loop_bounds(text: str) -> list[int]:
    """The trip count bound of every ``stablehlo.while`` (``lax.scan``, ``fori_loop``)."""
    bounds = []
    for function in text.split("func.func")[1:]:
        constants = dict(_CONSTANT.findall(function))
        for loop in function.split("stablehlo.while(")[1:]:
            condition = loop.split("} do {")[0]
            bounds += [int(constants[name]) for name in _BOUND.findall(condition)]
    return bounds


def loop_bodies(text: str) -> list[tuple[int, str]]:
    """``(trip count bound, body text)`` of every ``stablehlo.while`` (nested loops' text
    included in their parent's)."""
    loops = []
    for function in text.split("func.func")[1:]:
        constants = dict(_CONSTANT.findall(function))
        for start in (m.end() for m in re.finditer(r"stablehlo\.while\(", function)):
            split = function.index("} do {", start)
            (bound,) = _BOUND.findall(function[start:split])
            depth, end = 1, split + len("} do {")
            while depth:
                depth += {"{": 1, "}": -1}.get(function[end], 0)
                end += 1
            loops.append((int(constants[bound]), function[split:end]))
    return loops


def products_with_tokens(body: str, c: int) -> list[str]:
    """The ``dot_general`` lines of ``body`` with an operand or result dimension of ``c``
    (a chunk's tokens: the widths here are never ``c``)."""
    dots = [line for line in body.splitlines() if "stablehlo.dot_general" in line]
    return [line for line in dots if any(
        str(c) in shape.rstrip("x").split("x") for shape in _TENSOR.findall(line)
    )]  # fmt: skip


def largest_buffer(text: str) -> int:
    """The element count of the largest tensor type in the program."""
    shapes = _TENSOR.findall(text)
    return max(int(np.prod([int(n) for n in s.rstrip("x").split("x")])) for s in shapes)


@pytest.mark.parametrize("family", ["additive_decay", "gla", "gated_deltanet", "kda"])
def test_chunked_forms_export_without_token_loops_or_quadratic_buffers(family):
    """The gradient's program (which holds the forward too) at two lengths."""
    sizes = {}
    for t in (256, 512):
        text = _program(family, t, gradient=True)
        bounds = loop_bounds(text)
        # One scan step per chunk at most (the additive forms' default chunk is 64, or
        # 16 per channel: more steps there, still one per chunk); no loop over rows.
        chunks = t // (16 if family == "gla" else C)
        assert max(bounds, default=0) <= chunks, (t, sorted(bounds))
        sizes[t] = largest_buffer(text)
    assert sizes[512] <= 2 * sizes[256], sizes  # linear in t, not quadratic
    assert sizes[512] < 512**2, sizes


@pytest.mark.parametrize("family", ["additive_decay", "gla", "gated_deltanet", "kda"])
def test_the_loops_over_chunks_carry_only_the_state(family):
    """On GPU and TPU every chunk of a sequence runs its chunk-local work at once: the
    loops of one step per chunk (forward, its recompute in the backward, and the
    transposed scan) hold no product that reads a chunk's tokens. The additive forms'
    hold no product at all (the state's step is ``a S + B``); the delta rule's only the
    ``[dk, dk] x [dk, dv]`` transition."""
    t = 512
    c = 16 if family == "gla" else C
    loops = [body for bound, body in loop_bodies(_program(family, t, True)) if bound == t // c]
    assert len(loops) == 3, len(loops)
    for body in loops:
        assert not products_with_tokens(body, c), products_with_tokens(body, c)[:2]
        if family in ("additive_decay", "gla"):
            assert "stablehlo.dot_general" not in body


def test_the_loop_parser_reads_a_per_token_scan():
    """The check above would see a loop over tokens: a plain scan of t steps."""
    xs = jnp.ones((300, 4))
    fn = lambda xs: jax.lax.scan(lambda c, x: (c + x, c), jnp.zeros(4), xs)[1]
    text = jax.export.export(jax.jit(fn), platforms=PLATFORMS)(xs).mlir_module()
    assert loop_bounds(text) == [300]
