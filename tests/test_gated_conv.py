"""``GatedShortConv`` (LFM2's gated short convolution, the ``"gated_conv"`` kind) against a
float64 per-token loop written here, with random biases: the output; a prefill then
one-token steps from the returned state; a row with padding inside == the row without it;
packed segments == each segment alone; the gradient; and its options checked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import layers
from tests import helpers

WIDTH, SIZE = 6, 3


def _layer() -> layers.GatedShortConv:
    layer = layers.GatedShortConv(WIDTH, 2, conv_size=SIZE, use_bias=True, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    layer.in_proj.bias[...] = jax.random.normal(keys[0], (3 * WIDTH,))
    layer.out_proj.bias[...] = jax.random.normal(keys[1], (WIDTH,))
    layer.conv_bias[...] = jax.random.normal(keys[2], (WIDTH,))
    layer.conv.kernel[...] = jax.random.normal(keys[3], (SIZE, WIDTH))
    return layer


def _reference(layer, x: np.ndarray) -> np.ndarray:
    """``layer``'s output of one row ``x [t, width]``, a per-token float64 loop."""
    p = lambda v: np.asarray(v[...], np.float64)
    w_in, b_in, w_out, b_out = (
        p(layer.in_proj.kernel),
        p(layer.in_proj.bias),
        p(layer.out_proj.kernel),
        p(layer.out_proj.bias),
    )
    kernel, bias = p(layer.conv.kernel), p(layer.conv_bias)
    past = [np.zeros(WIDTH)] * (SIZE - 1)  # the last size - 1 inputs B * h
    out = []
    for token in np.asarray(x, np.float64):
        gate_in, gate_out, h = np.split(token @ w_in + b_in, 3)
        past.append(gate_in * h)
        y = sum(kernel[i] * past[-SIZE + i] for i in range(SIZE)) + bias
        out.append((gate_out * y) @ w_out + b_out)
    return np.stack(out)


@pytest.fixture(scope="module")
def layer():
    return _layer()


# Compiled once per shape (eager calls run op by op, slowly).
call = nnx.jit(
    lambda layer, x, mask=None, ids=None, state=None: layer(
        x, key_mask=mask, segment_ids=ids, state=state, return_state=True
    )
)


def _x(b: int, t: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (b, t, WIDTH))


def test_output_and_decoding_steps_match_the_loop(layer):
    x = _x(2, 9)
    expected = np.stack([_reference(layer, row) for row in x])
    helpers.assert_close_normwise(call(layer, x)[0], expected, 1e-5)
    y, state = call(layer, x[:, :5], state=layer.init_state(2))
    steps = [y]
    for i in range(5, 9):
        y, state = call(layer, x[:, i : i + 1], state=state)
        steps.append(y)
    helpers.assert_close_normwise(jnp.concatenate(steps, 1), expected, 1e-5)


def test_padding_is_skipped_and_segments_do_not_mix(layer):
    x = _x(1, 10, seed=2)
    real = np.array([[False, True, True, False, False, True, True, True, False, True]])
    y, state = call(layer, x.at[0, ~real[0]].set(jnp.nan), jnp.asarray(real))
    alone, alone_state = call(layer, x[:, real[0]])
    helpers.assert_close_normwise(y[:, real[0]], alone, 1e-6)
    helpers.assert_close_normwise(state, alone_state, 1e-6)
    assert np.all(np.isfinite(y))
    ids = jnp.array([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    packed = call(layer, x, None, ids)[0]
    for lo, hi in [(0, 4), (4, 7), (7, 10)]:
        helpers.assert_close_normwise(packed[:, lo:hi], call(layer, x[:, lo:hi])[0], 1e-6)


def test_gradient_of_a_padded_row_is_the_row_alone(layer):
    """The gradient through a left-padded row equals the one through the row alone."""
    x = _x(1, 7, seed=3)
    mask = jnp.array([[False, False, True, True, True, True, True]])
    padded = lambda x: jnp.sum(jnp.sin(layer(x, key_mask=mask)[:, 2:]))
    alone = lambda x: jnp.sum(jnp.sin(layer(x[:, 2:])))
    g_padded, g_alone = jax.jit(jax.grad(padded))(x), jax.jit(jax.grad(alone))(x)
    helpers.assert_close_normwise(g_padded[:, 2:], g_alone[:, 2:])
    np.testing.assert_array_equal(g_padded[:, :2], 0.0)


def test_options_are_checked():
    for options, message in [
        (dict(conv_size=0), r"conv_size must be an int >= 1, got 0"),
        (dict(use_bias=1), r"use_bias must be True or False"),
        (dict(causal=False), r"causal must be True, got False"),
    ]:
        with pytest.raises(ValueError, match=message):
            layers.GatedShortConv(WIDTH, 2, rngs=nnx.Rngs(0), **options)
    with pytest.raises(ValueError, match=r"x must have shape \[batch, length, 6\]"):
        _layer()(jnp.zeros((1, 2, 5)))
