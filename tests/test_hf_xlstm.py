"""xLSTM checkpoints (``linattn_jax.hf.xlstm``) against ``transformers``' own PyTorch
``xLSTMForCausalLM`` (CPU, float32; its native chunkwise kernel for whole chunks, its
sequence kernel for the rest, its step kernel when decoding), one tiny xLSTM-7B-shaped
model made here (hidden 128: ``transformers``' cache rounds qk_dim up to a multiple of 64,
so its decoding needs one) with random gate weights and norms (so that a mapping error shows):
logits to 1e-5 normwise, 16 greedy tokens, prefill then decode steps against the full
forward, a save/load round trip bit for bit that ``transformers`` reads back."""

import jax
import numpy as np
import pytest
from flax import nnx

from linattn_jax import hf, models
from linattn_jax.hf import xlstm
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(the torch model, ours loaded from its save_pretrained, our config, a work dir)."""
    config = transformers.xLSTMConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_heads=2, chunk_size=4,
        ffn_proj_factor=2.667, ffn_round_up_to_multiple_of=8, output_logit_soft_cap=2.0,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.xLSTMForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif "gate_preact" in name:  # zeros at initialisation: random, near the cap
                p.copy_(3.0 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("xlstm")
    model.save_pretrained(path / "hf")
    ours, ours_config = hf.from_pretrained(path / "hf")
    return model, ours, ours_config, path


def _torch_logits(torch_model, tokens):
    with torch.no_grad():
        return torch_model(torch.from_numpy(np.array(tokens))).logits.numpy()


def test_logits_greedy_tokens_and_decoding_equal_transformers(loaded):
    torch_model, model, _, _ = loaded
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 13), 2, VOCAB)
    full = helpers.unmasked(model, tokens)
    helpers.assert_close_normwise(full, _torch_logits(torch_model, tokens))
    helpers.assert_greedy_tokens_match(model, torch_model, tokens[:1, :5])
    # Prefill then one step per token equals the full forward.
    steps = helpers.prefill_then_steps(model, tokens, 9, model.init_state(2))
    helpers.assert_close_normwise(steps, full)


@pytest.mark.slow
def test_save_load_round_trip_and_transformers_reads_it(loaded):
    torch_model, model, config, path = loaded
    theirs = helpers.assert_save_round_trip(model, config, torch_model, path / "ours")
    tokens = jax.random.randint(jax.random.PRNGKey(2), (1, 7), 2, VOCAB)
    helpers.assert_close_normwise(helpers.unmasked(model, tokens), _torch_logits(theirs, tokens))
    # Without a config, the model's form picks its model type and sizes.
    hf.save_pretrained(model, path / "bare")
    bare = hf.read_config(path / "bare")
    assert bare["model_type"] == "xlstm" and xlstm.sizes(bare) == xlstm.sizes(config)


def test_bad_configs_are_refused_by_field(loaded):
    _, model, config, path = loaded
    with pytest.raises(ValueError, match="weight_mode must be 'single'"):
        xlstm.FORMAT.normalize_config({**config, "weight_mode": "fused"})
    with pytest.raises(ValueError, match="use_bias must be False"):
        xlstm.FORMAT.normalize_config({**config, "use_bias": True})
    with pytest.raises(ValueError, match="num_heads=3 must divide qk_dim=64"):
        xlstm.FORMAT.normalize_config({**config, "num_heads": 3})
    with pytest.raises(ValueError, match="embedding_dim=8 must equal hidden_size=128"):
        xlstm.FORMAT.normalize_config({**config, "embedding_dim": 8})
    with pytest.raises(ValueError, match=r"config\['ffn_proj_factor'\]=4.0, but the model has"):
        hf.save_pretrained(model, path / "bad", {**config, "ffn_proj_factor": 4.0})
    unfinished = models.LanguageModel(**xlstm.FORMAT.model_options(config), rngs=nnx.Rngs(0))
    for _, node in nnx.iter_graph(unfinished):
        if isinstance(node, nnx.RMSNorm):
            node.epsilon = 1e-5
    with pytest.raises(ValueError, match=r"builds another model: .*epsilon="):
        hf.save_pretrained(unfinished, path / "unfinished", config)


def test_the_docs_weight_table_names_every_rule():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs/guide/mlstm.md").read_text()
    for rule in xlstm.MODEL_RULES + xlstm.BLOCK_RULES + (xlstm.HEAD_RULE,):
        name = rule.hf.removesuffix(".weight").removesuffix(".bias").rsplit(".", 1)[-1]
        assert name in page, rule.hf
        for ours in rule.ours:
            assert ours.split(".")[-2] in page, ours


def test_a_config_that_says_tied_keeps_its_own_head(tmp_path):
    """``tie_word_embeddings: true``: ``xLSTMForCausalLM`` ties nothing (its own
    ``lm_head.weight``, read and written), nor do we."""
    config = transformers.xLSTMConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=1, num_heads=2, chunk_size=4,
        ffn_round_up_to_multiple_of=8, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(1)
    model, _ = helpers.assert_matches_and_saves(
        transformers.xLSTMForCausalLM(config).eval(), tmp_path, VOCAB
    )
    assert model.head is not None
