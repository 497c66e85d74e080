"""The recall-memory experiment: Zoology's MQAR layout, train/test mixes, state sizes,
and the grid's code path end to end on two tiny points."""

import json
import re

import jax
import numpy as np
import pytest

from experiments import configuration, data, recall, tasks
from tests.test_experiments import ELAPSED, record_train_batches


@pytest.fixture(autouse=True)
def _standard_promotion():
    """optax's Adam mixes int and float scalars (see test_experiments.py)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def test_spread_layout_scatters_queries_among_noise_that_is_never_a_key():
    n, t, vocab = 6, 96, 64
    batch = data.mqar_batch(3, 5, 64, t, n, vocab, spread=True)
    gaps = []
    for row, labels in zip(batch.inputs, batch.labels, strict=True):
        pairs = dict(zip(row[0 : 2 * n : 2], row[1 : 2 * n : 2], strict=True))
        asked = np.flatnonzero(labels != data.IGNORE)
        assert len(asked) == n and set(row[asked]) == set(pairs)  # every key asked once
        for pos in asked:
            assert pos >= 2 * n and (pos - 2 * n) % 2 == 0
            assert labels[pos] == pairs[row[pos]] == row[pos + 1]
        rest = np.setdiff1d(np.arange(2 * n, t), np.concatenate([asked, asked + 1]))
        assert np.all(row[rest] >= vocab // 2)  # noise: value tokens only, never a key
        gaps += list((asked - 2 * n) // 2)
    # Zoology's power law: most queries near the context, some far.
    slots = (t - 2 * n) // 2
    assert np.median(gaps) < slots / 3 and max(gaps) > slots / 2
    again = data.mqar_batch(3, 5, 64, t, n, vocab, spread=True)
    np.testing.assert_array_equal(batch.inputs, again.inputs)


def _config(*overrides):
    config = configuration.load_config("configs/recall.py:small")
    for assignment in overrides:
        configuration.override(config, assignment)
    return config


def test_mixes_cycle_train_splits_at_equal_tokens_and_name_the_eval_sets():
    config = _config("batch_size=2", "mqar.train_mix=16:2,32:4", "mqar.test_mix=32:4,64:8")
    task = tasks.build_task(config)
    shapes = [task.batch(step, "train").inputs.shape for step in range(4)]
    assert shapes == [(4, 16), (2, 32), (4, 16), (2, 32)]  # the tokens of 2 x 32 each step
    assert [name for name, _ in task.evals] == ["32x4", "64x8"]
    assert task.evals[1][1](0).inputs.shape == (1, 64)
    np.testing.assert_array_equal(task.evals[0][1](1).inputs, task.evals[0][1](1).inputs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mqar.train_mix=16:2,32"], r"mqar.train_mix must be '' or 'seq_len:num_pairs,...'"),
        (["mqar.test_mix=256:8"], r"mqar.test_mix has seq_len 256 > seq_len=128"),
        (["mqar.train_mix=16:8"], r"mqar.train_mix's 16:8 is too short for MQAR with num_pairs=8"),
        (["mqar.vocab_size=16"], r"mqar.vocab_size=16 has too few keys for num_pairs=8"),
        (["recall.kinds=elu,mamba3"], r"recall.kinds has unknown kinds \['mamba3'\]"),
        (["recall.widths=wide"], r"recall.widths must be a comma-separated list, got 'wide'"),
    ],
)
def test_bad_grids_fail_before_compute(overrides, message):
    with pytest.raises(ValueError, match=message):
        recall.grid(_config(*overrides))


@pytest.mark.parametrize(
    "kind, width, expected",
    [
        ("elu", 32, 32 * 32 + 32),  # S and Z, one head of 32
        ("retnet", 32, 32 * 32),  # no denominator: S alone
        ("based", 32, (1 + 16 + 16**2) * 32 + (1 + 16 + 16**2)),  # Taylor on feature_dim 16
        ("hedgehog", 32, 2 * 32 * 32 + 2 * 32),
        ("deltanet", 64, 64 * 64),
        ("gla", 32, 32 * 32),
        ("mamba2", 32, 64 * 32),  # one SSD head of p = 2 * 32 channels, n = 32: h n p
        ("mamba", 32, 64 * 16),  # 2 * 32 channels of n = 16 states
        ("softmax", 32, 2 * 128 * 32),  # the KV cache at the longest test length
        ("rwkv", 32, 4 * 32),  # the WKV's num, den, m and the previous input, per channel
    ],
)
def test_state_size_is_read_from_the_model(kind, width, expected):
    (_, _, _, run), *_ = recall.grid(_config(f"recall.kinds={kind}", f"recall.widths={width}"))
    assert recall.state_floats(run) == expected


@pytest.mark.slow
def test_two_tiny_points_train_and_make_the_table_and_plot(tmp_path, capsys, monkeypatch):
    args = [
        "--config=configs/recall.py:small",
        f"--workdir={tmp_path}",
        "--config.recall.kinds=elu,deltanet",
        "--config.recall.widths=16",
        "--config.recall.lrs=3e-3",
        "--config.steps=4",
        "--config.batch_size=2",
        "--config.eval_batches=1",
        "--config.eval_every=2",
        "--config.checkpoint_every=2",
        "--config.model.num_heads=1",
        "--config.model.chunk_size=8",
        "--config.progress=false",
        # One layer, two train splits and two test splits (the second longer than any
        # seen in training) of the small config's shortest: each split's length is a
        # compile of each run's steps.
        "--config.model.depth=1",
        "--config.mqar.train_mix=16:2,32:4",
        "--config.mqar.test_mix=32:4,64:8",
        "--config.seq_len=64",
    ]
    assert recall.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"\[1/2\] elu_w16_lr0.003: \d+\.\d% accuracy, eval loss \d\.\d{3} " + ELAPSED, out[0]
    )
    assert out[1].startswith("[2/2] deltanet_w16_lr0.003: ")
    rows = json.loads((tmp_path / "recall.json").read_text())
    assert [(r["kind"], r["state_floats"]) for r in rows] == [
        ("elu", 16 * 16 + 16),
        ("deltanet", 16 * 16),
    ]
    for r in rows:  # each point's accuracy is its run's final evaluation, per test split
        final = json.loads(
            (tmp_path / recall.run_name(r["kind"], 16, 3e-3) / "final.json").read_text()
        )
        assert r["accuracy"] == final["accuracy"]
        assert final["accuracy"] == pytest.approx(
            (final["accuracy@32x4"] + final["accuracy@64x8"]) / 2
        )
    table = (tmp_path / "recall.md").read_text()
    assert "| linear, elu+1 | 16 | 272 | 0.003 |" in table and "| DeltaNet | 16 | 256 |" in table
    assert (tmp_path / "recall.png").stat().st_size > 0
    # A rerun skips the finished runs (no training step) and rewrites the same table;
    # with more steps, each run resumes from its last checkpoint (step 4: batch 4 first).
    asked = record_train_batches(monkeypatch)
    assert recall.main(args) == 0
    assert asked == []
    assert (tmp_path / "recall.md").read_text() == table
    assert recall.main(args + ["--config.steps=6"]) == 0
    assert asked == [4, 5, 6] * 2  # steps 5, 6; then the final checkpoint probes batch 6
