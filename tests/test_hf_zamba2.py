"""Zamba2 checkpoints (``linattn_jax.hf.zamba2``) against ``transformers``' own PyTorch
``Zamba2ForCausalLM`` (CPU, float32, its pure-torch paths): a tiny random model made here
with every option on (two shared blocks used at three hybrid layers, adapters on q, k, v
and the MLP, RoPE, biases; random norms, ``A_log``, ``dt_bias``, ``D``, adapters and
biases): logits to 1e-5 normwise, prefill then decode steps == the full forward, 16 greedy
tokens, a left-padded row == the row alone, the save round trip (``transformers`` reads it
back, every tensor equal), a file with the tied copies of the shared blocks,
``--config.init_from``, bad fields; packed rows; a plain Mamba-2 layer's tensors (and every
other's) at Zamba2-2.7B's size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax import hf, layers, models
from tests import helpers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
RTOL = 1e-5


def _zamba2():
    config = transformers.Zamba2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3,
        layers_block_type=["hybrid", "hybrid", "hybrid"],
        mamba_d_state=6, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4,
        num_attention_heads=4, num_key_value_heads=4, num_mem_blocks=2, intermediate_size=24,
        use_shared_attention_adapter=True, adapter_rank=3, use_mem_rope=True,
        add_bias_linear=True, chunk_size=8, pad_token_id=0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = helpers.randomized_mamba(transformers.Zamba2ForCausalLM(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adapter_list" in name:
                p.normal_(0.0, 0.3)  # transformers makes them small: a mapping error must show
    return helpers.randomized_biases(model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``(torch model, its directory, our model, our config)``."""
    return helpers.torch_pair(tmp_path_factory, "zamba2", _zamba2, 1.0)


def test_logits_decoding_and_left_padding_match(pair):
    _, _, model, _ = pair
    assert model.shared.layers == (0, 1, 2) and len(model.shared.blocks) == 2
    helpers.assert_matches_decodes_and_pads(pair, VOCAB, RTOL)


def test_save_round_trip_and_the_tied_copies(pair, tmp_path):
    helpers.assert_round_trips(pair, tmp_path)
    # transformers' state dict holds every hybrid layer's shared_transformer (tied copies).
    ref, directory, model, _ = pair
    assert "model.layers.2.shared_transformer.self_attn.q_proj.weight" in ref.state_dict()
    (tmp_path / "full").mkdir()
    helpers.assert_same_params(helpers.load_state_dict(ref, tmp_path / "full", directory), model)


def test_init_from_builds_the_checkpoints_model(pair, tmp_path):
    ref, _, model, _ = pair
    helpers.assert_init_from_builds(model, ref, tmp_path)


def test_bad_fields_are_named(pair):
    _, _, _, config = pair
    fmt = hf.zamba2.FORMAT
    for field, value, message in [
        ("num_mem_blocks", 4, r"at least num_mem_blocks=4 'hybrid' layers, got 3"),
        ("use_long_context", True, r"use_long_context must be False"),
        ("num_attention_heads", 3, r"num_attention_heads=3 must divide 32"),
        ("hidden_act", "relu", r"hidden_act must be .one of .*got .relu."),
        ("num_key_value_heads", 2, r"use_shared_attention_adapter needs num_key_value_heads="),
    ]:
        with pytest.raises(ValueError, match=message):
            fmt.normalize_config({**config, field: value})


def test_shared_blocks_options_are_checked():
    mamba = dict(attention="mamba2", mlp="none", kind_options={"mamba2": dict(head_dim=8)})
    shared = dict(layers=(1,), num_heads=2, mlp_hidden=8, adapter_rank=2)
    build = lambda shared, **more: models.LanguageModel(
        VOCAB, 16, 2, 4, **mamba, shared_blocks=shared, **more, rngs=nnx.Rngs(0)
    )
    alone = lambda **more: layers.SharedBlocks(16, 2, **{**shared, **more}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"layers must increase within \[0, depth=2\), got \(2,\)"):
        alone(layers=(2,))
    with pytest.raises(ValueError, match="activation must be one of"):
        alone(activation="relu")
    with pytest.raises(ValueError, match="shared_blocks needs scan_layers=False"):
        build(shared, scan_layers=True)


def test_packed_rows_equal_each_sequence_alone():
    """``segment_ids``: the shared blocks' attention (RoPE positions too) and the mixers
    restart at each run of equal ids, a repeated id a new sequence."""
    shared = dict(layers=(0, 1), num_heads=2, mlp_hidden=8, adapter_rank=2, rope_theta=1e4)
    model = models.LanguageModel(
        VOCAB, 16, 2, 4, attention="mamba2", mlp="none", shared_blocks=shared,
        kind_options={"mamba2": dict(head_dim=8, state_dim=4)}, rngs=nnx.Rngs(0),
    )  # fmt: skip
    ids = jnp.asarray([[0] * 4 + [1] * 4 + [0] * 4], jnp.int32)  # one compile for the runs
    tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, VOCAB)
    run = nnx.jit(lambda m, t, s: m(t, segment_ids=s))
    packed = run(model, tokens, ids)
    alone = [run(model, tokens[:, a:b], ids[:, a:b] * 0) for a, b in [(0, 4), (4, 8), (8, 12)]]
    helpers.assert_close_normwise(np.asarray(packed), np.concatenate(alone, 1), RTOL)


def test_real_size_config_maps_every_tensor():
    """Zamba2-2.7B's dimensions (``transformers``' defaults: width 2560, 32 heads, 8 Mamba
    heads of 640, state 64) with two shared blocks and q/k/v adapters over 4 layers: every
    tensor's name and shape against ``transformers``' model on the meta device, less the
    tied copies of the shared blocks and the tied head."""
    config = transformers.Zamba2Config(
        num_hidden_layers=4, num_mem_blocks=2, use_shared_attention_adapter=True,
        layers_block_type=["mamba", "hybrid", "hybrid", "hybrid"],
    )  # fmt: skip
    with torch.device("meta"):
        reference = transformers.Zamba2ForCausalLM(config).state_dict()
    tied = ("lm_head.", *(f"model.layers.{i}.shared_transformer." for i in (3,)))
    reference = {n: tuple(x.shape) for n, x in reference.items() if not n.startswith(tied)}
    ours = hf.expected_tensors(hf.zamba2.FORMAT.normalize_config(config.to_dict()))
    assert {n: s for n, (s, _) in ours.items()} == reference
