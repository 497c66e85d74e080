"""``python -m experiments.linearize`` end to end, a few steps of each stage: on tiny Llama
and Qwen3 directories made by ``transformers`` (bytes as token ids) and on a tiny softmax teacher
trained by the command itself; the report's files and fields, the student read back from
its directory with the same logits, a rerun that resumes (nothing trained again), and a
workdir of another config refused; a hybrid teacher's student saved as its Hugging Face model
type."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.linearize import __main__ as command
from experiments.linearize import export, stages, student
from linattn_jax import hf
from tests import helpers

TINY = [
    "--config.batch_size=2", "--config.seq_len=24", "--config.eval_batches=1",
    "--config.eval_every=2", "--config.log_every=1", "--config.checkpoint_every=2",
    "--config.transfer.steps=2", "--config.finetune.steps=2", "--config.finetune.lora_rank=2",
    "--config.copy_batches=1", "--config.teacher.text.num_files=1",
    "--config.student.window=4", "--config.progress=false",
]  # fmt: skip


def _run(workdir, *extra):
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        return command.main(["--config", "configs/linearize.py:small", "--workdir", str(workdir),
                             *TINY, *extra])  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf_dir(request, tmp_path_factory):
    """A tiny random model of ``transformers``' (bytes as its tokens), saved."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    if request.param == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    else:  # QK-norms
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**sizes))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path


def _check_report(workdir, results):
    on_disk = json.loads((workdir / "results.json").read_text())
    for stage in ("teacher", "transfer", "finetune", "scratch"):
        assert {"loss", "tokens"} <= set(on_disk[stage]) and np.isfinite(on_disk[stage]["loss"])
    assert on_disk["transfer"]["tokens"] == on_disk["finetune"]["tokens"] == 2 * 2 * 24
    assert on_disk["scratch"]["tokens"] == 4 * 2 * 24
    assert (workdir / "results.png").is_file() and "| teacher" in (
        workdir / "results.md"
    ).read_text()
    model = export.load_student(on_disk["student_dir"])
    assert list(model.layout) == on_disk["layout"] == results


def test_an_hf_directory(hf_dir, tmp_path, capsys):
    name, path = hf_dir
    workdir = tmp_path / "run"
    assert _run(workdir, f"--config.teacher_dir={path}") == 0
    _check_report(workdir, ["linearized", "linearized"])
    assert json.loads((workdir / "results.json").read_text())["teacher"]["tokens"] == 0
    if name != "llama":
        return
    before = (workdir / "transfer" / "metrics.jsonl").read_text()
    assert _run(workdir, f"--config.teacher_dir={path}") == 0  # resumes: nothing retrained
    assert (workdir / "transfer" / "metrics.jsonl").read_text() == before
    capsys.readouterr()
    assert _run(workdir, f"--config.teacher_dir={path}", "--config.finetune.steps=3") == 2
    assert "holds a run of another config (finetune.steps: 2 -> 3)" in capsys.readouterr().err


def test_a_teacher_trained_here_and_a_gated_deltanet_student(tmp_path):
    workdir = tmp_path / "run"
    teacher = ["--config.teacher.steps=2", "--config.teacher.model.width=16",
               "--config.teacher.model.depth=2", "--config.teacher.seq_len=24",
               "--config.teacher.batch_size=2", "--config.teacher.eval_batches=1",
               "--config.teacher.text.sample_length=2"]  # fmt: skip
    assert _run(workdir, *teacher, "--config.student.kind=gated_deltanet",
                "--config.student.keep_softmax=ranked:1") == 0  # fmt: skip
    results = json.loads((workdir / "results.json").read_text())
    assert results["teacher"]["tokens"] == 2 * 2 * 24
    kept = max(results["transfer"]["layer_losses"], key=results["transfer"]["layer_losses"].get)
    layout = ["gated_deltanet", "gated_deltanet"]
    layout[int(kept)] = "softmax"
    _check_report(workdir, layout)


def test_a_hybrid_teachers_student_is_saved_as_its_model_type(tmp_path):
    """A Qwen3.5 teacher's softmax layer made Gated DeltaNet (of its own dimensions): the
    student is a Qwen3.5 model, saved by ``hf.save_pretrained``, read back bit for bit and
    run by ``transformers`` with the same logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_num_value_heads=2, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(tmp_path / "teacher")
    teacher = hf.from_pretrained(tmp_path / "teacher", "float32")[0]
    model, _ = student.make_student(teacher, (1,), "gated_deltanet")
    how = export.save_student(model, tmp_path / "student", teacher)
    assert how.startswith("Hugging Face qwen3_5_text directory"), how
    back = export.load_student(tmp_path / "student")
    ours, theirs = (dict(nnx.to_flat_state(nnx.state(m))) for m in (model, back))
    assert ours.keys() == theirs.keys() and back.layout == model.layout
    for path, variable in ours.items():
        np.testing.assert_array_equal(theirs[path].get_value(), variable.get_value())
    tokens = np.random.default_rng(0).integers(0, 64, (2, 9))
    logits = np.asarray(stages.logits(model, tokens))
    ref = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path / "student").eval()
    with torch.no_grad():  # no cache: transformers' mask wants an attention layer for one
        expected = ref(torch.tensor(tokens), use_cache=False).logits.numpy()
    helpers.assert_close_normwise(logits, expected, 1e-5)
