"""The chunked forms lower into GPU and TPU programs (lowered for those platforms as
``jax.export`` does, no device needed) with no per-token loop and no buffer that grows as
t^2: every loop runs at most one step per chunk, and the largest buffer grows linearly with
the length; and they are chunk-parallel there: the loops over chunks carry only the state,
every product with a chunk's tokens (scores, the triangular system, W and U, the outputs)
runs batched outside them.

The programs are read as MLIR (``jax.extend.mlir``'s bindings: operations, their regions,
operands' defining operations and types), not as text, whose layout changes between
releases. A ``stablehlo.composite`` is one operation of the program: its decomposition
(jax 0.12 lowers ``cumsum`` on GPU to a ``chlo.scan`` composite, for the GPU compiler's own
scan, whose reference decomposition is a serial loop) is not walked."""

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo

import linattn_jax as la
from linattn_jax.ops import chunking

C, D = 64, 8  # no width equals a chunk's tokens (16 per channel, 64)
PLATFORMS = ("cuda", "tpu")


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


def _lower(fn, *args) -> ir.Module:
    """``fn``'s StableHLO module for GPU and TPU (their own forms: ``choose_at_lowering``)."""
    with chunking.choose_at_lowering():
        traced = jax.jit(fn).trace(*args)
        return traced.lower(lowering_platforms=PLATFORMS).compiler_ir("stablehlo")


def _program(family: str, t: int, gradient: bool) -> ir.Module:
    fn, args = _case(family, t)
    if gradient:
        loss = lambda *a, fn=fn: jnp.sum(jnp.sin(fn(*a)))
        fn = jax.grad(loss, argnums=tuple(range(len(args))))
    return _lower(fn, *args)


def _functions(module: ir.Module) -> dict[str, ir.Operation]:
    return {
        ir.StringAttr(op.attributes["sym_name"]).value: op.operation
        for op in module.body.operations
        if op.operation.name == "func.func"
    }


def _walk(regions, functions: dict[str, ir.Operation]) -> Iterator[ir.Operation]:
    """Every operation that runs inside ``regions`` (nested regions, and the functions
    that ``func.call`` enters, each time it enters them), in program order."""
    for region in regions:
        for block in region.blocks:
            for inner in block.operations:
                inner = inner.operation
                yield inner
                if inner.name == "func.call":
                    callee = ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
                    yield from _walk(functions[callee].regions, functions)
                yield from _walk(inner.regions, functions)


def _program_ops(module: ir.Module) -> Iterator[ir.Operation]:
    functions = _functions(module)
    main = functions["main"]
    yield main
    yield from _walk(main.regions, functions)


def _trip_bound(loop: ir.Operation) -> int:
    """The constant ``n`` of a ``stablehlo.while`` whose condition is ``i < n`` (how
    ``lax.scan`` and ``fori_loop`` lower); an error for any other condition."""
    (condition,) = loop.regions[0].blocks
    for op in condition.operations:
        op = op.operation
        if op.name != "stablehlo.compare":
            continue
        direction = stablehlo.ComparisonDirectionAttr(op.attributes["comparison_direction"])
        counter, bound = op.operands
        if direction.value == "LT" and isinstance(counter.owner, ir.Block):
            constant = bound.owner
            assert constant.name == "stablehlo.constant", f"not a constant bound: {constant}"
            return int(
                ir.DenseIntElementsAttr(constant.attributes["value"]).get_splat_value().value
            )
    raise AssertionError(f"no `counter < bound` in the loop's condition: {condition}")


def loop_bounds(module: ir.Module) -> list[int]:
    """The trip count bound of every ``stablehlo.while`` (``lax.scan``, ``fori_loop``)
    that runs, in program order."""
    return [_trip_bound(op) for op in _program_ops(module) if op.name == "stablehlo.while"]


def loop_bodies(module: ir.Module) -> list[tuple[int, list[ir.Operation]]]:
    """``(trip count bound, body's operations)`` of every ``stablehlo.while`` that runs
    (nested loops' and called functions' operations included in their parent's). The
    operations are valid while ``module`` is alive."""
    functions = _functions(module)
    return [
        (_trip_bound(op), list(_walk([op.regions[1]], functions)))
        for op in _program_ops(module)
        if op.name == "stablehlo.while"
    ]


