"""Issue 29: arguments of the wrong kind, and errors that came from deep inside JAX, raise
one line that names the argument, what it must be and what it got."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

import linattn_jax as la
from linattn_jax import feature_maps, layers, models
from tests import helpers

B, T, H, D = 2, 4, 2, 4
Q, K, V = helpers.qkv(0, B, T, H, D, D)
BETA = jnp.full((B, T, H), 0.5)
STEP = (Q[:, 0], K[:, 0], V[:, 0])
MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))


def _raises(fn, message, error=ValueError):
    """``fn()`` raises ``error`` whose one-line message matches ``message``."""
    with pytest.raises(error) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text, text
    assert re.search(message, text), text
    return text


def _seq_par(**kwargs):
    return la.sequence_parallel_causal_linear_attention(Q, K, V, axis_name="seq", **kwargs)


def _delta_seq_par(**kwargs):
    return la.sequence_parallel_delta_rule(Q, K, V, BETA, axis_name="seq", **kwargs)


def _additive_step(**kwargs):
    state = la.init_state(B, H, D, D)
    return la.causal_linear_attention_step(*STEP, state, **kwargs)


def _delta_step(**kwargs):
    return la.delta_rule_step(*STEP, BETA[:, 0], la.init_delta_state(B, H, D, D), **kwargs)


ENTRY_POINTS = {
    "linear_attention": lambda **kw: la.linear_attention(Q, K, V, **kw),
    "causal_linear_attention": lambda **kw: la.causal_linear_attention(Q, K, V, **kw),
    "causal_linear_attention_step": _additive_step,
    "sequence_parallel_causal_linear_attention": lambda **kw: _seq_par(mesh=MESH, **kw),
    "delta_rule": lambda **kw: la.delta_rule(Q, K, V, BETA, **kw),
    "delta_rule_step": _delta_step,
    "sequence_parallel_delta_rule": lambda **kw: _delta_seq_par(mesh=MESH, **kw),
}
NORMALIZE = ["linear_attention", "causal_linear_attention", "causal_linear_attention_step"]
NORMALIZE += ["sequence_parallel_causal_linear_attention"]
RETURN_STATE = ["causal_linear_attention", "sequence_parallel_causal_linear_attention"]
RETURN_STATE += ["delta_rule", "sequence_parallel_delta_rule"]
DECAY = [name for name in ENTRY_POINTS if name != "linear_attention"]

# -- item 4: arguments of the wrong kind -----------------------------------------


@pytest.mark.parametrize("fn", NORMALIZE)
@pytest.mark.parametrize("bad", ["no", None, 1])
def test_normalize_must_be_a_bool(fn, bad):
    _raises(
        lambda: ENTRY_POINTS[fn](normalize=bad),
        rf"^normalize must be True or False, got {re.escape(repr(bad))}$",
    )


@pytest.mark.parametrize("fn", RETURN_STATE)
def test_return_state_must_be_a_bool(fn):
    _raises(
        lambda: ENTRY_POINTS[fn](return_state="yes"),
        r"^return_state must be True or False, got 'yes'$",
    )


@pytest.mark.parametrize("fn", NORMALIZE)
@pytest.mark.parametrize("bad", [None, "1e-6", -1.0, float("nan")])
def test_eps_must_be_a_number_at_least_0(fn, bad):
    _raises(
        lambda: ENTRY_POINTS[fn](eps=bad),
        rf"^eps must be a finite number >= 0, got {re.escape(repr(bad))}$",
    )


@pytest.mark.parametrize("fn", DECAY)
@pytest.mark.parametrize("bad", [True, "0.9", ["a"]])
def test_decay_must_be_numbers(fn, bad):
    _raises(
        lambda: ENTRY_POINTS[fn](decay=bad),
        r"^decay must be None, a number in \(0, 1\] or one per head \[heads\], got "
        + re.escape(repr(bad)),
    )


@pytest.mark.parametrize("fn", ["delta_rule", "delta_rule_step", "sequence_parallel_delta_rule"])
def test_scale_must_be_a_number(fn):
    _raises(lambda: ENTRY_POINTS[fn](scale=None), r"^scale must be a finite number, got None$")


@pytest.mark.parametrize("step", ["causal_linear_attention_step", "delta_rule_step"])
def test_a_step_without_a_state_names_it(step):
    args = (*STEP, None) if step == "causal_linear_attention_step" else (*STEP, BETA[:, 0], None)
    _raises(lambda: getattr(la, step)(*args), r"^state must be the State .* got None$")


def test_layer_options_of_the_wrong_kind_raise_at_construction():
    build = lambda **kw: layers.LinearAttention(8, 2, rngs=nnx.Rngs(0), **kw)
    _raises(lambda: build(normalize="no"), r"^normalize must be True or False, got 'no'$")
    _raises(lambda: build(causal="yes"), r"^causal must be True or False, got 'yes'$")
    _raises(lambda: build(eps=None), r"^eps must be a finite number >= 0, got None$")


# -- item 5: errors from deep inside JAX -----------------------------------------


def test_a_feature_map_of_the_wrong_kind_is_named():
    expected = r"^feature_map must be one of \(.*\) or a callable, got \['elu'\]$"
    _raises(lambda: layers.LinearAttention(8, 2, feature_map=["elu"], rngs=nnx.Rngs(0)), expected)
    _raises(lambda: la.causal_linear_attention(Q, K, V, feature_map=["elu"]), expected)
    # An array is described by its dtype and shape, not printed.
    text = _raises(
        lambda: la.causal_linear_attention(Q, K, V, feature_map=jnp.ones((64, 64))),
        r"or a callable, got an array float32\[64, 64\]$",
    )
    assert len(text) < 300, text


@pytest.mark.parametrize("method", la.METHODS)
def test_a_feature_map_that_returns_no_array_is_named(method):
    _raises(
        lambda: la.causal_linear_attention(Q, K, V, feature_map=lambda x: 1.0, method=method),
        r"^feature_map must map \[\.\.\., d\] to an array \[\.\.\., f\], got 1\.0 for inputs "
        r"\(2, 4, 2, 4\)$",
    )


def test_feature_maps_feature_dim_names_a_bad_map():
    _raises(
        lambda: feature_maps.feature_dim(lambda x: jnp.sum(x), D, H),
        r"^feature_map must map \[\.\.\., d\] to an array \[\.\.\., f\], got an array float32\[\] "
        r"for inputs \(1, 2, 4\)$",
    )


def test_a_string_decay_is_named_not_a_jax_type_error():
    for fn in (la.causal_linear_attention, lambda *a, **kw: la.delta_rule(*a, BETA, **kw)):
        _raises(lambda fn=fn: fn(Q, K, V, decay="0.9"), r"^decay must be None, .* got '0\.9'$")


@pytest.mark.parametrize("fn", ["causal_linear_attention", "linear_attention", "delta_rule"])
def test_q_and_k_of_different_dtypes_are_named(fn):
    with jax.enable_x64(True):
        q, k = Q.astype(jnp.float16), K.astype(jnp.float64)
        args = (q, k, V, BETA) if fn == "delta_rule" else (q, k, V)
        _raises(
            lambda: getattr(la, fn)(*args),
            r"^q and k must have the same dtype, got q float16 and k float64$",
        )


def test_a_step_with_q_and_k_of_different_dtypes_is_named():
    q, k, v = STEP
    _raises(
        lambda: la.delta_rule_step(q.astype(jnp.bfloat16), k, v, BETA[:, 0], None),
        r"^q and k must have the same dtype, got q bfloat16 and k float32$",
    )


@pytest.mark.parametrize("fn", [_seq_par, _delta_seq_par])
def test_sequence_parallel_mesh_errors_come_before_shard_map(fn):
    _raises(
        lambda: fn(batch_axis="seq", mesh=MESH),
        r"^batch_axis='seq' must differ from axis_name='seq' \(the axis that splits the "
        r"sequence\)$",
    )
    # Two devices along the batch: checked before tracing, so an abstract mesh shows it.
    mesh = AbstractMesh((2, 1), ("data", "seq"))
    q, k, v = helpers.qkv(1, 3, T, H, D, D)
    beta = jnp.full((3, T, H), 0.5)
    call = (
        (lambda: la.sequence_parallel_causal_linear_attention(q, k, v, **kw))
        if fn is _seq_par
        else (lambda: la.sequence_parallel_delta_rule(q, k, v, beta, **kw))
    )
    kw = dict(axis_name="seq", batch_axis="data", mesh=mesh)
    _raises(call, r"^batch b=3 must be divisible by the 2 devices of batch_axis 'data'$")


def _model():
    return models.LanguageModel(16, 8, 2, 2, rngs=nnx.Rngs(0))


PROMPT = jnp.zeros((B, 3), jnp.int32)


def test_generate_pad_id_out_of_int32_is_named():
    _raises(
        lambda: _model().generate(PROMPT, 2, pad_id=2**40, temperature=0.0),
        r"^pad_id must be an int in \[-2147483648, 2147483647\] \(int32\), got 1099511627776$",
    )


@pytest.mark.parametrize("bad", [0, "key", jnp.zeros((3,), jnp.float32)])
def test_generate_rng_must_be_a_prng_key(bad):
    _raises(
        lambda: _model().generate(PROMPT, 2, rng=bad),
        r"^rng must be a PRNG key \(jax\.random\.key\(seed\) or jax\.random\.PRNGKey\(seed\)\), "
        r"got ",
    )


def test_generate_takes_both_kinds_of_key():
    model = _model()
    for rng in (jax.random.PRNGKey(0), jax.random.key(0)):
        assert model.generate(PROMPT, 2, rng).shape == (B, 5)


def test_a_language_models_state_of_another_batch_or_depth_is_named():
    model = _model()
    _raises(
        lambda: model(PROMPT, state=model.init_state(3)),
        r"^state must be model\.init_state\(2\)'s \(one state per block for a batch of 2\), "
        r"got state\[0\] for a batch of 3$",
    )
    _raises(
        lambda: model(PROMPT, state=model.init_state(B)[:1]),
        r"^state must be model\.init_state\(2\)'s \(one state per block: 2\), got a list of 1$",
    )
    _raises(
        lambda: model(PROMPT, state=model.init_state(B)[0]),
        r"^state must be model\.init_state\(2\)'s \(one state per block: 2\), got a BlockState",
    )


# -- item 6: messages that read badly --------------------------------------------


@pytest.mark.parametrize("fn", ["delta_rule", "delta_rule_step"])
def test_a_nan_beta_is_said_to_hold_nan(fn):
    beta = BETA.at[0, 1, 0].set(jnp.nan)
    call = (
        (lambda: la.delta_rule(Q, K, V, beta))
        if fn == "delta_rule"
        else (lambda: la.delta_rule_step(*STEP, beta[:, 1], la.init_delta_state(B, H, D, D)))
    )
    _raises(call, r"^beta must lie in \[0, 2\], got NaN in 1 of \d+ values$")


def test_the_random_fourier_refusal_does_not_print_the_projection():
    phi = feature_maps.random_fourier(jax.random.PRNGKey(0), D, 64)
    for fn in (la.causal_linear_attention, la.linear_attention):
        text = _raises(
            lambda fn=fn: fn(Q, K, V, feature_map=phi),
            r"^feature_map RandomFourier has a signed kernel",
        )
        assert "Array" not in text and len(text) < 400, text
