"""``Mamba2Mixer`` against ``transformers``' PyTorch ``Mamba2Mixer`` (its pure-torch path, on
CPU, float32) with random weights copied across (random ``A_log``, ``dt_bias``, ``D``,
norm and convolution weights, so that a mapping error shows); prefill then one-token steps
against the full forward; left padding and packed segments against each row alone; the
kind in a hybrid layout through ``generate``; ``configs/hybrid.py:mamba2_small``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import trainer
from experiments.configuration import load_config
from experiments.validation import validate
from linattn_jax import layers, models
from tests import helpers

torch = pytest.importorskip("torch")
mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
Mamba2Config = pytest.importorskip("transformers").Mamba2Config

WIDTH, HEADS, HEAD_DIM, STATE, GROUPS, CONV = 16, 4, 8, 6, 2, 4


def _torch_mixer(seed=0):
    config = Mamba2Config(
        hidden_size=WIDTH, num_heads=HEADS, head_dim=HEAD_DIM, expand=2, state_size=STATE,
        n_groups=GROUPS, conv_kernel=CONV, chunk_size=8, num_hidden_layers=1,
        layer_norm_epsilon=1e-5,
    )  # fmt: skip
    torch.manual_seed(seed)
    mixer = mamba2.Mamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():  # random everything the initialisation sets to constants
        mixer.A_log.copy_(torch.randn(HEADS))
        mixer.dt_bias.copy_(torch.randn(HEADS))
        mixer.D.copy_(torch.randn(HEADS))
        mixer.norm.weight.copy_(1 + 0.5 * torch.randn(HEADS * HEAD_DIM))
        mixer.conv1d.bias.copy_(0.3 * torch.randn(mixer.conv_dim))
    return mixer


def _ours(mixer, **options):
    """A ``Mamba2Mixer`` holding ``mixer``'s weights."""
    ours = layers.Mamba2Mixer(
        WIDTH, HEADS, head_dim=HEAD_DIM, state_dim=STATE, n_groups=GROUPS, conv_size=CONV,
        norm_eps=1e-5, rngs=nnx.Rngs(0), **options,
    )  # fmt: skip
    w = {k: jnp.asarray(v.detach().numpy()) for k, v in mixer.state_dict().items()}
    ours.in_proj.kernel[...] = w["in_proj.weight"].T
    ours.conv.kernel[...] = w["conv1d.weight"][:, 0, :].T
    ours.conv_bias[...] = w["conv1d.bias"]
    for name in ("dt_bias", "A_log", "D"):
        getattr(ours, name)[...] = w[name]
    ours.norm.weight[...] = w["norm.weight"]
    ours.out_proj.kernel[...] = w["out_proj.weight"].T
    return ours


def _tokens(seed, b=2, t=11):
    return jax.random.normal(jax.random.PRNGKey(seed), (b, t, WIDTH))


def test_equals_transformers_mamba2_mixer_float32():
    mixer = _torch_mixer()
    ours = _ours(mixer)
    x = _tokens(1)
    with torch.no_grad():
        expected = mixer(torch.from_numpy(np.array(x))).numpy()
    helpers.assert_close_normwise(helpers.call(ours, x), expected, rtol=1e-5)
    # The scan form and a chunk size that does not divide the length agree too.
    helpers.assert_close_normwise(helpers.call(_ours(mixer, method="scan"), x), expected, rtol=1e-5)


def test_prefill_then_steps_equal_the_full_forward():
    ours = _ours(_torch_mixer(2), chunk_size=4)
    x = _tokens(3, t=9)
    full = helpers.call(ours, x)
    y, cache = helpers.call(ours, x[:, :5], state=ours.init_state(2), return_state=True)
    outs = [y]
    for i in range(5, 9):
        y, cache = helpers.call(ours, x[:, i : i + 1], state=cache, return_state=True)
        outs.append(y)
    assert cache.ssm.s.shape == (2, HEADS, STATE, HEAD_DIM) and cache.ssm.s.dtype == jnp.float32
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **helpers.tol(jnp.float32))