def _shapes(op: ir.Operation) -> list[tuple[int, ...]]:
    """The shapes of ``op``'s tensor operands and results."""
    values = [*op.operands, *op.results]
    return [tuple(v.type.shape) for v in values if isinstance(v.type, ir.RankedTensorType)]


def products_with_tokens(body: list[ir.Operation], c: int) -> list[ir.Operation]:
    """The ``dot_general`` operations of ``body`` with an operand or result dimension of
    ``c`` (a chunk's tokens: the widths here are never ``c``)."""
    dots = [op for op in body if op.name == "stablehlo.dot_general"]
    return [op for op in dots if any(c in shape for shape in _shapes(op))]


def largest_buffer(module: ir.Module) -> int:
    """The element count of the largest tensor in the program (arguments, every
    operation's operands and results)."""
    main = _functions(module)["main"]
    arguments = [tuple(a.type.shape) for a in main.regions[0].blocks[0].arguments]
    shapes = arguments + [s for op in _program_ops(module) for s in _shapes(op)]
    return max(int(np.prod(s)) for s in shapes)


@pytest.mark.parametrize("family", ["additive_decay", "gla", "gated_deltanet", "kda"])
def test_chunked_forms_export_without_token_loops_or_quadratic_buffers(family):
    """The gradient's program (which holds the forward too) at two lengths."""
    sizes = {}
    for t in (256, 512):
        module = _program(family, t, gradient=True)
        bounds = loop_bounds(module)
        # One scan step per chunk at most (the additive forms' default chunk is 64, or
        # 16 per channel: more steps there, still one per chunk); no loop over rows.
        chunks = t // (16 if family == "gla" else C)
        assert max(bounds, default=0) <= chunks, (t, sorted(bounds))
        sizes[t] = largest_buffer(module)
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
    module = _program(family, t, True)  # alive while its operations are read
    loops = [body for bound, body in loop_bodies(module) if bound == t // c]
    assert len(loops) == 3, len(loops)
    for body in loops:
        assert not products_with_tokens(body, c), products_with_tokens(body, c)[:2]
        if family in ("additive_decay", "gla"):
            assert not [op for op in body if op.name == "stablehlo.dot_general"]


def test_a_host_traces_its_own_backends_form_unless_told_to_choose_at_lowering():
    """By default a chunked form traces only the form of the backend JAX runs on (CPU here,
    one chunk per step of the loop): lowered for GPU and TPU its loops still read a chunk's
    tokens, and the jaxpr holds no ``platform_index``. Inside ``choose_at_lowering()`` both
    forms are traced and the lowered platform's kept (the test above)."""
    t, c = 256, 32  # the delta rule's chunks on CPU
    _, args = _case("gated_deltanet", t)
    fn = lambda q, k, v, beta, g: la.delta_rule(q, k, v, beta, gate=g)  # the default chunk
    assert "platform_index" not in str(jax.make_jaxpr(fn)(*args))
    module = jax.jit(fn).trace(*args).lower(lowering_platforms=PLATFORMS).compiler_ir("stablehlo")
    loops = [body for bound, body in loop_bodies(module) if bound == t // c]
    assert loops and all(products_with_tokens(body, c) for body in loops)
    with chunking.choose_at_lowering():
        assert "platform_index" in str(jax.make_jaxpr(fn)(*args))
    assert not chunking.CHOOSE_AT_LOWERING


def test_the_loop_parser_reads_a_per_token_scan():
    """The checks above would see a loop over tokens (a plain scan of t steps), and a
    product with a chunk's tokens in a loop's body, there inside a function it calls."""
    xs = jnp.ones((300, 4))
    fn = lambda xs: jax.lax.scan(lambda c, x: (c + x, c), jnp.zeros(4), xs)[1]
    assert loop_bounds(_lower(fn, xs)) == [300]

    step = jax.jit(lambda s, x: (s + x.T @ x, None))  # lowers as a func.call
    fn = lambda xs: jax.lax.scan(step, jnp.zeros((D, D)), xs)[0]
    module = _lower(fn, jnp.ones((3, C, D)))
    ((bound, body),) = loop_bodies(module)
    assert bound == 3
    assert products_with_tokens(body, C)
