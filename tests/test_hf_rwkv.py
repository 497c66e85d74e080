"""RWKV-4 checkpoints (``linattn_jax.hf.rwkv``) against ``transformers``' own PyTorch
``RwkvForCausalLM`` (CPU, float32, in eval mode: layers rescaled every 2 blocks): a tiny
random model made here with random decays, bonuses, token-shift mixes and LayerNorms (its
``attention_hidden_size`` is ``hidden_size``: ``transformers`` decodes no other): logits to
1e-5 normwise, prefill then decode steps == the full forward, 16 greedy tokens, a
left-padded row == the row alone, the save round trip, ``--config.init_from``, a tied head
with a narrower WKV (``attention_hidden_size`` 24, run by ``transformers`` without its
cache), the bad fields named."""

import numpy as np
import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _rwkv(tie=False, wkv_width=32):
    config = transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=32, attention_hidden_size=wkv_width, intermediate_size=40,
        num_hidden_layers=3, rescale_every=2, layer_norm_epsilon=1e-4, context_length=64,
        tie_word_embeddings=tie,
    )  # fmt: skip
    model = transformers.RwkvForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("time_decay", "time_first")):
                p.copy_(torch.randn_like(p))
            elif "time_mix" in name:
                p.uniform_(0.0, 1.0)
            elif "ln" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "rwkv", _rwkv, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    """``transformers`` rescales its weights in place at its first forward in eval mode: the
    files' tensors are compared before any, ours read back against the original's."""
    ref, directory, model, config = pair
    back = helpers.assert_save_round_trip(model, config, ref, tmp_path / "ours")
    helpers.assert_same_torch_tensors(type(ref).from_pretrained(directory), back)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 9))
    ours = np.asarray(helpers.logits(pair[2], tokens))
    helpers.assert_close_normwise(ours, helpers.torch_logits(back, tokens), RTOL)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, directory, model, _ = pair
    fresh = type(ref).from_pretrained(directory)  # ref's weights are rescaled in place
    helpers.assert_init_from_builds(model, fresh, tmp_path)


def test_tied_head_narrow_wkv_and_bad_fields(pair, tmp_path):
    """A tied head and ``attention_hidden_size`` 24 (``transformers`` runs it without its
    cache only: its state is ``hidden_size`` wide)."""
    torch.manual_seed(1)
    ref = _rwkv(tie=True, wkv_width=24).eval()
    model, config = helpers.from_torch(ref, tmp_path / "tied")
    assert model.head is None and config["tie_word_embeddings"] is True
    assert model.blocks[0].attention.key.kernel.shape == (32, 24)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 7))
    with torch.no_grad():
        theirs = ref(torch.tensor(tokens), use_cache=False).logits.numpy()
    helpers.assert_close_normwise(helpers.logits(model, tokens), theirs)
    _, _, _, config = pair
    fmt = hf.rwkv.FORMAT
    absent = {k: v for k, v in config.items() if k not in ("intermediate_size", "rescale_every")}
    normal = fmt.normalize_config({**absent, "attention_hidden_size": None})
    assert normal["intermediate_size"] == 128 and normal["attention_hidden_size"] == 32
    assert normal["rescale_every"] == 6  # transformers' default
    for field, value, message in [
        ("rescale_every", 1.5, r"rescale_every must be an int, got 1.5"),
        ("attention_hidden_size", 0, r"attention_hidden_size must be an int >= 1"),
        ("layer_norm_epsilon", "small", r"layer_norm_epsilon must be a number"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})


def test_the_docs_weight_table_names_every_rule():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs/guide/rwkv.md").read_text()
    rules = hf.rwkv.MODEL_RULES + hf.rwkv.BLOCK_RULES + (hf.rwkv.HEAD_RULE,)
    for rule in rules:
        name = rule.hf.removesuffix(".weight").removesuffix(".bias").rsplit(".", 1)[-1]
        assert name in page, rule.hf
        for ours in rule.ours:
            assert ours.rsplit(".", 1)[0].rsplit(".", 1)[-1] in page, ours
