"""SoftmaxAttention's modern options (RoPE, GQA, head_dim, QK-norm, output gate, sliding
window, soft-capped scores) against a float64 numpy reference of the whole layer written here, and the norms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import layers
from linattn_jax.layers import norms, rope
from tests import helpers

B, T, W, H = 2, 10, 16, 4
EPS = 1e-6  # the RMSNorms' epsilon


def _np(x):
    return np.asarray(x, np.float64)


def _ref_positions(key_mask, segment_ids, start=None):
    """Each token's position: the real tokens before it in its segment (Python loops)."""
    b, t = key_mask.shape
    pos = np.zeros((b, t), np.int64)
    for r in range(b):
        count = 0 if start is None else int(start[r])
        for i in range(t):
            if i and segment_ids is not None and segment_ids[r, i] != segment_ids[r, i - 1]:
                count = 0
            pos[r, i] = count
            count += int(key_mask[r, i])
    return pos


def _ref_rope(x, pos, rotary_dim, theta):
    """Channels (i, i + rotary_dim / 2) as one complex number, times exp(i pos theta_i)."""
    half = rotary_dim // 2
    freq = theta ** (-np.arange(half) * 2.0 / rotary_dim)
    z = (x[..., :half] + 1j * x[..., half:rotary_dim]) * np.exp(1j * pos[..., None, None] * freq)
    return np.concatenate([z.real, z.imag, x[..., rotary_dim:]], axis=-1)


def _ref_rms(x, scale, zero_centred):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    return y * (1.0 + scale if zero_centred else scale)


def reference(layer, x, key_mask=None, segment_ids=None, zero_centred=False):
    """The layer in float64 numpy, quadratic, from its parameters and options."""
    b, t, _ = x.shape
    h, kv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
    mask = np.ones((b, t), bool) if key_mask is None else np.asarray(key_mask)
    x = np.where(mask[..., None], _np(x), 0.0)
    w = lambda proj: _np(proj.kernel[...])
    q = (x @ w(layer.q_proj)).reshape(b, t, h, -1)
    k, v = ((x @ w(p)).reshape(b, t, kv, hd) for p in (layer.k_proj, layer.v_proj))
    gate = None
    if layer.output_gate:
        q, gate = q[..., :hd], q[..., hd:]
    if layer.q_norm is not None:
        q = _ref_rms(q, _np(layer.q_norm.scale[...]), zero_centred)
        k = _ref_rms(k, _np(layer.k_norm.scale[...]), zero_centred)
    if layer.rotary_dim is not None:
        pos = _ref_positions(mask, None if segment_ids is None else np.asarray(segment_ids))
        q, k = (_ref_rope(y, pos, layer.rotary_dim, layer.rope_theta) for y in (q, k))
    group = h // kv
    out = np.zeros((b, t, h, hd))
    for r in range(b):
        for n in range(h):
            scores = q[r, :, n] @ k[r, :, n // group].T / np.sqrt(hd)
            if layer.logit_soft_cap is not None:
                scores = layer.logit_soft_cap * np.tanh(scores / layer.logit_soft_cap)
            i, j = np.arange(t)[:, None], np.arange(t)[None, :]
            allowed = np.broadcast_to(mask[r][None, :], (t, t)).copy()
            if layer.causal:
                allowed &= j <= i
            if layer.sliding_window is not None:
                allowed &= np.abs(i - j) < layer.sliding_window
            if segment_ids is not None:
                seg = np.asarray(segment_ids[r])
                allowed &= seg[:, None] == seg[None, :]
            allowed &= mask[r][:, None]  # a padded query sees nothing (its output is 0)
            scores = np.where(allowed, scores, -1e300)
            p = np.where(allowed, np.exp(scores - scores.max(-1, keepdims=True)), 0.0)
            p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
            out[r, :, n] = p @ v[r, :, n // group]
    out = np.where(mask[:, :, None, None], out, 0.0)
    if gate is not None:
        out = out / (1.0 + np.exp(-gate))
    return out.reshape(b, t, h * hd) @ w(layer.out_proj)


def _x(seed=0, t=T):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, t, W))


def _layer(**kw):
    return layers.SoftmaxAttention(W, H, max_length=32, rngs=nnx.Rngs(0), **kw)


OPTIONS = {
    "plain": {},
    "gqa": dict(num_kv_heads=2),
    "mqa_head_dim": dict(num_kv_heads=1, head_dim=6),
    "rope": dict(rope=True, rope_theta=100.0),
    "partial_rope": dict(rope=True, partial_rotary_factor=0.5, head_dim=8),
    "qk_norm": dict(qk_norm=True),
    "qk_norm_zero_centred": dict(qk_norm=True, zero_centred_qk_norm=True),
    "output_gate": dict(output_gate=True),
    "window": dict(sliding_window=3),
    "soft_cap": dict(logit_soft_cap=0.5, sliding_window=4, num_kv_heads=2),
    "qwen_next": dict(
        num_kv_heads=1,
        head_dim=8,
        rope=True,
        partial_rotary_factor=0.25,
        qk_norm=True,
        zero_centred_qk_norm=True,
        output_gate=True,
    ),  # fmt: skip
}


