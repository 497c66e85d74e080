"""The chunked form's hand-written backward equals plain autodiff, and the Taylor
kernel inside chunks equals the explicit features.

The reference gradient is ``jax.vjp`` of a plain ``lax.scan`` over the same chunk
body (no custom gradient anywhere), in float64, so the two may differ only by
rounding.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex_core

import linattn_jax as la
from linattn_jax.ops import checks
from linattn_jax.ops.additive import chunked, inputs
from tests import helpers

B, T, H, D, DV, C = 2, 13, 3, 4, 5, 4
# float64: both sides do the same sums in a different order.
F64 = dict(atol=1e-12, rtol=1e-12)


def _plain_chunked(phi_q, phi_k, v, g, resets, state, chunk_size, *, diagonal, kernel=None):
    """``chunked.run_chunks`` as a plain ``lax.scan`` of ``group_body`` (one chunk a
    group): autodiff only."""
    t = phi_q.shape[2]
    n = -(-t // chunk_size)
    xs = (phi_q, phi_k, v, g, resets)
    fn = None
    if kernel is not None:
        fn, q, k, live = kernel
        xs = xs + (q, k, live)

    def chunks(x):
        x = jnp.pad(x, [(0, 0), (0, 0), (0, n * chunk_size - t)] + [(0, 0)] * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(x.shape[:2] + (n, chunk_size) + x.shape[3:]), 2, 0)

    def unchunk(y):
        y = jnp.moveaxis(y, 0, 2)
        return y.reshape(y.shape[:2] + (n * chunk_size,) + y.shape[4:])[:, :, :t]

    body = functools.partial(chunked.group_body, c=chunk_size, diagonal=diagonal, kernel=fn)
    state, ys = jax.lax.scan(body, state, jax.tree.map(chunks, xs))
    return jax.tree.map(unchunk, ys), state


CASES = {
    "plain": dict(),
    "decay": dict(decay=jnp.array([0.5, 0.9, 1.0])),
    "gate_with_resets": dict(gate="gate", neg_inf=True),
    "decay_and_segments": dict(decay=0.8, segments=True),
    "per_channel_gate": dict(gate="channels"),
    "everything": dict(decay=0.9, gate="gate", neg_inf=True, segments=True, mask=True),
}


def _inputs(case, feature_map, poison=False):
    """Raw q, k, v (float64, NaN/inf at padded tokens when ``poison``) and the options."""
    opts = CASES[case]
    q, k, v = (x.astype(jnp.float64) for x in helpers.qkv(0, B, T, H, D, DV))
    gate = None
    if opts.get("gate") == "gate":
        gate = helpers.gate(1, B, T, H).astype(jnp.float64)
        if opts.get("neg_inf"):
            gate = gate.at[:, 5, 1].set(-jnp.inf).at[0, 9, 2].set(-jnp.inf)
    elif opts.get("gate") == "channels":
        f = la.feature_maps.feature_dim(feature_map, D, H)
        key = jax.random.PRNGKey(2)
        gate = -jax.nn.softplus(jax.random.normal(key, (B, T, H, f), jnp.float64))
    segment_ids = helpers.segment_ids(3, B, T, p=0.25) if opts.get("segments") else None
    key_mask = helpers.key_mask(4, B, T) if opts.get("mask") or poison else None
    if poison:
        pad = ~key_mask[:, :, None, None]
        q, k, v = (
            jnp.where(pad, bad, x)
            for x, bad in zip((q, k, v), (jnp.nan, jnp.inf, jnp.nan), strict=True)
        )
    return (q, k, v), dict(decay=opts.get("decay"), gate=gate), segment_ids, key_mask


def _run(form, case, feature_map, *, normalize, with_state, diagonal, poison=False, chunk_size=C):
    """(outputs, vjp) of the chunked form on raw inputs, through ``features``."""
    (q, k, v), decay_gate, segment_ids, key_mask = _inputs(case, feature_map, poison)
    f = la.feature_maps.feature_dim(feature_map, D, H)
    state = helpers.random_state(7, B, H, f, DV) if with_state else None

    def fn(q, k, v, s, z, gate):
        phi_q, phi_k, v64 = inputs.features(q, k, v, feature_map, key_mask, key_mask)
        g = checks.log_decay(
            decay_gate["decay"],
            gate,
            B,
            T,
            H,
            jnp.float64,
            channels=f,
            key_mask=key_mask,
        )
        r = None if segment_ids is None else checks.segment_resets(segment_ids, B, T, jnp.float64)
        kernel = inputs.chunk_kernel(q, k, feature_map, key_mask, g) if diagonal else None
        z = z if normalize else None
        (num, den), (s, z) = form(
            phi_q, phi_k, v64, g, r, (s, z), chunk_size, diagonal=diagonal, kernel=kernel
        )
        return num, den, s, z

    s0 = jnp.zeros((B, H, f, DV)) if state is None else state.s.astype(jnp.float64)
    z0 = jnp.zeros((B, H, f)) if state is None else state.z.astype(jnp.float64)
    return jax.vjp(fn, q, k, v, s0, z0, decay_gate["gate"])  # the gate's gradient too


def _cotangent(outs):
    keys = jax.random.split(jax.random.PRNGKey(11), len(outs))
    return tuple(
        None if o is None else jax.random.normal(kk, o.shape, o.dtype)
        for kk, o in zip(keys, outs, strict=True)
    )


def _assert_same(got, want):
    """``(outputs, vjp)`` pairs: equal outputs, and for one random cotangent finite
    gradients equal to the reference's (float64, so they may differ only by rounding)."""
    (outs, vjp), (ref_outs, ref_vjp) = got, want
    chex.assert_trees_all_close(outs, ref_outs, **F64)
    ct = _cotangent(outs)
    grads = vjp(ct)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    chex.assert_trees_all_close(grads, ref_vjp(ct), **F64)


