"""LanguageModel.generate: compiled prefill + decode loop, sampling options, padded batches."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

from linattn_jax import layers, models

V, W, H, B = 37, 16, 4, 3
KINDS = {
    "elu": dict(attention="linear", feature_map="elu"),
    "cosformer": dict(attention="linear", feature_map="cosformer", max_length=64),
    "decay_gate": dict(
        attention="linear", feature_map="elu", decay="retnet", gate=True, normalize=False
    ),
    "hedgehog_conv": dict(attention="linear", feature_map="hedgehog", short_conv=3),
    "softmax": dict(attention="softmax", max_length=64),
    "gla": dict(attention="gla"),
    "gated_deltanet": dict(attention="gated_deltanet"),
    "kda": dict(attention="kda"),
    "mlstm": dict(attention="mlstm", mlp="swiglu"),
    "mamba": dict(attention=["mamba", "softmax"], kind_options={"softmax": dict(max_length=64)}),
}


def _model(kind, depth=2, seed=0):
    return models.LanguageModel(V, W, depth, H, chunk_size=4, rngs=nnx.Rngs(seed), **KINDS[kind])


def _prompt(b=B, t=6, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, V)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


@nnx.jit
def _step(model, tokens, state):
    return model(tokens, state=state, return_state=True)


def _greedy_rerun(model, prompt, steps):
    """Greedy decoding by a full forward over the whole sequence for every new token.

    The sequence is right-padded to its final length (one compile): causal, so
    the padding never reaches the position read.
    """
    b, t = prompt.shape
    tokens = jnp.concatenate([prompt, jnp.zeros((b, steps), prompt.dtype)], 1)
    for i in range(steps):
        nxt = jnp.argmax(_forward(model, tokens)[:, t + i - 1], axis=-1)
        tokens = tokens.at[:, t + i].set(nxt.astype(tokens.dtype))
    return tokens


def _stepwise(model, prompt, steps):
    """Greedy decoding by prefill + one model step per token, each its own call."""
    b, t = prompt.shape
    logits, state = _step(model, prompt, model.init_state(b, t + steps))
    tokens = [prompt]
    for i in range(steps):
        token = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)[:, None]
        tokens.append(token)
        if i + 1 < steps:
            logits, state = _step(model, token, state)
    return jnp.concatenate(tokens, axis=1)


class GenerateTest(parameterized.TestCase):
    @parameterized.parameters(*KINDS)
    def test_greedy_equals_stepwise_and_full_forwards(self, kind):
        # One layer for most kinds (the compile is most of the cost); two where a state per
        # layer (elu), a cache per layer (softmax) and a convolution's per layer meet.
        depth = 2 if kind in ("elu", "softmax", "hedgehog_conv", "mamba") else 1
        model, prompt = _model(kind, depth=depth), _prompt()
        out = model.generate(prompt, 5, temperature=0.0)
        chex.assert_shape(out, (B, 11))
        chex.assert_trees_all_equal(out, _stepwise(model, prompt, 5))
        chex.assert_trees_all_equal(out, _greedy_rerun(model, prompt, 5))

    @parameterized.parameters("cosformer", "decay_gate", "hedgehog_conv", "softmax", "kda")
    def test_left_padded_batch_equals_each_row_alone(self, kind):
        # Depth 2: a padded position's output (never NaN) feeds the next block's keys.
        model, lengths, t, steps = _model(kind), (5, 2), 5, 4
        rows = [_prompt(1, n, seed=10 + i) for i, n in enumerate(lengths)]
        # Padding tokens vary on purpose: nothing of them may reach the real tokens.
        pads = [_prompt(1, t - n, seed=20 + i) for i, n in enumerate(lengths)]
        prompt = jnp.concatenate([jnp.concatenate(p, 1) for p in zip(pads, rows, strict=True)], 0)
        mask = jnp.arange(t)[None, :] >= (t - jnp.asarray(lengths))[:, None]
        out = model.generate(prompt, steps, temperature=0.0, prompt_mask=mask)
        chex.assert_shape(out, (len(lengths), t + steps))
        chex.assert_trees_all_equal(out[:, :t], prompt)
        for i, row in enumerate(rows):
            alone = model.generate(row, steps, temperature=0.0)
            chex.assert_trees_all_equal(out[i, t:], alone[0, -steps:])

    def test_eos_stops_rows_and_pads(self):
        model, prompt = _model("elu"), _prompt()
        free = model.generate(prompt, 8, temperature=0.0)
        eos = int(free[0, 6])  # row 0's first new token
        out = model.generate(prompt, 8, temperature=0.0, eos_id=eos, pad_id=-1)
        for row_free, row in zip(np.asarray(free[:, 6:]), np.asarray(out[:, 6:]), strict=True):
            hits = np.flatnonzero(row_free == eos)
            stop = hits[0] + 1 if hits.size else len(row_free)
            np.testing.assert_array_equal(row[:stop], row_free[:stop])
            np.testing.assert_array_equal(row[stop:], -1)
        assert int(out[0, 6]) == eos and bool(jnp.all(out[0, 7:] == -1))
        # pad_id defaults to eos_id.
        out = model.generate(prompt, 8, temperature=0.0, eos_id=eos)
        assert bool(jnp.all(out[0, 6:] == eos))

    def test_top_k_1_is_greedy_and_sampling_is_valid(self):
        model, prompt = _model("decay_gate", depth=1), _prompt()
        greedy = model.generate(prompt, 6, temperature=0.0)
        rng = jax.random.PRNGKey(3)
        top_1 = model.generate(prompt, 6, rng, temperature=1.7, top_k=1, top_p=0.9)
        chex.assert_trees_all_equal(top_1, greedy)
        sampled = model.generate(prompt, 6, rng, temperature=1.0, top_k=5, top_p=0.9)
        assert bool(jnp.all((sampled >= 0) & (sampled < V)))
        assert not bool(jnp.all(sampled == greedy))
        again = model.generate(prompt, 6, rng, temperature=1.0, top_k=5, top_p=0.9)
        chex.assert_trees_all_equal(sampled, again)  # same key, same tokens

    def test_top_k_keeps_only_the_k_best(self):
        logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.3, 0.25]]))
        keys = jax.random.split(jax.random.PRNGKey(0), 400)
        draw = jax.vmap(
            lambda key: models.sample_logits(
                logits, key, jnp.float32(1.0), jnp.float32(1.0), top_k=2, use_top_p=False
            )
        )
        assert set(np.unique(draw(keys)).tolist()) == {1, 2}
        draw = jax.vmap(
            lambda key: models.sample_logits(
                logits, key, jnp.float32(1.0), jnp.float32(0.6), top_k=None, use_top_p=True
            )
        )
        assert set(np.unique(draw(keys)).tolist()) == {1, 2}  # 0.4 < 0.6 <= 0.4 + 0.3

    def test_second_call_does_not_recompile(self):
        model, prompt = _model("elu"), _prompt()
        model.generate(prompt, 4, temperature=0.0)
        before = models.sampling.trace_count()
        # A new model of the same structure, other prompt values: no new trace.
        out = _model("elu", seed=1).generate(_prompt(seed=2), 4, temperature=0.0)
        assert models.sampling.trace_count() == before
        chex.assert_shape(out, (B, 10))
        model.generate(prompt, 4, jax.random.PRNGKey(0), temperature=0.5, top_k=3)
        traced = models.sampling.trace_count()
        model.generate(prompt, 4, jax.random.PRNGKey(1), temperature=0.9, top_k=3)
        assert models.sampling.trace_count() == traced

    def test_no_new_tokens_returns_the_prompt(self):
        prompt = _prompt()
        chex.assert_trees_all_equal(_model("elu").generate(prompt, 0), prompt)

    def test_bad_arguments(self):
        model, prompt, rng = _model("elu"), _prompt(), jax.random.PRNGKey(0)
        cases = [
            (dict(temperature=-1.0), r"temperature must be"),
            (dict(temperature=float("nan")), r"temperature must be"),
            (dict(temperature=float("inf")), r"temperature must be"),
            (dict(top_k=0), r"top_k must be"),
            (dict(top_k=2.5), r"top_k must be an int"),
            (dict(top_p=0.0), r"top_p must be"),
            (dict(top_p=1.5), r"top_p must be"),
            (dict(eos_id=V), r"eos_id must be"),
            (dict(prompt_mask=jnp.ones((B, 5), bool)), r"prompt_mask must be"),
            (dict(prompt_mask=jnp.arange(6)[None].repeat(B, 0) < 3), r"prompt_mask.*left"),
        ]
        for kwargs, message in cases:
            with pytest.raises(ValueError, match=message):
                model.generate(prompt, 3, rng, **kwargs)
        with pytest.raises(ValueError, match=r"steps must be"):
            model.generate(prompt, -1, rng)
        with pytest.raises(ValueError, match=r"rng"):
            model.generate(prompt, 3, temperature=1.0)
        with pytest.raises(ValueError, match=r"empty prompt"):
            model.generate(jnp.zeros((B, 0), jnp.int32), 3, rng)
        for bad in (V, -1):
            with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\)"):
                model.generate(prompt.at[1, 2].set(bad), 3, rng)
            with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\)"):
                model(prompt.at[1, 2].set(bad))
        with pytest.raises(ValueError, match=r"prompt must be int"):
            model.generate(jnp.zeros((B, 4)), 3, rng)


class PaddedPrefillTest(parameterized.TestCase):
    def test_linear_state_counts_real_tokens_only(self):
        layer = layers.LinearAttention(
            W, H, feature_map="cosformer", max_length=64, chunk_size=4, rngs=nnx.Rngs(0)
        )
        x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, W))
        mask = jnp.arange(7)[None] >= jnp.asarray([4, 0])[:, None]
        y, state = layer(x, key_mask=mask, state=layer.init_state(2), return_state=True)
        chex.assert_trees_all_equal(state.position, jnp.asarray([3, 7], jnp.int32))
        alone, alone_state = layer(x[:1, 4:], state=layer.init_state(1), return_state=True)
        chex.assert_trees_all_close(y[:1, 4:], alone, atol=1e-5)
        # cosFormer's state holds each key at its position: the same only if they agree.
        first_row = jax.tree.map(lambda a: a[:1], state.state)
        chex.assert_trees_all_close(first_row, alone_state.state, atol=1e-5)


class KVCacheLengthTest(parameterized.TestCase):
    def test_prefill_longer_than_the_cache_raises(self):
        layer = layers.SoftmaxAttention(W, H, max_length=8, rngs=nnx.Rngs(0))
        x = jnp.ones((1, 9, W))
        with pytest.raises(ValueError, match=r"KV cache holds 8 tokens"):
            layer(x, state=layer.init_state(1), return_state=True)
        _, state = layer(x[:, :8], state=layer.init_state(1), return_state=True)
        with pytest.raises(ValueError, match=r"KV cache holds 8 tokens"):
            layer(x[:, :1], state=state, return_state=True)

    def test_overflow_under_jit_is_nan_not_silent(self):
        layer = layers.SoftmaxAttention(W, H, max_length=4, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.PRNGKey(0), (2, 4, W))
        _, state = layer(x[:, :3], state=layer.init_state(2), return_state=True)
        step = nnx.jit(lambda m, x, s: m(x, state=s, return_state=True))
        y, state = step(layer, x[:, 3:], state)  # fills the last slot: fine
        assert bool(jnp.all(jnp.isfinite(y)))
        y, _ = step(layer, x[:, 3:], state)  # one past the end
        assert bool(jnp.all(jnp.isnan(y)))


@pytest.mark.slow
def test_decode_benchmark_smoke(tmp_path):
    from experiments.bench import decode

    # Linear decodes from a synthetic state (prefill_tokens=8 < 16), softmax after a prefill.
    result = decode.measure((16, 32), (1,), prefill_tokens=8, readme_steps=4, warmup_s=0.0)
    text = decode.write(result, tmp_path, "smoke")
    assert {(r["attention"], r["decode_from"]) for r in result["rows"]} == {
        ("linear", "synthetic state"),
        ("softmax", "prefill"),
    }
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    assert "faster per token than the old Python loop" in text
    assert "linear decode flat in context, b=1" in text
    assert (tmp_path / "decode.png").stat().st_size > 0