def _randomise(layer, seed=5):
    """Norm scales away from their initial values, so a wrong form shows."""
    if layer.q_norm is not None:
        for i, norm in enumerate((layer.q_norm, layer.k_norm)):
            key = jax.random.PRNGKey(seed + i)
            norm.scale[...] = 0.5 * jax.random.normal(key, norm.scale.shape) + 0.3
    return layer


@pytest.mark.parametrize("name", list(OPTIONS))
def test_layer_equals_float64_reference(name):
    layer = _randomise(_layer(**OPTIONS[name]))
    x, zc = _x(), OPTIONS[name].get("zero_centred_qk_norm", False)
    np.testing.assert_allclose(layer(x), reference(layer, x, zero_centred=zc), atol=2e-5)
    mask = helpers.key_mask(3, B, T).at[1, :3].set(False)
    seg = helpers.segment_ids(4, B, T, p=0.3)
    np.testing.assert_allclose(
        layer(x, key_mask=mask, segment_ids=seg),
        reference(layer, x, mask, seg, zero_centred=zc),
        atol=2e-5,
    )


def test_non_causal_window_equals_reference():
    layer = _layer(causal=False, sliding_window=2, rope=True)
    x, mask = _x(1), helpers.key_mask(2, B, T)
    np.testing.assert_allclose(layer(x, key_mask=mask), reference(layer, x, mask), atol=2e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = _layer(num_kv_heads=2, rope=True)
    mha = _layer(rope=True)
    mha.q_proj.kernel[...] = gqa.q_proj.kernel[...]
    mha.out_proj.kernel[...] = gqa.out_proj.kernel[...]
    for name in ("k_proj", "v_proj"):  # kv head j serves query heads 2j and 2j + 1
        kernel = getattr(gqa, name).kernel[...].reshape(W, 2, 1, W // H)
        getattr(mha, name).kernel[...] = jnp.repeat(kernel, 2, axis=2).reshape(W, W)
    x = _x(2)
    np.testing.assert_allclose(gqa(x), mha(x), atol=1e-5)


def test_rope_scores_depend_only_on_position_differences():
    key = jax.random.split(jax.random.PRNGKey(0), 2)
    q, k = (jax.random.normal(kk, (1, 5, 2, 8)) for kk in key)
    pos = jnp.array([[0, 3, 4, 9, 10]])
    scores = lambda p: jnp.einsum(
        "bihd,bjhd->bhij", rope.apply_rope(q, p, 8, 10.0), rope.apply_rope(k, p, 8, 10.0)
    )
    np.testing.assert_allclose(scores(pos), scores(pos + 37), atol=1e-4)
    assert not np.allclose(scores(pos), scores(pos * 2), atol=1e-2)
    np.testing.assert_allclose(rope.apply_rope(q, pos, 8, 10.0), _ref_rope(_np(q), _np(pos), 8, 10.0), atol=1e-5)  # fmt: skip


def test_partial_rope_leaves_the_other_channels_unchanged():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 3, 16))
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6)) + 5
    y = rope.apply_rope(x, pos, 4, 10000.0)
    np.testing.assert_array_equal(y[..., 4:], x[..., 4:])
    np.testing.assert_allclose(y[..., :4], _ref_rope(_np(x[..., :4]), _np(pos), 4, 1e4), atol=1e-5)
    # A rotation: each pair's norm is kept.
    pairs = lambda z: z[..., :2] ** 2 + z[..., 2:4] ** 2
    np.testing.assert_allclose(pairs(y), pairs(x), rtol=1e-5)
    assert rope.rotary_dim(16, 0.25, None) == 4 and rope.rotary_dim(16, None, None) == 16


def test_token_positions_restart_per_segment_and_skip_padding():
    mask = jnp.array([[False, False, True, True, True, True], [True] * 6])
    seg = jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 2]])
    got = rope.token_positions(2, 6, key_mask=mask, segment_ids=seg)
    np.testing.assert_array_equal(got, _ref_positions(np.asarray(mask), np.asarray(seg)))
    np.testing.assert_array_equal(got, [[0, 0, 0, 0, 1, 2], [0, 1, 0, 1, 2, 0]])
    start = jnp.array([3, 0])
    np.testing.assert_array_equal(
        rope.token_positions(2, 6, key_mask=mask, start=start),
        _ref_positions(np.asarray(mask), None, start=np.asarray(start)),
    )


@pytest.mark.parametrize("name", ["qwen_next", "window", "gqa", "soft_cap"])
def test_prefill_then_steps_equal_full_forward_and_cache_holds_kv_heads(name):
    layer, x = _randomise(_layer(**OPTIONS[name])), _x(3)
    full = helpers.call(layer, x)
    y, cache = helpers.call(layer, x[:, :6], state=layer.init_state(B), return_state=True)
    n = 32 if layer.sliding_window is None else layer.sliding_window  # a window: a ring
    assert cache.k.shape == (B, n, layer.num_kv_heads, layer.head_dim) == cache.v.shape
    outs = [y]
    for i in range(6, T):
        y, cache = helpers.call(layer, x[:, i : i + 1], state=cache, return_state=True)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5)