# Every case with each pair of values of (normalize, with_state, diagonal) -- an
# orthogonal array of 4 of the 8 combinations, the all-on one among them.
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "normalize, with_state, diagonal",
    [(True, True, True), (True, False, False), (False, True, False), (False, False, True)],
)
def test_backward_matches_plain_autodiff(case, normalize, with_state, diagonal):
    with jax.enable_x64(True):
        kw = dict(normalize=normalize, with_state=with_state, diagonal=diagonal)
        _assert_same(
            _run(chunked.run_chunks, case, "elu", **kw), _run(_plain_chunked, case, "elu", **kw)
        )


@pytest.mark.parametrize("chunk_size", [7, 13, 16])
@pytest.mark.parametrize("with_state", [False, True])
def test_one_or_two_chunks_match_plain_autodiff(chunk_size, with_state):
    """Two chunks (C=7) and one (C=13, and C=16 with padding) run the first chunk apart
    from the loop (``chunking._peeled``), from the input state: same outputs and
    gradients as autodiff of the plain scan."""
    with jax.enable_x64(True):
        kw = dict(normalize=True, with_state=with_state, diagonal=True, chunk_size=chunk_size)
        outs, vjp = _run(chunked.run_chunks, "everything", "elu", **kw)
        ref_outs, ref_vjp = _run(_plain_chunked, "everything", "elu", **kw)
        chex.assert_trees_all_close(outs, ref_outs, **F64)
        ct = _cotangent(outs)
        chex.assert_trees_all_close(vjp(ct), ref_vjp(ct), **F64)


def _zero_fills(jaxpr, shape) -> int:
    """How many arrays of ``shape`` ``jaxpr`` (and the programs inside it) fills with 0."""
    count = 0
    for eqn in jaxpr.eqns:
        operand = eqn.invars[0] if eqn.invars else None
        if (
            eqn.primitive.name == "broadcast_in_dim"
            and eqn.outvars[0].aval.shape == shape
            and isinstance(operand, jex_core.Literal)
            and operand.val == 0
        ):
            count += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jex_core.ClosedJaxpr):
                    count += _zero_fills(sub.jaxpr, shape)
                elif isinstance(sub, jex_core.Jaxpr):
                    count += _zero_fills(sub, shape)
    return count


