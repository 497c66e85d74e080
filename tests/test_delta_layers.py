"""Delta-rule layers (DeltaNet, Gated DeltaNet, KDA) and GLA's per-channel gate."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linattn_jax as la
from experiments import sweep, trainer
from experiments.configuration import load_config, override
from experiments.tasks import build_task
from experiments.validation import validate
from linattn_jax import layers, models
from tests import helpers
from tests.helpers import tol

B, T, W, H = 2, 13, 16, 2  # T = 13 and the prompt of 6 are not multiples of the chunk size 4
KINDS = ("deltanet", "gated_deltanet", "kda", "gla")
DELTA = ("deltanet", "gated_deltanet", "kda")


def _x(seed=0, shape=(B, T, W)):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _layer(kind, **kw):
    return layers.make_attention(kind, W, H, chunk_size=4, rngs=nnx.Rngs(0), **kw)


# ----------------------------------------------------------------------------
# An independent reference of the layer recipe: numpy, float64, token by token.
# ----------------------------------------------------------------------------


def _np(p):
    return np.asarray(p[...], np.float64)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softplus(x):
    return np.log1p(np.exp(x))


def _reference(layer: layers.DeltaRuleAttention, x: np.ndarray) -> np.ndarray:
    """The published recipe, written out per token from the layer's parameters."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, d = layer.num_heads, layer.key_dim
    qkv = np.concatenate(
        [x @ _np(p.kernel) for p in (layer.q_proj, layer.k_proj, layer.v_proj)], -1
    )
    if layer.conv is not None:
        kernel = _np(layer.conv.kernel)  # [size, c]; tap i looks back size - 1 - i tokens
        n = kernel.shape[0] - 1
        padded = np.concatenate([np.zeros((b, n, qkv.shape[-1])), qkv], 1)
        qkv = sum(kernel[i] * padded[:, i : i + t] for i in range(n + 1))
    q, k, v = (y.reshape(b, t, h, d) for y in np.split(_silu(qkv), 3, axis=-1))
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    beta = layer.beta_max / (1.0 + np.exp(-(x @ _np(layer.beta_proj.kernel))))  # [b, t, h]
    alpha = np.ones((b, t, h, d))
    if layer.variant == "gated_deltanet":
        a = x @ _np(layer.gate.proj.kernel) + _np(layer.gate.dt_bias)
        alpha = np.broadcast_to(
            np.exp(-np.exp(_np(layer.gate.A_log)) * _softplus(a))[..., None], alpha.shape
        )
    elif layer.variant == "kda":
        first, second = layer.gate.proj.layers
        a = (x @ _np(first.kernel) @ _np(second.kernel) + _np(layer.gate.dt_bias)).reshape(
            b, t, h, d
        )
        alpha = np.exp(-np.exp(_np(layer.gate.A_log))[:, None] * _softplus(a))
    out = np.zeros((b, t, h, d))
    s = np.zeros((b, h, d, d))
    for i in range(t):
        s = alpha[:, i, :, :, None] * s  # Diag(alpha) S: rows are key channels
        kt, vt, bt = k[:, i], v[:, i], beta[:, i]
        error = vt - np.einsum("bhkv,bhk->bhv", s, kt)
        s = s + bt[..., None, None] * kt[..., :, None] * error[..., None, :]
        out[:, i] = np.einsum("bhkv,bhk->bhv", s, q[:, i] / np.sqrt(d))
    out = out / np.sqrt(np.mean(out * out, -1, keepdims=True) + 1e-6) * _np(layer.output_norm.scale)
    if layer.g_proj is not None:
        out = out * _silu(x @ _np(layer.g_proj.kernel)).reshape(b, t, h, d)
    return out.reshape(b, t, h * d) @ _np(layer.out_proj.kernel)


