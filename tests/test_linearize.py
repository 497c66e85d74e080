"""``experiments.linearize``'s pieces on a tiny softmax teacher (GQA, RoPE, QK-norm):

the swap keeps the teacher's function where it should (a LoLCATs student whose window spans
the sequence is the teacher: its linear layers see softmax's exact kernel there), copies
every other parameter and converts Gated DeltaNet's q/k/v/o; the captured attention inputs
and outputs equal a plain layer-by-layer forward's; stage 1 lowers every swapped layer's
transfer loss, training only the new parameters; LoRA leaves the base weights unchanged and
merges exactly, and the
exported student reads back bit for bit; the KL term is zero for a student equal to its teacher.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.linearize import capture, export, stages, student
from linattn_jax.models import LanguageModel
from tests import helpers

VOCAB, T = 40, 12
SOFTMAX = dict(num_kv_heads=2, head_dim=6, rope=True, qk_norm=True)


@pytest.fixture(scope="module")
def teacher():
    return LanguageModel(
        VOCAB, 16, 3, 4, attention="softmax", kind_options={"softmax": SOFTMAX}, mlp="swiglu",
        rngs=nnx.Rngs(0),
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.PRNGKey(1), (3, T), 0, VOCAB)


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        yield


@nnx.jit
def _logits(model, tokens):
    return model(tokens)


def _flat(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def test_a_window_over_the_sequence_reproduces_the_teacher(teacher, tokens):
    swapped = student.swapped_layers(teacher, "1")
    assert swapped == (0, 2)
    model, new = student.make_student(teacher, swapped, "lolcats", window=T)
    assert model.layout == ("linearized", "softmax", "linearized")
    helpers.assert_close_normwise(_logits(model, tokens), _logits(teacher, tokens), 1e-5)
    ours, theirs = _flat(model), _flat(teacher)
    names = {".".join(map(str, p)) for p in new.paths}
    assert names == {
        f"blocks.{i}.attention.{m}" for i in swapped
        for m in ("q_map.kernel", "q_map.bias", "k_map.kernel", "k_map.bias", "window_factor")
    }  # fmt: skip
    assert set(ours) - names == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value)


def test_gated_deltanet_reuses_the_projections(teacher):
    model, new = student.make_student(teacher, (1,), "gated_deltanet")
    layer, source = model.blocks[1].attention, teacher.blocks[1].attention
    k = source.k_proj.kernel[...].reshape(16, 2, 6)
    np.testing.assert_array_equal(layer.k_proj.kernel[...].reshape(16, 4, 6)[:, 3], k[:, 1])
    np.testing.assert_array_equal(layer.out_proj.kernel[...], source.out_proj.kernel[...])
    np.testing.assert_array_equal(layer.conv.kernel[...][-1], 1.0)
    assert ("blocks", 1, "attention", "beta_proj", "kernel") in new.paths
    assert ("blocks", 1, "attention", "q_proj", "kernel") not in new.paths


def test_bad_layer_choices_are_named(teacher):
    for keep, message in [
        ("every:0", "keep_softmax must be"),
        ("4", r"names \[4\], not softmax layers"),
        ("0,1,2", "no layer left to swap"),
    ]:
        with pytest.raises(ValueError, match=message):
            student.swapped_layers(teacher, keep)
    assert student.swapped_layers(teacher, "every:2") == (0, 2)
    assert student.swapped_layers(teacher, "ranked:1", {0: 0.1, 1: 0.5, 2: 0.2}) == (0, 2)
    with pytest.raises(ValueError, match="kind must be one of"):
        student.make_student(teacher, (0,), "mamba")


def test_captured_inputs_and_outputs_equal_a_plain_forward(teacher, tokens):
    logits, io = jax.jit(lambda m, t: capture.attention_io(nnx.merge(*m), t, (0, 2)))(
        nnx.split(teacher), tokens
    )
    helpers.assert_close_normwise(logits, _logits(teacher, tokens), 1e-6)
    x = teacher.embed(tokens)
    for i, block in enumerate(teacher.blocks):
        h = block.attention_norm(x)
        if i in io:
            helpers.assert_close_normwise(io[i][0], h, 1e-6)
            helpers.assert_close_normwise(io[i][1], block.attention(h), 1e-6)
        x = block(x)


def test_stage_one_lowers_every_layers_loss_and_trains_only_new_parameters(teacher, tokens):
    swapped = (0, 2)
    model, new = student.make_student(teacher, swapped, "lolcats", window=3)
    optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=new)
    before, kept = stages.transfer_eval(teacher, model, tokens, swapped), _flat(model)
    for _ in range(8):
        metrics = stages.transfer_step(teacher, model, optimizer, tokens, swapped, new, 0.1)
    after = stages.transfer_eval(teacher, model, tokens, swapped)
    assert np.all(np.asarray(after) < 0.8 * np.asarray(before)), (before, after)
    assert np.all(np.asarray(metrics["ce"]) > 0)
    names = {".".join(map(str, p)) for p in new.paths}
    for name, value in _flat(model).items():
        assert (name in names) != np.array_equal(value, kept[name]), name


def test_lora_merges_exactly_and_the_export_reads_back(teacher, tokens, tmp_path):
    model, new = student.make_student(teacher, (0, 2), "hedgehog")
    graphdef, base = nnx.graphdef(model), _flat(model)
    stages.add_lora(model, (0, 2), rank=2)
    wrt = nnx.Any(nnx.LoRAParam, new)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=wrt)
    for _ in range(3):
        metrics = stages.finetune_step(teacher, model, optimizer, tokens[:, :-1], tokens[:, 1:],
                                       wrt)  # fmt: skip
    assert float(metrics["kl"]) > 1e-4  # a student unlike its teacher
    adapted = _logits(model, tokens)
    stages.merge_lora(model, (0, 2))
    assert nnx.graphdef(model) == graphdef
    helpers.assert_close_normwise(_logits(model, tokens), adapted, 1e-6)
    export.save_student(model, tmp_path)
    back = export.load_student(tmp_path)
    np.testing.assert_array_equal(_logits(back, tokens), _logits(model, tokens))
    merged = _flat(model)
    for name, value in base.items():
        changed = not np.array_equal(merged[name], value)
        lora = any(f"attention.{p}.kernel" in name for p in stages.PROJECTIONS)
        assert changed == (lora and name.startswith(("blocks.0", "blocks.2")) or name in {
            ".".join(map(str, p)) for p in new.paths}), name  # fmt: skip


def test_kl_is_zero_for_a_student_equal_to_its_teacher(teacher, tokens):
    model, new = student.make_student(teacher, (0, 2), "lolcats", window=T)
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=new)
    metrics = stages.finetune_step(teacher, model, optimizer, tokens, tokens, new)
    assert abs(float(metrics["kl"])) < 1e-7
    logits = _logits(teacher, tokens)
    assert float(stages.kl_to_teacher(logits, logits)) == 0.0