def test_a_windowed_cache_is_a_ring_of_the_window_past_which_decoding_equals_the_full_pass():
    """A window of 3, RoPE and GQA: the cache holds 3 slots; a left-padded prefill of 7
    (longer than the window) then 13 steps (wrapping the ring many times) equal the full
    forward of the row alone; a cache shorter than the window does not wrap: it refuses
    what would overflow."""
    layer = _layer(sliding_window=3, rope=True, num_kv_heads=2)
    x = jax.random.normal(jax.random.PRNGKey(7), (B, 20, W))
    full = helpers.call(layer, x)
    mask = jnp.ones((B, 20), bool).at[1, :2].set(False)  # row 1: 2 padded, then its tokens
    padded = x.at[1, 2:].set(x[1, :18])

    def run(x, mask, cache):
        return helpers.call(layer, x, key_mask=mask, state=cache, return_state=True)

    y, cache = run(padded[:, :7], mask[:, :7], layer.init_state(B, 64))
    assert cache.k.shape == (B, 3, 2, layer.head_dim) and cache.mask.shape == (B, 3)
    outs = [y]
    for i in range(7, 20):
        y, cache = run(padded[:, i : i + 1], mask[:, i : i + 1], cache)
        outs.append(y)
    out = jnp.concatenate(outs, 1)
    np.testing.assert_array_equal(cache.position, [20, 20])
    np.testing.assert_array_equal(cache.real, [20, 18])
    np.testing.assert_allclose(out[0], full[0], atol=1e-5)
    np.testing.assert_allclose(out[1, 2:], full[1, :18], atol=1e-5)
    short = layer.init_state(B, 2)  # shorter than the window: a plain cache of 2, written
    short = short._replace(position=jnp.full((B,), 2, jnp.int32))
    with pytest.raises(ValueError, match="the KV cache holds 2 tokens: 2 written"):
        layer(x[:, 2:3], state=short, return_state=True)


def test_left_padded_prefill_and_packed_segments_equal_each_alone():
    layer = _randomise(_layer(**OPTIONS["qwen_next"]))
    x = _x(4)
    # Row 1 padded by 3 on the left: its real tokens' outputs, then its steps, equal row 1's
    # last 7 tokens alone.
    mask = jnp.ones((B, T), bool).at[1, :3].set(False)
    padded, cache = helpers.call(layer, x[:, :8], key_mask=mask[:, :8], state=layer.init_state(B), return_state=True)  # fmt: skip
    step, _ = helpers.call(layer, x[:, 8:9], state=cache, return_state=True)
    alone = helpers.call(layer, x[1:, 3:9])
    np.testing.assert_allclose(padded[1, 3:], alone[0, :5], atol=1e-5)
    np.testing.assert_allclose(step[1], alone[0, 5:], atol=1e-5)
    # Two segments packed in one row: each as its own sequence.
    seg = jnp.array([[0] * 4 + [1] * 6] * B)
    packed = helpers.call(layer, x, segment_ids=seg)
    np.testing.assert_allclose(packed[:, :4], helpers.call(layer, x[:, :4]), atol=1e-5)
    np.testing.assert_allclose(packed[:, 4:], helpers.call(layer, x[:, 4:]), atol=1e-5)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_kv_heads=3), r"num_kv_heads=3 must divide num_heads=4"),
        (dict(head_dim=0), r"head_dim must be an int >= 1"),
        (dict(rope_theta=5.0), r"\['rope_theta'\] need rope=True"),
        (dict(rope=True, rotary_dim=3), r"rotary_dim must be even"),
        (dict(rope=True, partial_rotary_factor=1.5), r"partial_rotary_factor must be in"),
        (dict(rope=True, rotary_dim=4, partial_rotary_factor=0.5), r"not both"),
        (dict(sliding_window=0), r"sliding_window must be an int >= 1"),
        (dict(qk_norm=1), r"qk_norm must be True or False"),
    ],
)
def test_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        _layer(**kw)


def test_width_need_not_divide_with_head_dim():
    layer = layers.SoftmaxAttention(12, 5, head_dim=4, num_kv_heads=1, rngs=nnx.Rngs(0))
    assert layer(jnp.ones((1, 3, 12))).shape == (1, 3, 12)


def test_norms():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 8))
    zero = norms.RMSNorm(8, zero_centred=True, rngs=nnx.Rngs(0))
    flax_norm = nnx.RMSNorm(8, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(zero(x), flax_norm(x), atol=1e-6)  # both start as x / rms(x)
    zero.scale[...] = jnp.arange(8.0) / 10
    np.testing.assert_allclose(zero(x), _ref_rms(_np(x), _np(zero.scale[...]), True), atol=1e-6)
    plain = norms.RMSNorm(8, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(plain(x), flax_norm(x))
    gated, g = norms.GatedRMSNorm(8, rngs=nnx.Rngs(0)), -x[::-1]
    ref = _ref_rms(_np(x), 1.0, False) * _np(g) / (1 + np.exp(-_np(g)))
    np.testing.assert_allclose(gated(x, g), ref, atol=1e-6)