@pytest.mark.parametrize(
    "kind, kw",
    [
        ("deltanet", {}),
        ("gated_deltanet", {}),
        ("kda", {}),
        ("kda", dict(gate_rank=3, allow_negative_eigenvalues=True)),
        ("gated_deltanet", dict(conv_size=0, output_gate=False)),
    ],
)
def test_layer_matches_the_recipe_written_out(kind, kw):
    layer = _layer(kind, **kw)
    x = _x(7)
    chex.assert_trees_all_close(
        layer(x), _reference(layer, np.asarray(x)).astype(np.float32), **tol(jnp.float32)
    )


def test_gla_gate_is_the_low_rank_log_sigmoid_per_channel():
    layer = _layer("gla")
    x = _x(3)
    first, second = layer.gate.proj.layers
    logits = x @ first.kernel[...] @ second.kernel[...] + second.bias[...][None, None]
    gate = jax.nn.log_sigmoid(logits).reshape(B, T, H, W // H) / 16.0
    q, k, v = (p(x).reshape(B, T, H, W // H) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    out = la.causal_linear_attention(
        q, k, v, feature_map=layer.phi, method="scan", gate=gate, normalize=False
    )
    expected = layer.out_proj(layer.output_norm(out).reshape(B, T, W))
    chex.assert_trees_all_close(layer(x), expected, **tol(jnp.float32))
    assert (layer.normalize, layer.feature_map_name) == (False, "identity")


# ----------------------------------------------------------------------------
# Decoding, gradients, padding, segments, dtypes.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_steps_equal_full_forward(kind):
    layer, x = _layer(kind), _x()
    full = layer(x)
    y, cache = layer(x[:, :6], state=layer.init_state(B), return_state=True)
    outs = [y]
    for i in range(6, T):
        y, cache = layer(x[:, i : i + 1], state=cache, return_state=True)
        outs.append(y)
    chex.assert_trees_all_close(jnp.concatenate(outs, 1), full, atol=1e-5, rtol=1e-5)
    if kind != "gla":
        chex.assert_shape(cache.state.s, (B, H, W // H, W // H))
        chex.assert_shape(cache.conv, (B, 3, 3 * W))
        chex.assert_trees_all_equal_dtypes(cache, jax.tree.map(jnp.float32, cache))


@pytest.mark.parametrize("kind", KINDS)
def test_every_parameter_gets_a_gradient(kind):
    layer, x = _layer(kind), _x(1)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x)))))(layer)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) >= (4 if kind == "gla" else 7)
    for path, g in leaves:
        assert bool(jnp.any(g != 0)), f"all-zero gradient at {jax.tree_util.keystr(path)}"


@pytest.mark.parametrize("kind", ["gated_deltanet", "kda", "gla"])
def test_nan_padding_changes_neither_real_outputs_nor_gradients(kind):
    layer = _layer(kind)
    x = _x(2, (1, T, W))
    mask = jnp.arange(T)[None, :] < 7
    # LinearAttention (GLA) does not clear padded rows before its projections, so a
    # NaN there reaches the projections' gradients (0 * NaN): large junk for it.
    padded = jnp.where(mask[..., None], x, 1e4 if kind == "gla" else jnp.nan)
    weights = _x(4, (1, 7, W))

    def loss(m, inputs, key_mask):
        y = m(inputs) if key_mask is None else m(inputs, key_mask=key_mask)
        return jnp.sum(y[:, :7] * weights), y

    grad_fn = nnx.jit(nnx.value_and_grad(loss, has_aux=True))  # one compile, not many
    (real_loss, real), real_grads = grad_fn(layer, x[:, :7], None)
    (_, y), grads = grad_fn(layer, padded, mask)
    assert bool(jnp.all(jnp.isfinite(y)))
    chex.assert_trees_all_close(y[:, :7], real, atol=1e-5, rtol=1e-5)
    chex.assert_tree_all_finite(grads)
    chex.assert_trees_all_close(grads, real_grads, atol=1e-5, rtol=1e-5)
    assert np.isfinite(float(real_loss))


