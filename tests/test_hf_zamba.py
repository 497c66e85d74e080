"""Zamba checkpoints (``linattn_jax.hf.zamba``) against ``transformers``' own PyTorch
``ZambaForCausalLM`` (CPU, float32, its pure-torch paths): a tiny random model made here
with every option on (the shared attention block used at two hybrid layers, GQA, Mamba
biases; random norms, ``A_log``, ``dt_proj_bias``, ``D`` and biases): logits to 1e-5
normwise, prefill then decode steps == the full forward, 16 greedy tokens, a left-padded
row == the row alone, the save round trip, ``--config.init_from``, bad fields."""

import pytest
from flax import nnx

from linattn_jax import hf, layers
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
RTOL = 1e-5


def _zamba():
    config = transformers.ZambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
        layers_block_type=["linear_attention", "hybrid", "hybrid"], num_attention_heads=4,
        num_key_value_heads=2, n_mamba_heads=2, mamba_d_state=6, mamba_dt_rank=3,
        mamba_proj_bias=True, use_mamba_kernels=False, pad_token_id=0, bos_token_id=0,
        eos_token_id=1,
    )  # fmt: skip
    model = helpers.randomized_mamba(transformers.ZambaForCausalLM(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_proj_bias"):
                p.copy_(torch.randn_like(p))
    return helpers.randomized_biases(model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "zamba", _zamba, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.shared.layers == (1, 2) and len(model.shared.blocks) == 1
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_round_trip_and_the_tied_copies(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)
    ref, directory, model, _ = pair
    assert "model.layers.2.shared_transf.self_attn.q_proj.weight" in ref.state_dict()
    (tmp_path / "full").mkdir()
    helpers.assert_same_params(helpers.load_state_dict(ref, tmp_path / "full", directory), model)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    for field, value, message in [
        ("n_mamba_heads", 3, r"n_mamba_heads=3 must divide 32"),
        ("attention_hidden_size", 8, r"attention_hidden_size must be 2 hidden_size=32, got 8"),
        ("hidden_mamba_act", "relu", r"hidden_mamba_act must be .*got .relu."),
        ("layers_block_type", ["linear_attention"] * 3, r"must have a 'hybrid' layer"),
    ]:
        with pytest.raises(ValueError, match=message):
            hf.zamba.FORMAT.normalize_config({**config, field: value})
    with pytest.raises(ValueError, match="heads=3 must divide the inner width 32"):
        layers.MambaMixer(16, heads=3, rngs=nnx.Rngs(0))


def test_default_layer_pattern_is_transformers():
    """No ``layers_block_type``: two Mamba layers, a hybrid, then every
    ``attn_layer_period``-th from ``attn_layer_offset``, as ``transformers`` derives it."""
    config = transformers.ZambaConfig(num_hidden_layers=13, n_mamba_heads=1)
    raw = {**config.to_dict(), "layers_block_type": None}
    ours = hf.zamba.FORMAT.normalize_config(raw)
    assert ours["layers_block_type"] == list(config.layers_block_type)


def test_real_size_config_maps_every_tensor():
    """Zamba-7B's dimensions (``transformers``' defaults: width 3712, 16 heads, two Mamba
    heads, state 16) over 8 layers (two hybrid): every tensor's name and shape against
    ``transformers``' model on the meta device, less the tied copy of the shared block and
    the tied head."""
    config = transformers.ZambaConfig(num_hidden_layers=8)
    with torch.device("meta"):
        reference = transformers.ZambaForCausalLM(config).state_dict()
    tied = ("lm_head.", *(f"model.layers.{i}.shared_transf." for i in (7,)))
    assert config.layers_block_type.count("hybrid") == 2 and config.layers_block_type[7] == "hybrid"
    reference = {n: tuple(x.shape) for n, x in reference.items() if not n.startswith(tied)}
    ours = hf.expected_tensors(hf.zamba.FORMAT.normalize_config(config.to_dict()))
    assert {n: s for n, (s, _) in ours.items()} == reference
