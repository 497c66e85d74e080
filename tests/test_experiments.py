"""Training experiments: data, configs, a few steps of each, resumption, sharding."""

import dataclasses
import json
import re

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments import configuration, data, reporting, sweep, trainer
from linattn_jax import layers


@pytest.fixture(autouse=True)
def _standard_promotion():
    """optax's Adam mixes int and float scalars, which strict promotion rejects; the
    library itself stays under the strict mode of tests/conftest.py."""
    with jax.numpy_dtype_promotion("standard"):
        yield


TINY = [
    "steps=4",
    "batch_size=4",
    "eval_batches=1",
    "log_every=2",
    "eval_every=2",
    "checkpoint_every=2",
    "progress=false",
    "model.width=16",
    "model.num_heads=2",
    "model.depth=1",
    "model.chunk_size=8",
]

# A run's time as the run lines print it (reporting.elapsed): "42s", or "1m08s" past a
# minute, whatever the machine's speed.
ELAPSED = r"\((?:\d+m\d{2}|\d+)s\)"


def tiny_config(spec, *extra):
    config = configuration.load_config(spec)
    for assignment in TINY + list(extra):
        configuration.override(config, assignment)
    return config


def record_train_batches(monkeypatch) -> list[int]:
    """The steps of the training batches that runs ask for, in order (the first one
    is where a run starts: a resumed run's first step is that + 1)."""
    asked = []
    build_task = trainer.build_task

    def recording(config):
        task = build_task(config)

        def batch(step, split):
            if split == "train":
                asked.append(step)
            return task.batch(step, split)

        return dataclasses.replace(task, batch=batch)

    monkeypatch.setattr(trainer, "build_task", recording)
    return asked


def test_mqar_batches_recall_the_context():
    batch = data.mqar_batch(0, 7, 3, 40, 5, 32)
    for row, labels in zip(batch.inputs, batch.labels, strict=True):
        pairs = dict(zip(row[0:10:2], row[1:10:2], strict=True))
        asked = np.flatnonzero(labels != data.IGNORE)
        assert len(asked) == 5
        for pos in asked:
            assert labels[pos] == pairs[row[pos]] == row[pos + 1]
    again = data.mqar_batch(0, 7, 3, 40, 5, 32)
    np.testing.assert_array_equal(batch.inputs, again.inputs)  # a function of (seed, step)


def test_listops_labels_match_an_independent_evaluation():
    batch = data.listops_batch(1, 0, 16, 64, max_depth=4, max_args=4)
    for row, label, mask in zip(batch.inputs, batch.labels, batch.key_mask, strict=True):
        assert data.listops_value(row) == label
        np.testing.assert_array_equal(mask, row != 0)
    assert data.listops_value([12, 1 + 3, 13, 1 + 1, 1 + 7, 1 + 5, 15, 15]) == 5  # MAX 3 MED(1,7,5)


def test_text_split_is_fixed_and_local():
    train, val = data.stdlib_text(4, 0.25)
    train2, _ = data.stdlib_text(4, 0.25)
    np.testing.assert_array_equal(train, train2)
    assert len(val) > 0 and abs(len(val) / (len(train) + len(val)) - 0.25) < 0.01
    batch = data.text_batch(train, 0, 0, 2, 16)
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.labels[:, :-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", ["configs/mqar.py:small", "configs/listops.py:small", "configs/text_lm.py:small"]
)
def test_each_config_trains(spec, tmp_path):
    config = (
        tiny_config(spec, "seq_len=32", "text.sample_length=8")
        if "text" in spec
        else tiny_config(spec, "seq_len=32")
    )
    final = trainer.train(config, tmp_path)
    assert np.isfinite(final["loss"]) and 0 <= final["accuracy"] <= 1
    for name in ("final.json", "final.md", "metrics.jsonl", "curves.png", "config.json"):
        assert (tmp_path / name).exists(), name
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows} == {"train", "eval"}
    assert all(r["tokens_per_s"] > 0 for r in rows if r["split"] == "train")
    if "text" in spec:
        assert "bits_per_byte" in final and final["sample"].startswith("def ")


