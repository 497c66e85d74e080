"""No silent wrong answers at the edges: extreme gates, beta near 2, non-finite inputs.

Every chunked form is checked against the per-token forms (the ``"scan"`` method and the
float64 loops of ``tests/reference_recurrent.py``), which meet none of these problems.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linattn_jax as la
from tests import helpers
from tests.reference_recurrent import delta_rule_reference

B, T, H, D, C = 1, 24, 2, 4, 8


def _unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _gates(position: int, value: float, channels: int | None = None):
    """Mild log-decays ``[B, T, H(, channels)]`` with ``value`` at token ``position``."""
    shape = (B, T, H) if channels is None else (B, T, H, channels)
    g = -0.3 * jax.random.uniform(jax.random.PRNGKey(3), shape, jnp.float32)
    return g.at[:, position].set(value)


EXTREME_GATES = [-1e3, -1e10, -1e30, -jnp.inf]
POSITIONS = [0, 5, 15]  # a chunk's first token, one inside, its last


def _gate_cases(shift: int):
    """(value, position): -inf at every position, each finite value at one, rotated by
    ``shift`` (so that over shifts 0, 1, 2 every value meets every position)."""
    return [
        (value, position)
        for i, value in enumerate(EXTREME_GATES)
        for j, position in enumerate(POSITIONS)
        if value == -jnp.inf or j == (i + shift) % len(POSITIONS)
    ]


# Each (method, per_channel) with -inf everywhere and each finite value at a rotating
# position: over the four, every (value, position) pair occurs.
@pytest.mark.parametrize(
    "method, per_channel, value, position",
    [
        (method, per_channel, *vp)
        for shift, (method, per_channel) in enumerate(
            [("chunked", False), ("chunked", True), ("quadratic", False), ("quadratic", True)]
        )
        for vp in _gate_cases(shift)
    ],
)
def test_additive_forms_equal_the_scan_for_any_gate(method, per_channel, value, position):
    q, k, v = helpers.qkv(0, B, T, H, D, D)
    gate = _gates(position, value, D if per_channel else None)
    run = lambda m: la.causal_linear_attention(
        q, k, v, gate=gate, method=m, chunk_size=C, return_state=True
    )
    (out, state), (ref, ref_state) = run(method), run("scan")
    chex.assert_trees_all_close(out, ref, **helpers.tol(jnp.float32))
    chex.assert_trees_all_close(state, ref_state, **helpers.tol(jnp.float32))


# Per head and per channel: -inf at every position, each finite value at one position
# (a different one in each mode, so two of the three).
@pytest.mark.parametrize(
    "per_channel, value, position",
    [(per_channel, *vp) for per_channel in (False, True) for vp in _gate_cases(int(per_channel))],
)
def test_delta_rule_chunked_equals_the_float64_loop_for_any_gate(per_channel, value, position):
    q, k, v = helpers.qkv(1, B, T, H, D, D)
    k = _unit(k)
    beta = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(4), (B, T, H)))
    gate = _gates(position, value, D if per_channel else None)
    out = la.delta_rule(q, k, v, beta, gate=gate, chunk_size=C)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x), jnp.float64)
        ref, _ = delta_rule_reference(f64(q), f64(k), f64(v), f64(beta), gate=f64(gate))
    chex.assert_trees_all_close(out, np.asarray(ref, np.float32), **helpers.tol(jnp.float32))


@pytest.mark.parametrize("beta_value", [1.0, 1.5, 1.9, 2.0])
@pytest.mark.parametrize("keys", ["repeated", "near_parallel"])
def test_delta_rule_chunked_equals_the_scan_with_beta_up_to_2_and_aligned_keys(beta_value, keys):
    """With beta = 2 and one key repeated, ``I - beta k k^T`` is a reflection: the chunk's
    triangular system has entries of +-2 all the way down, where a series solve cancels."""
    t, d = 64, 1 if keys == "repeated" else 4
    q, k, v = helpers.qkv(5, 1, t, 1, d, 3)
    if keys == "repeated":
        k = jnp.ones_like(k)
    else:
        k = _unit(jnp.ones_like(k) + 1e-3 * k)
    beta = jnp.full((1, t, 1), beta_value)
    out, state = la.delta_rule(q, k, v, beta, chunk_size=64, return_state=True)
    ref, ref_state = la.delta_rule(q, k, v, beta, method="scan", return_state=True)
    scale = float(jnp.max(jnp.abs(ref))) + 1.0
    np.testing.assert_allclose(out, ref, atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(state.s, ref_state.s, atol=1e-5 * scale, rtol=0)


def _poisoned(x, position, value):
    return x.at[:, position, 0, 0].set(value)


# Every family with NaN and inf, in k and in v; each (input, value) pair in two families.
@pytest.mark.parametrize(
    "family, which, value",
    [
        (family, *wv)
        for i, family in enumerate(["additive", "gated_additive", "delta", "kda"])
        for wv in (
            [("k", jnp.nan), ("v", jnp.inf)] if i % 2 == 0 else [("k", jnp.inf), ("v", jnp.nan)]
        )
    ],
)
def test_a_non_finite_input_reaches_no_earlier_output(family, which, value):
    """Causal means causal: a NaN or inf at token 13 (chunk 1, not its first token) leaves
    outputs 0..12 as they are without it, and makes the later ones non-finite."""
    pos = 13
    q, k, v = helpers.qkv(7, B, T, H, D, D)
    k = _unit(k)
    beta = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(8), (B, T, H)))
    inputs = dict(k=k, v=v)
    inputs[which] = _poisoned(inputs[which], pos, value)

    def run(k, v, method="chunked"):
        if family == "additive":
            return la.causal_linear_attention(q, k, v, method=method, chunk_size=C)
        if family == "gated_additive":
            gate = _gates(2, -0.5, D)
            return la.causal_linear_attention(q, k, v, gate=gate, method=method, chunk_size=C)
        gate = _gates(2, -0.5, D if family == "kda" else None)
        return la.delta_rule(q, k, v, beta, gate=gate, method=method, chunk_size=C)

    out, clean = run(**inputs), run(k, v)
    chex.assert_trees_all_close(out[:, :pos], clean[:, :pos], **helpers.tol(jnp.float32))
    assert not bool(jnp.all(jnp.isfinite(out[:, pos:])))
    scan = run(**inputs, method="scan")  # the reference recurrence agrees on what is finite
    np.testing.assert_array_equal(jnp.isfinite(out), jnp.isfinite(scan))


def test_a_positive_gate_at_a_padded_token_is_not_validated():
    """Padding may hold anything: a masked token's gate (like its beta) is never checked."""
    q, k, v = helpers.qkv(9, B, T, H, D, D)
    mask = jnp.ones((B, T), bool).at[:, 3].set(False)
    gate = _gates(3, 5.0)  # positive, but at a padded token
    out = la.causal_linear_attention(q, k, v, gate=gate, key_mask=mask, chunk_size=C)
    ref = la.causal_linear_attention(
        q, k, v, gate=gate.at[:, 3].set(0.0), key_mask=mask, chunk_size=C
    )
    chex.assert_trees_all_close(out, ref)
    beta = jnp.full((B, T, H), 0.5)
    out = la.delta_rule(_unit(q), _unit(k), v, beta, gate=gate, key_mask=mask, chunk_size=C)
    assert bool(jnp.all(jnp.isfinite(out)))
    with pytest.raises(ValueError, match=r"gate must be log-decays <= 0, got a maximum of 5"):
        la.causal_linear_attention(q, k, v, gate=gate, chunk_size=C)