def test_left_padding_and_packed_segments_equal_each_row_alone():
    ours = _ours(_torch_mixer(4))
    a, b, c = _tokens(5, b=1, t=7), _tokens(6, b=1, t=4), _tokens(7, b=1, t=3)
    # Causal: row 0's first 4 outputs are b's alone, whatever follows (one shape throughout).
    call = helpers.call
    alone = call(ours, jnp.concatenate([jnp.concatenate([b, c], 1), a]))
    # Row 0 left-padded (its padding holding NaN), row 1 the full length.
    padded = jnp.concatenate([jnp.full((1, 3, WIDTH), jnp.nan), b], axis=1)
    mask = jnp.array([[False] * 3 + [True] * 4, [True] * 7])
    out = call(ours, jnp.concatenate([padded, a]), key_mask=mask)
    np.testing.assert_allclose(out[0, 3:], alone[0, :4], **helpers.tol(jnp.float32))
    np.testing.assert_allclose(out[1], alone[1], **helpers.tol(jnp.float32))
    # c packed after b in one row, told apart by segment ids: c as if alone.
    segments = jnp.array([[0] * 4 + [1] * 3, [0] * 7])
    packed = call(ours, jnp.concatenate([jnp.concatenate([b, c], 1), a]), segment_ids=segments)
    c_alone = call(ours, jnp.concatenate([jnp.concatenate([c, b], 1), a]))[0, :3]
    np.testing.assert_allclose(packed[0, :4], alone[0, :4], **helpers.tol(jnp.float32))
    np.testing.assert_allclose(packed[0, 4:], c_alone, **helpers.tol(jnp.float32))


def test_every_parameter_names_its_dims():
    ours = layers.Mamba2Mixer(WIDTH, HEADS, state_dim=STATE, n_groups=GROUPS, rngs=nnx.Rngs(0))
    for path, param in nnx.to_flat_state(nnx.state(ours, nnx.Param)):
        names = param.get_metadata().get("out_sharding")
        assert names is not None and len(names) == param.ndim, path


def test_a_nemotron_h_shaped_layout_decodes_as_its_full_forward():
    # Nemotron-H's "M-*-": a Mamba-2 layer and an attention layer without MLPs, each
    # followed by a squared-ReLU MLP-only layer.
    model = models.LanguageModel(
        50, 16, 4, 2, attention="mamba2 : mlp : softmax : mlp", mlp="relu2",
        tie_embeddings=False, rngs=nnx.Rngs(0),
        kind_options={
            "mamba2": dict(num_heads=4, state_dim=8, chunk_size=4, mlp="none"),
            "softmax": dict(mlp="none"),
        },
    )  # fmt: skip
    parts = [
        (type(b.attention).__name__, type(b.mlp).__name__, b.mlp_norm is None) for b in model.blocks
    ]
    assert parts == [
        ("Mamba2Mixer", "NoneType", True),
        ("NoneType", "ReLU2MLP", False),
        ("SoftmaxAttention", "NoneType", True),
        ("NoneType", "ReLU2MLP", False),
    ]
    assert model.blocks[1].attention_norm is None
    mlp = model.blocks[1].mlp
    x = _tokens(9, b=1, t=3)
    up, down = mlp.up_proj.kernel[...], mlp.down_proj.kernel[...]
    np.testing.assert_allclose(mlp(x), np.maximum(x @ up, 0) ** 2 @ down, rtol=1e-5, atol=1e-6)
    prompt = jax.random.randint(jax.random.PRNGKey(1), (1, 5), 0, 50)
    tokens = model.generate(prompt, 4, temperature=0.0)
    greedy = jnp.argmax(helpers.unmasked(model, tokens)[:, 4:-1], axis=-1)  # jitted
    np.testing.assert_array_equal(greedy, tokens[:, 5:])
    with pytest.raises(ValueError, match="needs a mixer or an MLP"):
        layers.TransformerBlock(16, 2, attention="mlp", mlp="none", rngs=nnx.Rngs(0))


def test_bad_options_raise():
    for options, message in [
        (dict(n_groups=3), "n_groups must divide"),
        (dict(method="fast"), "method must be one of"),
        (dict(time_step_limit=(1.0, 0.5)), "time_step_limit"),
    ]:
        with pytest.raises(ValueError, match=message):
            layers.Mamba2Mixer(WIDTH, HEADS, rngs=nnx.Rngs(0), **options)


def test_the_mamba2_hybrid_config_builds_its_layout():
    config = load_config("configs/hybrid.py:mamba2_small")
    validate(config)
    model = trainer.build_model(config)
    assert model.layout == ("mamba2",) * 3 + ("softmax",)
    mixer = model.blocks[0].attention
    assert (mixer.num_heads, mixer.head_dim, mixer.state_dim) == (2, 64, 128)


def test_float16_stays_finite_where_the_ssd_output_passes_float16s_range():
    # #53 item 2: at input std 20 the SSD's output passes 65504 before the gated norm
    # brings it back (the float32 layer's output stays small): float16 must not overflow.
    x = 20 * _tokens(3, t=16)
    make = lambda **dtype: layers.Mamba2Mixer(
        WIDTH, HEADS, head_dim=HEAD_DIM, state_dim=STATE, n_groups=GROUPS, conv_size=CONV,
        rngs=nnx.Rngs(0), **dtype,
    )  # fmt: skip
    want = make()(x)
    got = make(dtype=jnp.float16)(x.astype(jnp.float16))
    assert got.dtype == jnp.float16 and bool(jnp.all(jnp.isfinite(got)))
    helpers.assert_close_normwise(got.astype(jnp.float32), want, 1e-2)
