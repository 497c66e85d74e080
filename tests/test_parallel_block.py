"""A parallel hybrid block (``TransformerBlock(parallel=...)``: two mixers on the same
normalised input, Falcon-H1's attention beside Mamba-2) and the multipliers around its
branches and its residual adds: against the sum written out here from the block's own
layers, decoding against the full forward, left padding, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import layers, models
from tests import helpers

PARALLEL = {"attention": "mamba2", "num_heads": 2, "state_dim": 4, "n_groups": 1}
MULTIPLIERS = ((0.7, 1.3), (2.1, 0.4))


def _rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w[None, None]


def test_the_block_is_the_sum_of_its_branches():
    block = layers.TransformerBlock(
        16, 2, attention="softmax", mlp="swiglu", mlp_hidden=24, parallel=PARALLEL,
        branch_multipliers=MULTIPLIERS, residual_multiplier=0.5, rngs=nnx.Rngs(0),
    )  # fmt: skip
    for norm in (block.attention_norm, block.mlp_norm):  # random norms: a swapped one shows
        norm.scale.set_value(1 + 0.3 * jax.random.normal(jax.random.key(1), (16,)))
    x = jax.random.normal(jax.random.key(2), (2, 7, 16))
    (in_1, out_1), (in_2, out_2) = MULTIPLIERS

    def written_out(block, x):
        h = _rms(x, block.attention_norm.scale[...])
        mixed = out_1 * block.attention(in_1 * h) + out_2 * block.parallel(in_2 * h)
        y = x + 0.5 * mixed
        return y + 0.5 * block.mlp(_rms(y, block.mlp_norm.scale[...]))

    ours, expected = nnx.jit(lambda b, x: (b(x), written_out(b, x)))(block, x)
    helpers.assert_close_normwise(ours, expected)


@pytest.fixture(scope="module")
def model():
    return models.LanguageModel(
        50, 16, 2, 2, attention="softmax", mlp="swiglu", embedding_multiplier=2.0,
        logits_scaling=1.5, residual_multiplier=0.8,
        kind_options={"softmax": dict(parallel=PARALLEL, branch_multipliers=MULTIPLIERS,
                                      rope=True, scale=0.3)},
        rngs=nnx.Rngs(3),
    )  # fmt: skip


@pytest.mark.slow  # compiles a prefill, a decoding step and a masked forward
def test_decoding_and_left_padding_equal_the_full_forward(model):
    tokens = jax.random.randint(jax.random.key(4), (2, 9), 0, 50)
    forward = nnx.jit(lambda m, t, mask: m(t, key_mask=mask))
    full = forward(model, tokens, None)
    step = nnx.jit(lambda m, t, s: m(t, state=s, return_state=True))
    logits, state = step(model, tokens[:, :6], model.init_state(2))
    assert state[0].parallel is not None  # the Mamba-2 branch's own state
    outs = [logits]
    for i in range(6, 9):
        logits, state = step(model, tokens[:, i : i + 1], state)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)
    mask = jnp.array([[False] * 3 + [True] * 6, [True] * 9])
    out = forward(model, tokens.at[0, 3:].set(tokens[0, :6]), mask)
    np.testing.assert_allclose(out[0, 3:], full[0, :6], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(parallel={"kind": "mamba2"}), r"parallel must be None or a dict with 'attention'"),
        (dict(parallel={"attention": "mlp"}), r"parallel's attention must be a mixer kind"),
        (dict(parallel=PARALLEL, short_conv=4), r"parallel needs a block with a mixer and no"),
        (dict(branch_multipliers=(1.0, 2.0)), r"branch_multipliers must be \(\(in, out\)"),
        (dict(branch_multipliers=((1, 0), (1, 1))), r"branch_multipliers\[0\]\[1\] must be a"),
        (dict(residual_multiplier=float("nan")), r"residual_multiplier must be a finite number"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        layers.TransformerBlock(16, 2, attention="softmax", rngs=nnx.Rngs(0), **options)