# ----------------------------------------------------------------------------
# Layers and models: packed segments, padding, sampling.
# ----------------------------------------------------------------------------

from flax import nnx  # noqa: E402

from linattn_jax import layers, models  # noqa: E402

VOCAB, WIDTH = 11, 8


def _lm(attention: str, **kw):
    return models.LanguageModel(
        VOCAB, WIDTH, 1, 2, attention=attention, short_conv=4, rngs=nnx.Rngs(0), **kw
    )


@pytest.mark.parametrize("attention", ["linear", "deltanet"])
def test_the_blocks_short_convolution_does_not_cross_packed_segments(attention):
    model = _lm(attention)
    first = jax.random.randint(jax.random.PRNGKey(0), (1, 7), 0, VOCAB)
    second = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, VOCAB)
    packed = jnp.concatenate([first, second], axis=1)
    segment_ids = jnp.array([[0] * 7 + [1] * 6], jnp.int32)
    # Jitted (eager, the model ran op by op, most of the test's time).
    forward = nnx.jit(lambda model, tokens, segment_ids: model(tokens, segment_ids=segment_ids))
    logits = forward(model, packed, segment_ids)
    alone = jnp.concatenate([forward(model, first, None), forward(model, second, None)], axis=1)
    chex.assert_trees_all_close(logits, alone, **helpers.tol(jnp.float32))


def test_right_padding_leaves_the_delta_layers_cache_its_last_real_inputs():
    layer = layers.DeltaRuleAttention(WIDTH, 2, variant="gated_deltanet", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 9, WIDTH))
    real, pad = x[:, :6], jnp.full((1, 3, WIDTH), jnp.nan)
    mask = jnp.array([[True] * 6 + [False] * 3])
    _, cache = helpers.call(
        layer,
        jnp.concatenate([real, pad], 1),
        key_mask=mask,
        state=layer.init_state(1),
        return_state=True,
    )
    _, ref_cache = helpers.call(layer, real, state=layer.init_state(1), return_state=True)
    chex.assert_trees_all_close(cache, ref_cache, **helpers.tol(jnp.float32))
    token = x[:, 6:7]
    y, _ = helpers.call(layer, token, state=cache, return_state=True)
    y_ref, _ = helpers.call(layer, token, state=ref_cache, return_state=True)
    chex.assert_trees_all_close(y, y_ref, **helpers.tol(jnp.float32))


