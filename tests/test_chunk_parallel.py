"""The delta rule's chunk-parallel groups (the GPU/TPU layout, run here on CPU by an
explicit ``group_tokens``) and its triangular solves, against the per-token scan."""

import functools

import jax
import jax.numpy as jnp
import pytest

import linattn_jax as la
from linattn_jax.ops import checks, chunking
from linattn_jax.ops.delta import chunked
from tests import helpers

B, T, H, D, DV, C = 1, 37, 2, 8, 5, 8  # 5 chunks, the last one partial


def _inputs(variant: str):
    q, k, v = helpers.qkv(3, B, T, H, D, DV)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    keys = jax.random.split(jax.random.PRNGKey(4), 3)
    beta = 2 * jax.nn.sigmoid(jax.random.normal(keys[0], (B, T, H)))  # up to 2
    shape = {"gated": (B, T, H), "kda": (B, T, H, D)}[variant]
    gate = -jax.nn.softplus(jax.random.normal(keys[1], shape))
    gate = gate.at[:, 20].set(-jnp.inf)  # a full reset inside chunk 2
    s0 = 0.3 * jax.random.normal(keys[2], (B, H, D, DV))
    return q, k, v, beta, gate, s0


def _grouped_form(group_tokens, q, k, v, beta, gate, s0):
    """``la.delta_rule``'s chunked form with ``group_tokens`` (heads first inside)."""
    g = checks.log_decay(None, gate, B, T, H, jnp.float32, channels=D)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    xs = (*(heads_first(x) for x in (q, k, v, beta)), g, None)
    out, s = chunked.causal_chunks(xs, s0, C, T, group_tokens=group_tokens)
    return heads_first(out), s


@pytest.mark.parametrize("variant", ["gated", "kda"])
@pytest.mark.parametrize("group_tokens", [3 * C, 64])
def test_groups_of_chunks_match_the_scan(variant, group_tokens):
    """Groups of 3 chunks (the last one of 2) and all 5 at once (CPU runs one at a time):
    outputs, final state and gradients."""
    args = _inputs(variant)
    w = jax.random.normal(jax.random.PRNGKey(5), (B, T, H, DV))

    def loss(form, *a):
        out, s = form(*a)
        return jnp.sum(out * w) + jnp.sum(jnp.sin(s)), (out, s)

    def scan(q, k, v, beta, gate, s0):
        out, state = la.delta_rule(
            q, k, v, beta, gate=gate, method="scan", chunk_size=C,
            initial_state=la.DeltaRuleState(s0), return_state=True,
        )  # fmt: skip
        return out, state.s

    grads = lambda form: jax.jit(
        jax.grad(functools.partial(loss, form), argnums=range(6), has_aux=True)
    )(*args)
    got_grads, got = grads(functools.partial(_grouped_form, group_tokens))
    want_grads, want = grads(scan)
    jax.tree.map(lambda a, e: helpers.assert_close_normwise(a, e, 2e-5), got, want)
    helpers.assert_close_normwise(got_grads, want_grads)


def test_the_blocked_solve_and_its_gradient_match_xlas():
    keys = jax.random.split(jax.random.PRNGKey(6), 2)
    lower = jnp.tril(0.5 * jax.random.normal(keys[0], (3, 32, 32)), -1)
    rhs = jax.random.normal(keys[1], (3, 32, 7))
    w = jnp.cos(jnp.arange(3 * 32 * 7.0)).reshape(3, 32, 7)
    grads = lambda solve: jax.grad(lambda a, b: jnp.sum(solve(a, b) * w), argnums=(0, 1))
    helpers.assert_close_normwise(chunked.blocked_solve(lower, rhs), chunked.xla_solve(lower, rhs))
    helpers.assert_close_normwise(
        grads(chunked.blocked_solve)(lower, rhs), grads(chunked.xla_solve)(lower, rhs)
    )


def test_groups_are_even_and_bounded_by_their_states():
    """A long sequence splits into even groups (10 chunks at most 8 a group: 2 of 5, not
    8 + 2 padded to 8), and wide states (Taylor's 1 + 64 + 64^2 features) run fewer
    chunks at once."""
    assert chunking.chunks_per_group(64, 10, 8 * 64) == 5
    assert chunking.chunks_per_group(64, 3, 8192) == 3
    assert chunking.chunks_per_group(64, 200, 8192, 64 * 64) == 100
    assert chunking.chunks_per_group(64, 200, 8192, 4161 * 64) == 1
    assert chunking.chunks_per_group(16, 200, 1) == 1


@pytest.mark.parametrize("shape, product", [((2, 3, 16), True), ((2, 3, 16, 1), True),
                                            ((2, 3, 16, 8), False)])  # fmt: skip
def test_a_chunks_cumulative_sum_is_a_product_for_one_channel_only(shape, product):
    """Per-head log-decays and reset counts sum as one product with the lower-triangular
    ones (fewer, smaller kernels); per-channel ones keep ``cumsum`` (the product's layout
    changes made GLA's forward+backward 25% slower: docs/benchmarks.md)."""
    x = jax.random.normal(jax.random.PRNGKey(7), shape)
    helpers.assert_close_normwise(chunking.chunk_cumsum(x), jnp.cumsum(x, axis=2))
    hlo = jax.jit(chunking.chunk_cumsum).lower(x).as_text()
    assert ("dot_general" in hlo) == product