@pytest.mark.parametrize("kind", ["gated_deltanet"])
def test_classifier_ignores_padding(kind):
    model = models.SequenceClassifier(
        11, 3, W, 1, H, attention=kind, chunk_size=4, rngs=nnx.Rngs(0)
    )
    tokens = jax.random.randint(jax.random.PRNGKey(0), (1, T), 0, 11)
    junk = jax.random.randint(jax.random.PRNGKey(1), (1, T), 0, 11)
    mask = jnp.arange(T)[None, :] < 8
    padded = jnp.where(mask, tokens, junk)
    run = nnx.jit(lambda m, tokens, key_mask: m(tokens, key_mask=key_mask))
    chex.assert_trees_all_close(
        run(model, padded, mask), run(model, tokens[:, :8], None), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("kind", ["deltanet", "kda"])
def test_segments_run_as_separate_sequences(kind):
    layer, x = _layer(kind), _x(5, (1, T, W))
    segments = jnp.where(jnp.arange(T) < 5, 0, 1)[None].astype(jnp.int32)
    packed = helpers.call(layer, x, segment_ids=segments)
    separate = jnp.concatenate([helpers.call(layer, x[:, :5]), helpers.call(layer, x[:, 5:])], 1)
    chex.assert_trees_all_close(packed, separate, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_compute_with_float32_params(kind):
    x = _x(6)
    reference = _layer(kind)(x)
    layer = _layer(kind, dtype=jnp.bfloat16)
    # LinearAttention's output RMSNorm (GLA) promotes bfloat16 with its float32 scale.
    with jax.numpy_dtype_promotion("standard" if kind == "gla" else "strict"):
        y, cache = layer(x.astype(jnp.bfloat16), return_state=True)
    chex.assert_type(y, jnp.bfloat16)
    params = nnx.state(layer, nnx.Param)
    chex.assert_trees_all_equal_dtypes(
        params, jax.tree.map(lambda p: jnp.zeros((), jnp.float32), params)
    )
    states = cache.state if kind == "gla" else cache  # not GLA's int32 position
    chex.assert_trees_all_equal_dtypes(states, jax.tree.map(jnp.float32, states))
    scale = float(jnp.max(jnp.abs(reference)))
    chex.assert_trees_all_close(y.astype(jnp.float32), reference, atol=0.03 * scale, rtol=0.03)


# ----------------------------------------------------------------------------
# Models and the trainer.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_language_model_generates_with_each_kind(kind):
    model = models.LanguageModel(23, W, 1, H, attention=kind, chunk_size=4, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.PRNGKey(1), (B, 6), 0, 23)
    # Jitted (eager, the model ran op by op): one compile for the prompt, one for the step.
    run = nnx.jit(lambda model, tokens, state: model(tokens, state=state, return_state=True))
    logits, state = run(model, prompt, model.init_state(B))
    token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    step_logits, _ = run(model, token, state)
    full = nnx.jit(lambda model, tokens: model(tokens))(model, jnp.concatenate([prompt, token], 1))
    chex.assert_trees_all_close(step_logits[:, 0], full[:, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_mqar_config_trains_a_step(kind):
    config = load_config("configs/mqar.py:small")
    for assignment in [
        *sweep.expand(f"attention={kind}")[0],
        "seq_len=32",
        "batch_size=4",
        "model.width=16",
        "model.depth=1",
        "model.chunk_size=8",
        "optim.warmup_steps=0",  # a first step with a learning rate above 0
    ]:
        override(config, assignment)
    validate(config)
    assert config.model.attention == kind
    model = trainer.build_model(config)
    task = build_task(config)
    optimizer = nnx.Optimizer(model, trainer.build_optimizer(config), wrt=nnx.Param)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    batch = task.batch(0, "train")
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        metrics = trainer.train_step(
            model, optimizer, batch.inputs, batch.labels, batch.key_mask, kind=task.kind
        )
    assert np.isfinite(float(metrics["loss"]))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, nnx.state(model, nnx.Param))
    assert all(jax.tree.leaves(changed))


def test_sweep_shorthand_maps_kinds_and_feature_maps():
    assert sweep.expand("attention=softmax,elu,kda,gla") == [
        ["model.attention=softmax"],
        ["model.attention=linear", "model.feature_map=elu"],
        ["model.attention=kda"],
        ["model.attention=gla"],
    ]


# ----------------------------------------------------------------------------
# Bad arguments.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(variant="mamba"), "variant"),
        (dict(conv_size=-1), "conv_size"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(method="quadratic"), "method"),
        (dict(gate_rank=4), "gate_rank"),
        (dict(variant="kda", gate_rank=-1), "gate_rank"),
        (dict(gate_lower_bound=-5.0), r"gate_lower_bound is KDA's"),
        (dict(variant="kda", gate_lower_bound=0.5), r"gate_lower_bound must be a number < 0"),
        (dict(output_gate=1), "output_gate"),
        (dict(allow_negative_eigenvalues="yes"), "allow_negative_eigenvalues"),
    ],
)
def test_bad_delta_arguments_raise(kw, message):
    with pytest.raises(ValueError, match=message):
        layers.DeltaRuleAttention(W, H, rngs=nnx.Rngs(0), **kw)


def test_bad_gate_and_kind_raise():
    with pytest.raises(ValueError, match="gate"):
        layers.LinearAttention(W, H, gate="channels", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="gate"):
        layers.make_attention("gla", W, H, gate=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention"):
        layers.make_attention("delta", W, H, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="causal"):
        _layer("kda", causal=False).init_state(B)
    with pytest.raises(ValueError, match="state"):
        _layer("kda")(_x(), state=layers.LinearAttentionCache(None, None))


def test_ling_bounded_full_rank_gate():
    """Ling 3's KDA gate: one matrix (``gate_rank=0``), ``lower_bound * sigmoid(exp(A_log)
    (W x + dt_bias))`` per key channel (the whole layer against transformers in
    tests/test_hf_bailing_hybrid.py)."""
    gate = _layer("kda", gate_rank=0, gate_lower_bound=-5.0).gate
    assert gate.proj.kernel.shape == (W, W)
    x = _x(3)
    a = (x @ gate.proj.kernel[...] + gate.dt_bias[...][None, None]).reshape(B, T, H, W // H)
    decay = jnp.exp(gate.A_log[...])[None, None, :, None]
    np.testing.assert_allclose(gate(x), -5.0 / (1 + jnp.exp(-decay * a)), **tol(jnp.float32))


def test_kimi_output_gate_options():
    """Kimi Linear's KDA: ``W_g`` of low rank and ``RMSNorm(o) * sigmoid(g)`` (the whole
    layer against transformers' in tests/test_hf_kimi.py)."""
    layer = _layer("kda", output_gate_rank=3, output_gate_activation="sigmoid")
    first, second = layer.g_proj.layers
    assert first.kernel.shape == (W, 3) and second.kernel.shape == (3, W)
    assert first.kernel.out_sharding == ("embed", None)
    o = _x(1, (B, T, H, W // H))
    g = _x(2, (B, T, H, W // H))
    norm = layer.output_norm
    expected = o / jnp.sqrt(jnp.mean(o * o, -1, keepdims=True) + norm.epsilon)
    expected = expected * norm.scale[...][None, None, None] / (1 + jnp.exp(-g))
    np.testing.assert_allclose(norm(o, g), expected, **tol(jnp.float32))
    with pytest.raises(ValueError, match="output_gate_activation must be one of"):
        _layer("kda", output_gate_activation="relu")
    with pytest.raises(ValueError, match="output_gate_rank needs output_gate=True"):
        _layer("kda", output_gate_rank=3, output_gate=False)
    with pytest.raises(ValueError, match="output_gate_rank"):
        _layer("kda", output_gate_rank=0)