# The layers with a short convolution, each as a decoder continues a batch's second turn.
SHORT_CONV_LAYERS = {
    "mamba2": lambda: layers.Mamba2Mixer(WIDTH, 2, state_dim=4, rngs=nnx.Rngs(0)),
    "gated_deltanet": lambda: layers.DeltaRuleAttention(WIDTH, 2, rngs=nnx.Rngs(0)),
    "block": lambda: layers.TransformerBlock(WIDTH, 2, short_conv=4, rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("kind", sorted(SHORT_CONV_LAYERS))
def test_a_left_padded_chunk_after_a_state_keeps_the_states_inputs_in_the_window(kind):
    """#53 item 3: the padding of a left-padded second chunk is skipped by the short
    convolution (its first real tokens see the first chunk's last inputs, from the state),
    so the row equals its lone run, outputs and state."""
    layer = SHORT_CONV_LAYERS[kind]()
    x = jax.random.normal(jax.random.PRNGKey(5), (1, 7, WIDTH))
    first, second = x[:, :5], x[:, 5:]
    _, state = helpers.call(layer, first, state=layer.init_state(1), return_state=True)
    alone, alone_state = helpers.call(layer, second, state=state, return_state=True)
    padded = jnp.concatenate([jnp.full((1, 3, WIDTH), jnp.nan), second], axis=1)
    mask = jnp.array([[False] * 3 + [True] * 2])
    out, out_state = helpers.call(layer, padded, key_mask=mask, state=state, return_state=True)
    chex.assert_trees_all_close(out[:, 3:], alone, **helpers.tol(jnp.float32))
    chex.assert_trees_all_close(out_state, alone_state, **helpers.tol(jnp.float32))


def test_the_classifier_checks_its_ids_and_pools_by_selection():
    model = models.SequenceClassifier(VOCAB, 3, WIDTH, 1, 2, rngs=nnx.Rngs(0))
    tokens = jnp.array([[1, 2, 3, VOCAB]], jnp.int32)
    mask = jnp.array([[True, True, True, False]])
    with pytest.raises(ValueError, match=rf"tokens: token ids must lie in \[0, {VOCAB}\)"):
        model(tokens, key_mask=mask)
    padded = helpers.call(model, tokens.at[0, 3].set(0), key_mask=mask)
    assert bool(jnp.all(jnp.isfinite(padded)))
    chex.assert_trees_all_close(
        padded, helpers.call(model, tokens[:, :3]), **helpers.tol(jnp.float32)
    )


def test_a_tiny_temperature_samples_greedily():
    model = _lm("linear")
    prompt = jnp.array([[1, 2, 3]], jnp.int32)
    greedy = model.generate(prompt, 5, temperature=0.0)
    tiny = model.generate(prompt, 5, jax.random.PRNGKey(0), temperature=1e-40)
    np.testing.assert_array_equal(tiny, greedy)


def test_a_prompt_mask_with_a_hole_is_refused():
    model = _lm("linear")
    prompt = jnp.array([[1, 2, 3, 4], [1, 2, 3, 4]], jnp.int32)
    mask = jnp.array([[True, True, False, True], [False, True, True, True]])
    with pytest.raises(ValueError, match=r"prompt_mask must mark left padding only .* rows \[0\]"):
        model.generate(prompt, 2, temperature=0.0, prompt_mask=mask)


def test_the_sequence_parallel_delta_rule_checks_as_the_delta_rule_does():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
    q, k, v = helpers.qkv(11, B, T, H, D, D)
    beta = jnp.full((B, T, H), 0.5)
    run = lambda beta, **kw: la.sequence_parallel_delta_rule(
        q, _unit(k), v, beta, axis_name="seq", mesh=mesh, **kw
    )
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
        run(beta.at[0, 3, 1].set(3.0))
    with pytest.raises(
        ValueError, match=r"state must be a DeltaRuleState .* got LinearAttentionState"
    ):
        run(beta, initial_state=la.init_state(B, H, D, D))
    with pytest.raises(
        ValueError, match=r"state.s must have shape \[batch, heads, key_dim, value_dim\]"
    ):
        run(beta, initial_state=la.init_delta_state(B + 1, H, D, D))
    chex.assert_trees_all_close(
        run(beta), la.delta_rule(q, _unit(k), v, beta), **helpers.tol(jnp.float32)
    )