def _final_checkpoint(workdir, step):
    with ocp.CheckpointManager(workdir / "checkpoints") as manager:
        return manager.restore(step, args=ocp.args.StandardRestore())


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_parameters(tmp_path, monkeypatch):
    spec = "configs/mqar.py:small"
    straight = trainer.train(tiny_config(spec, "seq_len=32", "steps=6"), tmp_path / "a")
    stopped = trainer.train(tiny_config(spec, "seq_len=32", "steps=6", "stop_at=4"), tmp_path / "b")
    assert stopped == {"stopped_at": 4}
    batches = record_train_batches(monkeypatch)
    resumed = trainer.train(tiny_config(spec, "seq_len=32", "steps=6"), tmp_path / "b")
    assert batches[0] == 4  # it resumed: its first step is 5
    assert resumed == straight
    chex.assert_trees_all_equal(
        _final_checkpoint(tmp_path / "a", 6), _final_checkpoint(tmp_path / "b", 6)
    )


@pytest.mark.slow
def test_sweep_writes_a_table_and_a_plot(tmp_path, capsys):
    sweep.main(
        [
            "--config",
            "configs/mqar.py:small",
            "--sweep",
            "attention=softmax,taylor",
            "--workdir",
            str(tmp_path),
        ]
        + [f"--config.{a}" for a in TINY + ["seq_len=32"]]
    )
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"softmax: \d+\.\d% accuracy, eval loss \d\.\d{3} " + ELAPSED, lines[0])
    assert lines[1].startswith("linear_taylor: ")  # one line per run, as it finishes
    table = (tmp_path / "results.md").read_text()
    assert "| mqar | softmax |" in table and "| mqar | linear | taylor |" in table
    assert (tmp_path / "results.png").stat().st_size > 0


def test_elapsed_matches_the_pattern_of_the_run_lines():
    for seconds in (0, 0.4, 9.6, 59.4, 59.6, 68, 600, 3600, 7322.5):
        assert re.fullmatch(ELAPSED, f"({reporting.elapsed(seconds)})"), seconds
    assert [reporting.elapsed(s) for s in (7, 68)] == ["7s", "1m08s"]


def test_bad_configs_fail_before_compute(tmp_path):
    cases = [
        (["optim.lr=-1"], r"optim.lr must be a number > 0, got -1.0"),
        (
            ["model.attention=sparse"],
            re.escape(f"model.attention must be one of {layers.ATTENTION_KINDS}"),
        ),
        (["model.feature_map=nope"], r"feature_map must be one of"),
        (["seq_len=8"], r"seq_len=8 is too short for MQAR with mqar.num_pairs=8"),
        (["batch_size=0"], r"batch_size must be an integer >= 1, got 0"),
        (["model.num_heads=3"], r"model.num_heads=3 must divide model.width=16"),
        (["mesh.sequence=3"], r"mesh.sequence=3 must divide the 1 devices"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            trainer.train(tiny_config("configs/mqar.py:small", *overrides), tmp_path)
    assert not (tmp_path / "checkpoints").exists()
    config = configuration.load_config("configs/mqar.py:small")
    with pytest.raises(
        ValueError, match=r"unknown config field 'model.widht' \(did you mean 'model.width'\?\)"
    ):
        configuration.override(config, "model.widht=3")
    with pytest.raises(ValueError, match=r"unknown variant 'big'"):
        configuration.load_config("configs/mqar.py:big")


def test_non_finite_loss_stops_with_a_message(tmp_path):
    # The parameters after step 2 overflow: that shows at step 3's forward, which the
    # trainer checks before saving them, so no checkpoint of them is kept.
    config = tiny_config("configs/mqar.py:small", "seq_len=32", "steps=6", "optim.lr=1e30")
    with pytest.raises(
        FloatingPointError,
        match=r"loss becomes nan at step 3 with the parameters after step 2, which are not "
        r"saved; stopping: no checkpoint had been saved yet",
    ):
        trainer.train(config, tmp_path)
    with ocp.CheckpointManager(tmp_path / "checkpoints") as manager:
        assert manager.latest_step() is None
