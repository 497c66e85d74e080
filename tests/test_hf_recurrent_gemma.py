"""RecurrentGemma checkpoints (``linattn_jax.hf.recurrent_gemma``) against ``transformers``'
own PyTorch ``RecurrentGemmaForCausalLM`` (CPU, float32): a tiny random model made here
with both block kinds (two layers of ``block_types`` recurrent, attention, recurrent), a window of 5 tokens, multi-query
attention with q/k/v biases, ``lru_width`` unlike ``hidden_size``, a soft cap small enough
to bite, random ``(1 + w)`` norms, ``recurrent_param`` and biases (gates' and conv's):
logits to 1e-5 normwise past the window, prefill then decode steps == the full forward,
16 greedy tokens, a left-padded row == the row alone, the save round trip,
``--config.init_from``, bad fields."""

import pytest

from linattn_jax import hf
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
RTOL = 1e-5


def _recurrent_gemma():
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, lru_width=24, attention_window_size=5,
        conv1d_width=3, logits_soft_cap=3.0, rms_norm_eps=1e-5, attention_bias=True,
        block_types=["recurrent", "attention", "recurrent"], pad_token_id=0,
    )  # fmt: skip
    model = helpers.randomized_biases(transformers.RecurrentGemmaForCausalLM(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("recurrent_param", "gate_bias")):
                p.normal_(-1.0 if name.endswith("recurrent_param") else 0.0, 1.0)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``: tied."""
    return helpers.torch_pair(tmp_path_factory, "recurrent_gemma", _recurrent_gemma, 0.0)


def test_logits_decoding_past_the_window_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.layout == ("rglru", "local_softmax")
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_pretrained_round_trip_through_transformers(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.recurrent_gemma.FORMAT
    for field, value, message in [
        ("hidden_activation", "relu", r"hidden_activation must be 'gelu_pytorch_tanh'"),
        ("block_types", ["recurrent", "mamba"], r"block_types must be a non-empty list of"),
        ("lru_width", 30, r"num_attention_heads=4 must divide lru_width=30"),
        ("attention_dropout", 0.1, r"attention_dropout must be"),
        ("logits_soft_cap", 0, r"logits_soft_cap must be a finite number > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})
    assert hf.recurrent_gemma.embedding_scale(2560) == 50.5  # sqrt(2560) = 50.596 in bfloat16


def test_the_docs_weight_table_names_every_rule(pair):
    from pathlib import Path

    _, _, _, config = pair
    page = (Path(__file__).parents[1] / "docs/guide/rglru.md").read_text()
    rg = hf.recurrent_gemma
    rules = rg.MODEL_RULES + rg.NORM_RULES + rg.RECURRENT_RULES + rg.MLP_RULES
    for rule in rules + rg.attention_rules(config):  # a row names it, or its sibling
        name = rule.hf.removesuffix(".weight").removesuffix(".bias").rsplit(".", 1)[-1]
        assert rule.hf in page or f"`{name}`" in page, rule.hf
        for ours in rule.ours:
            assert ours in page or f"`{ours.split('.')[-2]}`" in page, ours
