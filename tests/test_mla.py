"""Multi-head latent attention (``layers.LatentAttention``): against an explicit reference
written here (the latent decompressed, ordinary attention), its compressed KV cache
(shapes; prefill + steps == the full forward), masks, segments and a model's ``generate``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax.layers import LatentAttention, LatentKVCache, registry
from linattn_jax.models import LanguageModel

W, H, R, QR, NOPE, ROPE, DV = 16, 2, 6, 5, 4, 4, 3


def make(**options):
    options = dict(
        kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=DV, **options
    )
    layer = LatentAttention(W, H, rngs=nnx.Rngs(0), max_length=16, **options)
    # Random norm gains, so that a norm misplaced shows.
    for norm in (layer.kv_norm, layer.q_a_norm):
        if norm is not None:
            norm.scale[...] = 1 + 0.5 * jax.random.normal(jax.random.key(1), norm.scale.shape)
    return layer


def rms(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def rotate(x, pos, theta=10000.0):
    """Rotate-half RoPE of ``x [t, ..., d]`` at integer positions ``pos [t]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]  # [t, d/2]
    shape = (len(pos),) + (1,) * (x.ndim - 2) + (d // 2,)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference(layer, x, rope):
    """One row ``x [t, width]``, causal, in float64 numpy, written from the paper's form."""
    p = lambda m: np.asarray(m.kernel[...], np.float64)
    x = np.asarray(x, np.float64)
    t = x.shape[0]
    if layer.q_proj is not None:
        q = x @ p(layer.q_proj)
    else:
        q = rms(x @ p(layer.q_a_proj), np.asarray(layer.q_a_norm.scale[...])) @ p(layer.q_b_proj)
    q = q.reshape(t, H, NOPE + ROPE)
    c = x @ p(layer.kv_a_proj)
    latent, k_rope = rms(c[:, :R], np.asarray(layer.kv_norm.scale[...])), c[:, R:]
    kv = (latent @ p(layer.kv_b_proj)).reshape(t, H, NOPE + DV)
    k_nope, v = kv[..., :NOPE], kv[..., NOPE:]
    q_nope, q_rope = q[..., :NOPE], q[..., NOPE:]
    if rope:
        pos = np.arange(t, dtype=np.float64)
        q_rope, k_rope = rotate(q_rope, pos), rotate(k_rope, pos)
    k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, None], (t, H, ROPE))], -1)
    q = np.concatenate([q_nope, q_rope], -1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(NOPE + ROPE)
    scores = np.where(np.tril(np.ones((t, t), bool))[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", weights, v).reshape(t, H * DV)
    return out @ p(layer.out_proj)


def close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-30), np.linalg.norm(a - b)


# One compiled program per shape (the eager op-by-op path costs more on CPU).
call = nnx.jit(lambda layer, x, mask, ids: layer(x, key_mask=mask, segment_ids=ids))
step = nnx.jit(
    lambda layer, x, mask, state: layer(x, key_mask=mask, state=state, return_state=True)
)


@pytest.mark.parametrize("q_lora_rank, rope", [(QR, True), (None, False)])
def test_mla_matches_reference_and_decodes(q_lora_rank, rope):
    layer = make(q_lora_rank=q_lora_rank, rope=rope)
    x = jax.random.normal(jax.random.key(2), (2, 7, W))
    full = call(layer, x, None, None)
    for row in range(2):
        close(full[row], reference(layer, x[row], rope))
    # The cache holds the latent and the rope key only, per token.
    cache = layer.init_state(2, 12)
    assert isinstance(cache, LatentKVCache)
    assert cache.latent.shape == (2, 12, R) and cache.k_rope.shape == (2, 12, ROPE)
    # Prefill 4, then one token at a time: the absorbed form == the full forward.
    y, cache = step(layer, x[:, :4], None, cache)
    outs = [y]
    for i in range(4, 7):
        y, cache = step(layer, x[:, i : i + 1], None, cache)
        outs.append(y)
    close(jnp.concatenate(outs, 1), full)
    assert cache.latent.shape == (2, 12, R) and int(cache.position[0]) == 7


def test_mla_left_padding_and_segments():
    layer = make(q_lora_rank=QR, rope=True)
    key = jax.random.split(jax.random.key(3), 3)
    x, other, nxt = (jax.random.normal(k, (n, W)) for k, n in zip(key, (5, 3, 1), strict=True))
    # Row 0: three padded tokens (NaN there), then x; row 1: x and other packed.
    rows = jnp.stack([jnp.concatenate([jnp.full((3, W), jnp.nan), x]), jnp.concatenate([x, other])])
    mask = jnp.array([[False] * 3 + [True] * 5, [True] * 8])
    ids = jnp.array([[0] * 8, [0] * 5 + [1] * 3])
    y = np.asarray(call(layer, rows, mask, ids))
    assert np.all(np.isfinite(y)) and not np.any(y[0, :3])  # padding outputs zero
    alone = reference(layer, x, True)
    close(y[0, 3:], alone)  # left padding: as alone
    close(y[1, :5], alone)  # each segment as alone (attention and RoPE restart)
    close(y[1, 5:], reference(layer, other, True))
    # The padded prompt prefilled into a cache, then a step: as the prompt alone.
    _, cache = step(layer, rows[:1], mask[:1], layer.init_state(1, 10))
    got, _ = step(layer, nxt[None], None, cache)
    close(got[0, 0], reference(layer, jnp.concatenate([x, nxt]), True)[-1])


def test_mla_options_checked():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        LatentAttention(W, H, qk_rope_head_dim=3, rope=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        LatentAttention(W, H, kv_lora_rank=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rope=True"):
        LatentAttention(W, H, rope_theta=1e4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="unexpected"):
        LatentAttention(W, H, sliding_window=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="head_gate must be True or False, got 1"):
        LatentAttention(W, H, head_gate=1, rngs=nnx.Rngs(0))
    layer = make()
    with pytest.raises(ValueError, match="segment_ids"):
        layer(jnp.zeros((1, 2, W)), segment_ids=jnp.zeros((1, 2), int), return_state=True)
    with pytest.raises(ValueError, match="holds 3 tokens"):
        layer(jnp.zeros((1, 4, W)), state=layer.init_state(1, 3), return_state=True)
    # Every kernel carries logical sharding names.
    for path, param in nnx.iter_graph(make(q_lora_rank=QR)):
        if isinstance(param, nnx.Param) and path[-1] == "kernel":
            assert param.out_sharding is not None and len(param.out_sharding) == 2, path


@pytest.mark.slow  # generate's compile; test_hf_kimi generates through MLA too
def test_mla_kind_in_a_layout_generates():
    model = LanguageModel(
        vocab_size=32, width=W, depth=2, num_heads=H, attention="1 mla : 1 softmax",
        kind_options={"mla": dict(kv_lora_rank=R, qk_rope_head_dim=ROPE, rope=True,
                                  q_lora_rank=QR)},
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    assert isinstance(model.blocks[0].attention, LatentAttention)
    assert registry.get("mla").layer is LatentAttention
    prompt = jnp.array([[3, 1, 4, 1, 5]])
    out = model.generate(prompt, 4, temperature=0.0)
    tokens = np.asarray(out)
    # Greedy decoding == the argmax of the full forward at every generated position.
    logits = nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens[:, :-1]))
    np.testing.assert_array_equal(np.argmax(logits[:, 4:], -1), tokens[:, 5:])
