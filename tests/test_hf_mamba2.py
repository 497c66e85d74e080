"""Mamba-2 and Bamba checkpoints (``linattn_jax.hf.mamba2``, ``hf.bamba``) against
``transformers``' own PyTorch ``Mamba2ForCausalLM`` and ``BambaForCausalLM`` (CPU, float32,
their pure-torch paths), one tiny random model of each made here with random norms,
``A_log``, ``dt_bias``, ``D`` and convolution biases (so that a mapping error shows): logits
to 1e-5 normwise, 16 greedy tokens, prefill then decode steps against the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import models
from linattn_jax.hf import bamba, mamba2, qwen3_5
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64


def _randomize(model):
    """Random values where the initialisation puts constants (so a mapping error shows)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "D", "conv1d.bias")):
                p.copy_(torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def torch_model():
    config = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_heads=4, head_dim=8,
        expand=2, state_size=6, n_groups=2, conv_kernel=4, chunk_size=8,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return _randomize(transformers.Mamba2ForCausalLM(config).eval())


@pytest.fixture(scope="module")
def torch_bamba():
    config = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, attn_layer_indices=[1],
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=6, mamba_n_groups=2, mamba_chunk_size=8,
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(1)
    return _randomize(transformers.BambaForCausalLM(config).eval())


def _ours(torch_model, module=mamba2):
    """Our ``LanguageModel`` of the torch model's config, its weights through the table."""
    config = module.normalize_config(torch_model.config.to_dict())
    model = models.LanguageModel(**module.model_options(config), rngs=nnx.Rngs(0))
    module.set_norm_eps(model, config)
    tensors = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    params = {".".join(map(str, k)): v for k, v in params.items()}
    table = module.weight_table(config)
    assert sorted(name for name, _ in table) == sorted(tensors)
    for name, rule in table:
        shapes = [params[p].shape for p in rule.ours]
        assert tuple(tensors[name].shape) == qwen3_5.hf_shape(rule.how, shapes), name
        parts = qwen3_5.to_ours(rule.how, tensors[name], shapes)
        for p, part in zip(rule.ours, parts, strict=True):
            params[p].set_value(jnp.asarray(np.array(part)))
    return model, config


def _torch_logits(torch_model, tokens):
    with torch.no_grad():
        return torch_model(torch.from_numpy(np.array(tokens))).logits.numpy()


@pytest.mark.parametrize("which", ["mamba2", "bamba"])
def test_logits_and_greedy_tokens_equal_transformers(which, request):
    torch_model = request.getfixturevalue({"mamba2": "torch_model", "bamba": "torch_bamba"}[which])
    model, _ = _ours(torch_model, {"mamba2": mamba2, "bamba": bamba}[which])
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 13), 2, VOCAB)
    helpers.assert_close_normwise(model(tokens), _torch_logits(torch_model, tokens))
    prompt = tokens[:1, :5]
    ours = model.generate(prompt, 16, temperature=0.0)
    with torch.no_grad():
        theirs = torch_model.generate(
            torch.from_numpy(np.array(prompt)), max_new_tokens=16, do_sample=False,
            min_new_tokens=16,
        ).numpy()  # fmt: skip
    np.testing.assert_array_equal(ours, theirs)


def test_prefill_then_decode_steps_equal_the_full_forward(torch_model):
    model, _ = _ours(torch_model)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 2, VOCAB)
    full = model(tokens)
    logits, state = model(tokens[:, :6], state=model.init_state(2), return_state=True)
    outs = [logits]
    for i in range(6, 9):
        logits, state = model(tokens[:, i : i + 1], state=state, return_state=True)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)


def test_config_round_trips_through_the_model(torch_model):
    model, config = _ours(torch_model)
    derived = mamba2.config_from_model(model)
    for field, value in derived.items():
        if field not in ("architectures", "dtype"):
            assert config[field] == value, field
    with pytest.raises(ValueError, match="n_groups=3 must divide"):
        mamba2.normalize_config({**config, "n_groups": 3})
    with pytest.raises(ValueError, match="model_type must be one of"):
        mamba2.normalize_config({**config, "model_type": "mamba"})
