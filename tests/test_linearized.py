"""``layers.LinearizedAttention``: a softmax layer's parameters with a learned linear core.

A window as long as the sequence is the softmax layer exactly (GQA, RoPE, QK-norm and the
output gate reused); the fast forms (chunked, and the windowed form's delayed chunked part
plus banded window) equal the quadratic weights of ``attention_weights`` times v; decoding
equals the full sequence; a left-padded row equals itself alone; bad options are named.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from linattn_jax import layers
from linattn_jax.layers.linearized import LinearizedAttention
from tests import helpers

WIDTH, HEADS, T = 16, 4, 11
SOFTMAX = dict(num_kv_heads=2, head_dim=6, rope=True, qk_norm=True, output_gate=True)


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.PRNGKey(0), (2, T, WIDTH))


def _pair(rope_scaling=None, **options):
    """A random softmax layer and a linearised one holding its parameters."""
    rope = dict(SOFTMAX, rope_scaling=rope_scaling)
    teacher = layers.SoftmaxAttention(WIDTH, HEADS, rngs=nnx.Rngs(0), **rope)
    student = LinearizedAttention(WIDTH, HEADS, rngs=nnx.Rngs(1), **rope, **options)
    nnx.update(student, nnx.state(teacher))
    return teacher, student


def _through_weights(layer, x, weights):
    """The layer's output with attention ``weights [b, h, t, t]`` (its own projections)."""
    _, _, _, v, gate, _ = layer.heads(x)
    out = jnp.einsum("bhts,bshd->bthd", weights, v) * jax.nn.sigmoid(gate)
    return layer.out_proj(out.reshape(*x.shape[:2], -1))


# A scaled RoPE (Llama 3's teachers) is the teacher's: the student rotates as it does.
@pytest.mark.parametrize(
    "window, scaling", [(T, None), (T + 5, dict(rope_type="linear", factor=4.0))]
)
def test_a_window_over_the_whole_sequence_is_the_softmax_layer(x, window, scaling):
    teacher, student = _pair(window=window, rope_scaling=scaling)
    helpers.assert_close_normwise(helpers.call(student, x), helpers.call(teacher, x), 1e-5)


@pytest.mark.parametrize(
    "options", [dict(chunk_size=4), dict(window=3, chunk_size=4), dict(feature_map="t2r")]
)
def test_fast_forms_equal_the_quadratic_weights(x, options):
    teacher, student = _pair(**options)
    softmax_weights, weights = student.attention_weights(x)
    helpers.assert_close_normwise(student(x), _through_weights(student, x, weights), 1e-5)
    helpers.assert_close_normwise(teacher(x), _through_weights(student, x, softmax_weights), 1e-5)
    if "feature_map" not in options:  # Hedgehog's kernel is positive: every row sums to 1
        helpers.assert_close_normwise(jnp.sum(weights, -1), jnp.ones((2, HEADS, T)), 1e-6)


def test_decoding_and_left_padding(x):
    _, student = _pair(chunk_size=4, gate="channel")
    y, state = helpers.call(student, x[:, :8], state=student.init_state(2), return_state=True)
    steps = [y]
    for i in range(8, T):
        y, state = helpers.call(student, x[:, i : i + 1], state=state, return_state=True)
        steps.append(y)
    helpers.assert_close_normwise(jnp.concatenate(steps, axis=1), helpers.call(student, x), 1e-5)
    mask = jnp.arange(T)[None] >= jnp.array([[0], [3]])
    for window in (None, 4):
        _, student = _pair(window=window)
        padded, alone = helpers.call(student, x, key_mask=mask), helpers.call(student, x[1:, 3:])
        helpers.assert_close_normwise(padded[1, 3:], alone[0], 1e-5)


def test_bad_options_are_named(x):
    for options, message in [
        (dict(sliding_window=4), r"takes no \['sliding_window'\]"),
        (dict(decay=0.9), r"takes no \['decay'\]"),
        (dict(window=4, gate="head"), "a window takes no gate"),
        (dict(feature_map="identity"), "non-negative kernel, got 'identity'"),
        (dict(feature_map="nope"), "feature_map must be one of"),
        (dict(window=0), "window must be"),
        (dict(gate="both"), "gate must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            LinearizedAttention(WIDTH, HEADS, rngs=nnx.Rngs(0), **options)
    _, student = _pair(window=4)
    with pytest.raises(ValueError, match="takes no segment_ids, state or return_state"):
        student(x, return_state=True)
