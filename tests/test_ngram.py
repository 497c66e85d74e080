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
