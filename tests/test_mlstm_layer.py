"""The mLSTM layer (``linattn_jax.layers.MLSTMLayer``) against ``transformers``' own torch
``xLSTMLayer`` (CPU, float32; its native chunkwise kernel for whole chunks, its sequence
kernel for the rest, its step kernel for one token), a tiny random layer made here with
random gate weights and norms (so that a mapping error shows): outputs and states to
1e-5 normwise, prefill then decode steps; and the block in a hybrid layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import layers, models
from linattn_jax.ops import mlstm
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
xlstm = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")

W, H, B, T = 16, 2, 2, 11


@pytest.fixture(scope="module")
def layer_pair():
    """(torch xLSTMLayer, the same weights in an MLSTMLayer)."""
    config = transformers.xLSTMConfig(
        hidden_size=W, num_heads=H, num_hidden_layers=1, qk_dim_factor=0.5, v_dim_factor=1.0,
        chunk_size=4, gate_soft_cap=15.0, use_bias=False, vocab_size=8,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = xlstm.xLSTMLayer(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:  # gates included: their pre-activations reach the soft cap
                p.copy_(torch.randn_like(p) * (3.0 if "gate" in name else 0.3))
    layer = layers.MLSTMLayer(W, H, chunk_size=4, rngs=nnx.Rngs(0))
    as_jax = lambda t: jnp.asarray(t.detach().numpy())
    for name in ("q", "k", "v", "ogate_preact", "igate_preact", "fgate_preact", "out_proj"):
        src, dst = getattr(ref, name), getattr(layer, name)
        dst.kernel[...] = as_jax(src.weight).T
        if src.bias is not None:
            dst.bias[...] = as_jax(src.bias)
    layer.multihead_norm.weight[...] = as_jax(ref.multihead_norm.weight)
    return ref, layer


def test_layer_equals_transformers_prefill_and_steps(layer_pair):
    ref, layer = layer_pair
    x = np.array(jax.random.normal(jax.random.PRNGKey(1), (B, T, W)), np.float32)
    with torch.no_grad():
        expected, (c, n, m) = ref(torch.from_numpy(x[:, :8]))
        steps = [expected.numpy()]
        state = (c, n, m)
        for t in range(8, T):
            y, state = ref(torch.from_numpy(x[:, t : t + 1]), state)
            steps.append(y.numpy())
        rest, _ = ref(torch.from_numpy(x[:, 8:]), (c, n, m))
    expected_steps = np.concatenate(steps, 1)
    out, s = helpers.call(
        layer, jnp.asarray(x[:, :8]), state=layer.init_state(B), return_state=True
    )
    helpers.assert_close_normwise(out, expected.numpy())
    helpers.assert_close_normwise(tuple(s), (c.numpy(), n.numpy(), m.numpy()[..., 0]))
    outs = [out]
    for t in range(8, T):
        y, s = helpers.call(layer, jnp.asarray(x[:, t : t + 1]), state=s, return_state=True)
        outs.append(y)
    helpers.assert_close_normwise(jnp.concatenate(outs, 1), expected_steps)
    helpers.assert_close_normwise(tuple(s), tuple(np.asarray(z)[..., 0] if z.ndim == 3 and
                                  z.shape[-1] == 1 else z.numpy() for z in state))  # fmt: skip
    # The sequence kernel (3 tokens, fewer than a chunk) from the chunkwise one's state.
    helpers.assert_close_normwise(helpers.call(layer, jnp.asarray(x[:, 8:]), state=mlstm.State(
        jnp.asarray(c.numpy()), jnp.asarray(n.numpy()), jnp.asarray(m.numpy()[..., 0])
    )), rest.numpy())  # fmt: skip


@pytest.mark.slow
def test_block_in_a_hybrid_layout_decodes_as_it_runs():
    """``"1 mlstm : 1 softmax"`` with SwiGLU: prefill + decode == full forward, and a padded
    row equals itself alone."""
    model = models.LanguageModel(
        29, W, 2, H, attention="1 mlstm : 1 softmax", mlp="swiglu", rngs=nnx.Rngs(2),
        kind_options={"mlstm": dict(chunk_size=4), "softmax": dict(max_length=16)},
    )  # fmt: skip
    tokens = jax.random.randint(jax.random.PRNGKey(3), (B, 9), 0, 29)
    full = helpers.unmasked(model, tokens)  # jitted, as the rest (eager: op by op, slowly)
    steps = helpers.prefill_then_steps(model, tokens, 6, model.init_state(B, 16))
    helpers.assert_close_normwise(steps, full)
    mask = jnp.arange(9)[None, :] >= jnp.asarray([[0], [3]])
    padded = helpers.forward(model, tokens, mask)
    alone = helpers.unmasked(model, tokens[1:, 3:])
    helpers.assert_close_normwise(padded[1, 3:], alone[0])