def test_cotangents_are_written_into_the_kept_buffers():
    """With d == dv the reverse scan writes q's cotangent into d out's buffer and v's into
    the kept output's, each chunk after reading it there: only k's cotangent (and the
    forward's output) starts from zeros, and the gradient still equals the quadratic
    form's."""
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in helpers.qkv(0, B, T, H, D, D))

        def fn(method):
            return functools.partial(la.causal_linear_attention, method=method, chunk_size=C)

        out, vjp = jax.vjp(fn("chunked"), q, k, v)
        ct = _cotangent((out,))[0]
        chex.assert_trees_all_close(vjp(ct), jax.vjp(fn("quadratic"), q, k, v)[1](ct), **F64)
        grad = lambda q, k, v, ct: jax.vjp(fn("chunked"), q, k, v)[1](ct)
        padded = (B, -(-T // C) * C, H, D)
        assert _zero_fills(jax.make_jaxpr(grad)(q, k, v, ct).jaxpr, padded) == 2


@pytest.mark.parametrize("feature_map", ["elu", "taylor"])
@pytest.mark.parametrize("case", ["plain", "everything"])
def test_backward_with_nan_padding(feature_map, case):
    """NaN/inf in padded q, k, v under key_mask reach no output and no gradient."""
    with jax.enable_x64(True):
        kw = dict(normalize=True, with_state=True, diagonal=True, poison=True)
        _assert_same(
            _run(chunked.run_chunks, case, feature_map, **kw),
            _run(_plain_chunked, case, feature_map, **kw),
        )


def _inside_and_outside(case, feature_map, eps, poison, group_tokens=None):
    """(outputs, vjp) pairs of ``chunked`` with the map inside the chunks (raw
    time-major q, k, v) and outside them (``features``, heads first); outputs heads
    first. With ``eps`` the first normalises in its chunks, the second afterwards."""
    (q, k, v), decay_gate, segment_ids, key_mask = _inputs(case, feature_map, poison)
    f = la.feature_maps.feature_dim(feature_map, D, H)
    state = helpers.random_state(7, B, H, f, DV)
    heads_first = lambda x: None if x is None else jnp.swapaxes(x, 1, 2)

    def decays(gate):
        g = checks.log_decay(
            decay_gate["decay"], gate, B, T, H, jnp.float64, channels=f, key_mask=key_mask
        )
        r = None if segment_ids is None else checks.segment_resets(segment_ids, B, T, jnp.float64)
        return g, r

    def inside(q, k, v, s, z, gate):
        g, r = (heads_first(x) for x in decays(gate))  # time-major, as the scan reads them
        live = None if key_mask is None else key_mask[:, :, None, None]
        phi = la.feature_maps.get(feature_map)
        (num, den), (s, z) = chunked.run_chunks(
            q, k, v, g, r, (s, z), C, diagonal=True, time_axis=1, eps=eps, phi=phi, live=live,
            group_tokens=group_tokens,
        )  # fmt: skip
        return heads_first(num), heads_first(den), s, z

    def outside(q, k, v, s, z, gate):
        g, r = decays(gate)
        phi_q, phi_k, v64 = inputs.features(q, k, v, feature_map, key_mask, key_mask)
        kernel = inputs.chunk_kernel(q, k, feature_map, key_mask, g)
        (num, den), (s, z) = chunked.run_chunks(
            phi_q, phi_k, v64, g, r, (s, z), C, diagonal=True, kernel=kernel
        )
        if eps is not None:
            num, den = num / (den[..., None] + eps), None
        return num, den, s, z

    args = (q, k, v, state.s.astype(jnp.float64), state.z.astype(jnp.float64))
    args = args + (decay_gate["gate"],)
    return jax.vjp(inside, *args), jax.vjp(outside, *args)


# Every case with both maps and both (eps, poison) settings; each map meets each setting
# in alternate cases (3 cases per pairing) instead of in all of them.
@pytest.mark.parametrize(
    "case, feature_map, eps, poison",
    [
        (case, feature_map, *setting)
        for i, case in enumerate(CASES)
        for feature_map, setting in zip(
            ["elu", "taylor"], [(None, True), (1e-3, False)][:: 1 if i % 2 else -1], strict=True
        )
    ],
)
def test_features_inside_chunks_match_features_outside(case, feature_map, eps, poison):
    """A registered map applied by each chunk to raw, time-major q, k, v (NaN and inf at
    masked tokens with ``poison``; without a mask the last chunk's padding, where
    elu(0) + 1 = 1, must still count for nothing) equals the features computed
    outside: outputs, final state and every input's gradient, in float64."""
    with jax.enable_x64(True):
        _assert_same(*_inside_and_outside(case, feature_map, eps, poison))


# Groups of chunks (the GPU/TPU layout, forced here): T = 13 is 4 chunks of C = 4, the
# last one partial; 3 chunks a group become 2 groups of 2, 64 tokens one group of all 4.
GROUPS = [3 * C, 64]


# "everything" with both group sizes, per-channel gates and the Taylor kernel with one each
# (every option takes both its values among the four).
@pytest.mark.parametrize(
    "group_tokens, case, feature_map, normalize, with_state, diagonal, poison",
    [
        (GROUPS[0], "everything", "elu", True, True, True, True),
        (GROUPS[1], "everything", "elu", True, True, True, True),
        (GROUPS[0], "per_channel_gate", "elu", False, False, False, False),
        (GROUPS[1], "gate_with_resets", "taylor", True, False, True, True),
    ],
)
def test_groups_of_chunks_match_plain_autodiff(
    group_tokens, case, feature_map, normalize, with_state, diagonal, poison
):
    """Every chunk of a group at once, one state scan between (decays, resets, per-channel
    gates, the Taylor kernel, NaN and inf at masked tokens): the outputs and gradients of
    the one-chunk plain scan."""
    with jax.enable_x64(True):
        kw = dict(normalize=normalize, with_state=with_state, diagonal=diagonal, poison=poison)
        form = functools.partial(chunked.run_chunks, group_tokens=group_tokens)
        _assert_same(
            _run(form, case, feature_map, **kw), _run(_plain_chunked, case, feature_map, **kw)
        )


def test_groups_of_chunks_with_features_inside():
    """Groups of chunks that apply the map themselves to raw time-major inputs and
    normalise (``eps``), NaN and inf at masked tokens: as the features outside."""
    with jax.enable_x64(True):
        _assert_same(*_inside_and_outside("everything", "elu", 1e-3, True, GROUPS[0]))


# ----------------------------------------------------------------------------
# The Taylor kernel inside chunks: 1 + s / sqrt(d) + s^2 / (2d) from s = q.k.
# ----------------------------------------------------------------------------


def _taylor(options, method, chunk_size=C):
    def fn(q, k, v, s, z):
        out, state = la.causal_linear_attention(
            q,
            k,
            v,
            feature_map="taylor",
            method=method,
            chunk_size=chunk_size,
            initial_state=la.LinearAttentionState(s, z),
            return_state=True,
            **options,
        )
        return out, state.s, state.z

    return fn


TAYLOR_OPTIONS = {
    "plain": dict(),
    "gate": dict(gate=helpers.gate(1, B, T, H)),
    "everything": dict(
        decay=jnp.array([0.5, 0.9, 1.0]),
        gate=helpers.gate(2, B, T, H).at[:, 4, 0].set(-jnp.inf),
        segment_ids=helpers.segment_ids(3, B, T, p=0.25),
        key_mask=helpers.key_mask(4, B, T),
    ),
    "unnormalized": dict(normalize=False, key_mask=helpers.key_mask(5, B, T)),
}


# The chunked form with every option; the quadratic form with "everything" (which holds
# "gate" and more) and "unnormalized" ("plain" is in both).
@pytest.mark.parametrize(
    "option, method",
    [(option, "chunked") for option in TAYLOR_OPTIONS]
    + [("everything", "quadratic"), ("unnormalized", "quadratic")],
)
def test_taylor_kernel_matches_features(option, method):
    """The kernel path equals the explicit features (the scan form), outputs and grads."""
    with jax.enable_x64(True):
        opts = {
            key: x.astype(jnp.float64) if hasattr(x, "dtype") and x.dtype == jnp.float32 else x
            for key, x in TAYLOR_OPTIONS[option].items()
        }
        q, k, v = (x.astype(jnp.float64) for x in helpers.qkv(0, B, T, H, D, DV))
        f = la.feature_maps.feature_dim("taylor", D, H)
        state = helpers.random_state(7, B, H, f, DV)
        args = (q, k, v, state.s.astype(jnp.float64), state.z.astype(jnp.float64))
        outs, vjp = jax.vjp(_taylor(opts, method), *args)
        ref_outs, ref_vjp = jax.vjp(_taylor(opts, "scan"), *args)
        chex.assert_trees_all_close(outs, ref_outs, **F64)
        ct = _cotangent(outs)
        chex.assert_trees_all_close(vjp(ct), ref_vjp(ct), **F64)


def test_taylor_kernel_saves_work():
    """The chunked Taylor form takes its scores from q.k, not from the 1 + d + d^2
    features: fewer FLOPs than the same map without its ``kernel_from_dots``."""
    q, k, v = helpers.qkv(0, 1, 256, 2, 16, 16)
    no_kernel = lambda x: la.feature_maps.taylor(x)  # same map, no kernel_from_dots

    def flops(feature_map):
        fn = functools.partial(la.causal_linear_attention, feature_map=feature_map, chunk_size=64)
        return jax.jit(fn).lower(q, k, v).compile().cost_analysis()["flops"]

    assert flops("taylor") < 0.8 * flops(no_kernel)


def test_the_chunks_decays_scale_their_rows_through_scaled():
    """The additive form's decayed queries and keys come from ``chunking.scaled`` (whose
    gradient sums each row as a product, tested in test_delta_rule.py), forward and in
    the hand-written backward's recomputation."""
    q = jnp.ones((1, 40, 2, 8))
    gate = -jnp.ones((1, 40, 2))
    loss = lambda q, k, v, gate: jnp.sum(la.causal_linear_attention(q, k, v, gate=gate))
    program = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, q, q, gate))
    assert "name=_scaled" in program
