"""Mamba-2 and Bamba checkpoints (``linattn_jax.hf.mamba2``, ``hf.bamba``) against
``transformers``' own PyTorch ``Mamba2ForCausalLM`` and ``BambaForCausalLM`` (CPU, float32,
their pure-torch paths), one tiny random model of each made here with random norms,
``A_log``, ``dt_bias``, ``D`` and convolution biases (so that a mapping error shows): logits
to 1e-5 normwise, 16 greedy tokens, prefill then decode steps against the full forward."""

import jax
import numpy as np
import pytest
from flax import nnx

from linattn_jax import hf, models
from linattn_jax.hf import mamba2
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


@pytest.fixture(scope="module")
def torch_model():
    config = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_heads=4, head_dim=8,
        expand=2, state_size=6, n_groups=2, conv_kernel=4, chunk_size=8,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return helpers.randomized_mamba(transformers.Mamba2ForCausalLM(config).eval())


@pytest.fixture(scope="module")
def torch_bamba():
    config = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, attn_layer_indices=[1],
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=6, mamba_n_groups=2, mamba_chunk_size=8,
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(1)
    return helpers.randomized_mamba(transformers.BambaForCausalLM(config).eval())


@pytest.fixture(scope="module")
def torch_nemotron_h():
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, mamba_num_heads=4,
        mamba_head_dim=8, ssm_state_size=6, n_groups=2, chunk_size=8, layer_norm_epsilon=1e-5,
        pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(2)
    return helpers.randomized_mamba(transformers.NemotronHForCausalLM(config).eval())


def _ours(torch_model, tmp_path):
    """``hf.from_pretrained`` of the directory ``transformers`` saves the torch model to."""
    torch_model.save_pretrained(tmp_path / "hf")
    return hf.from_pretrained(tmp_path / "hf")


@pytest.mark.parametrize("fixture", ["torch_model", "torch_bamba", "torch_nemotron_h"])
def test_logits_and_greedy_tokens_equal_transformers(fixture, request, tmp_path):
    torch_model = request.getfixturevalue(fixture)
    model, _ = _ours(torch_model, tmp_path)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 13), 2, VOCAB)
    helpers.assert_close_normwise(
        helpers.unmasked(model, tokens), helpers.torch_logits(torch_model, tokens)
    )
    helpers.assert_greedy_tokens_match(model, torch_model, tokens[:1, :5])


def test_prefill_then_decode_steps_equal_the_full_forward(torch_model, tmp_path):
    model, _ = _ours(torch_model, tmp_path)
    helpers.assert_decode_steps_and_left_padding(model, VOCAB)


@pytest.mark.parametrize("fixture", ["torch_model", "torch_bamba", "torch_nemotron_h"])
def test_save_load_round_trip_and_transformers_reads_it(fixture, request, tmp_path):
    torch_model = request.getfixturevalue(fixture)
    model, config = _ours(torch_model, tmp_path)
    theirs = helpers.assert_save_round_trip(model, config, torch_model, tmp_path / "ours")
    tokens = jax.random.randint(jax.random.PRNGKey(2), (1, 7), 2, VOCAB)
    helpers.assert_close_normwise(
        helpers.unmasked(model, tokens), helpers.torch_logits(theirs, tokens)
    )
    # Without a config, the model's form picks its model type.
    hf.save_pretrained(model, tmp_path / "bare")
    assert hf.read_config(tmp_path / "bare")["model_type"] == config["model_type"]


def test_bad_configs_are_refused_by_field(torch_model, torch_bamba, torch_nemotron_h, tmp_path):
    _, config = _ours(torch_model, tmp_path)
    unfinished = models.LanguageModel(**mamba2.FORMAT.model_options(config), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"builds another model: blocks\.0\..*epsilon="):
        hf.save_pretrained(unfinished, tmp_path / "unfinished", config)  # finish() not run
    with pytest.raises(ValueError, match="n_groups=3 must divide"):
        mamba2.FORMAT.normalize_config({**config, "n_groups": 3})
    with pytest.raises(ValueError, match="time_step_limit"):
        mamba2.FORMAT.normalize_config({**config, "time_step_limit": [1.0, 0.5]})
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        hf.bamba.FORMAT.normalize_config({**torch_bamba.config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="attn_layer_indices"):
        hf.bamba.FORMAT.normalize_config(
            {**torch_bamba.config.to_dict(), "attn_layer_indices": [5]}
        )
    nemotron = torch_nemotron_h.config.to_dict()
    with pytest.raises(ValueError, match=r"layers_block_type must be in .*got \['gdn'\]"):
        hf.nemotron_h.FORMAT.normalize_config({**nemotron, "layers_block_type": ["gdn", "mlp"]})
    legacy = {k: v for k, v in nemotron.items() if k != "layers_block_type"}
    legacy = hf.nemotron_h.FORMAT.normalize_config({**legacy, "hybrid_override_pattern": "M-*-"})
    assert legacy["layers_block_type"] == nemotron["layers_block_type"]


def test_trainer_fine_tunes_from_a_transformers_checkpoint(torch_nemotron_h, tmp_path):
    """``--config.init_from=DIR`` of a directory ``transformers`` saved: the run's model is
    the checkpoint's (a Nemotron-H: Mamba-2, MLP-only and attention layers), and it trains."""
    from experiments import trainer
    from tests.test_experiments import tiny_config

    model, _ = _ours(torch_nemotron_h, tmp_path)
    path = tmp_path / "hf"
    config = tiny_config("configs/mqar.py:small", f"init_from={path}", "steps=1", "seq_len=32")
    helpers.assert_same_params(model, trainer.build_model(config))
    with jax.numpy_dtype_promotion("standard"):
        final = trainer.train(config, tmp_path / "run")
    assert np.isfinite(final["loss"]) and final["step"] == 1


def test_untied_heads_and_attention_only_hybrids_load_match_and_save(tmp_path):
    """Nemotron-H with ``tie_word_embeddings: true``: ``transformers`` never ties its head (it
    reads and writes its own ``lm_head.weight``), nor do we; Bamba of attention layers only
    (no Mamba-2 layer): each loads, matches and saves."""
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
        layers_block_type=["linear_attention", "full_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, mamba_num_heads=4, mamba_head_dim=8,
        ssm_state_size=6, n_groups=2, chunk_size=8, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(3)
    nemotron = helpers.randomized_mamba(transformers.NemotronHForCausalLM(config).eval())
    model, _ = helpers.assert_matches_and_saves(nemotron, tmp_path / "nemotron", VOCAB)
    assert model.head is not None
    bamba = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, attn_layer_indices=[0, 1],
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=6, mamba_n_groups=2, mamba_chunk_size=8,
    )  # fmt: skip
    torch.manual_seed(4)
    bamba = helpers.randomized_mamba(transformers.BambaForCausalLM(bamba).eval())
    helpers.assert_matches_and_saves(bamba, tmp_path / "bamba", VOCAB)
