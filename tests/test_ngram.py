"""Hashed n-gram ids (``layers.ngram``) in 32-bit integers against ``transformers``'
int64 ones (``Qwen4ExpTextNGramEmbedding``, Qwen4-Exp's PLE): every head's row for
tokens near the vocabulary's top (products near ``2**63``), with ``eos`` closing segments
inside the rows and at their start."""

import numpy as np
import pytest

from linattn_jax.layers import ngram

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

EOS = 5


@pytest.mark.parametrize("ngram_size, vocab, base", [(3, 100_003, 1000), (4, 251, 70_000)])
def test_ids_match_transformers_int64(ngram_size, vocab, base):
    config = transformers.Qwen4ExpTextConfig(
        vocab_size=vocab, hidden_size=16, num_hidden_layers=2, ngram_size=ngram_size,
        heads_per_ngram=2, ngram_vocab_size_base=base, eos_token_id=EOS,
        layer_types=["linear_attention"] * 2, ple_layer_ids=[1, 2],
        ple_embed_dim=4 * (ngram_size - 1), num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    table = modeling.Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, 1, 1)
    rows = table.ngram_embedding.weight.shape[0]
    with torch.no_grad():  # row r holds r: the output names the rows read
        table.ngram_embedding.weight.copy_(torch.arange(rows, dtype=torch.float64)[:, None])
    rng = np.random.default_rng(0)
    tokens = rng.integers(vocab - 50, vocab, (3, 11))
    tokens[0, 4] = tokens[1, 0] = tokens[2, 9] = tokens[2, 10] = EOS
    with torch.no_grad():
        table.ngram_embedding.double()
        out = table(torch.tensor(tokens), None).view(3, 11, -1, 2)[..., 0]  # 2 features a head
    history = np.concatenate([np.full((3, ngram_size - 1), EOS), tokens], 1)
    ours = ngram.ngram_ids(
        history, [int(m) for m in table.layer_multipliers], table.head_vocab_sizes,
        table.head_offsets, 2, EOS,
    )[:, ngram_size - 1 :]  # fmt: skip
    assert int(table.layer_multipliers.max()).bit_length() > 40  # the high limbs matter
    np.testing.assert_array_equal(np.asarray(ours), out.numpy().astype(np.int64))


def test_the_layer_matches_transformers_and_decodes_as_its_full_pass():
    """``PerLayerNGrams`` against ``Qwen4ExpTextPLELayer`` (random weights, norms and
    convolution; row 0 left-padded by 3, its padding ``eos`` there as the text model
    makes it), and a prefill then one token at a time equal to the full pass."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tests import helpers

    n, d, b, t = 2, 8, 2, 10
    config = transformers.Qwen4ExpTextConfig(
        vocab_size=97, hidden_size=d, num_hidden_layers=2, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=40, eos_token_id=EOS, layer_types=["linear_attention"] * 2,
        ple_layer_ids=[1, 2], ple_embed_dim=12, ple_conv_kernel_size=3, hc_count=n,
        num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = modeling.Qwen4ExpTextPLELayer(config, 0, 1)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.5)
    table = ref.ple_embedding
    layer = ngram.PerLayerNGrams(
        d, n, multipliers=[int(m) for m in table.layer_multipliers], sizes=table.head_vocab_sizes,
        offsets=table.head_offsets, heads_per_ngram=2, head_dim=3,
        rows=table.ngram_embedding.weight.shape[0], eos=EOS, conv_size=3, rngs=nnx.Rngs(0),
    )  # fmt: skip
    get = lambda p: jnp.asarray(p.detach().numpy())
    layer.table.embedding[...] = get(table.ngram_embedding.weight)
    layer.key_proj.kernel[...] = get(ref.key_proj.weight).T
    layer.value_proj.kernel[...] = get(ref.value_proj.weight).T
    for name in ("norm_key", "norm_query", "norm_conv"):
        getattr(layer, name).scale[...] = get(getattr(ref, name).weight)
    layer.conv[...] = get(ref.conv1d.weight)[:, 0, :].T
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 97, (b, t))
    tokens[1, 5] = EOS
    x = rng.normal(size=(b, t, n * d)).astype(np.float32)
    mask = np.ones((b, t), bool)
    mask[0, :3] = False
    with torch.no_grad():
        theirs = ref(
            torch.tensor(x), torch.tensor(np.where(mask, tokens, EOS)), None,
            conv_mask=torch.tensor(mask.astype(np.int64)),
        ).numpy()  # fmt: skip
    streams = jnp.asarray(x).reshape(b, t, n, d)
    full, _ = helpers.call(layer, streams, jnp.asarray(tokens), key_mask=jnp.asarray(mask))
    helpers.assert_close_normwise(full.reshape(b, t, -1), theirs, 1e-5)
    out, state = helpers.call(
        layer, streams[:, :4], jnp.asarray(tokens[:, :4]), key_mask=jnp.asarray(mask[:, :4])
    )
    outs = [out]
    for i in range(4, t):
        out, state = helpers.call(
            layer, streams[:, i : i + 1], jnp.asarray(tokens[:, i : i + 1]), state=state
        )
        outs.append(out)
    helpers.assert_close_normwise(jnp.concatenate(outs, 1), full, 1e-6)
    assert jax.tree.leaves(state)[0].shape == (b, 2)
