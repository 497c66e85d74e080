"""The trainer under failure: non-finite losses, bad settings, kills, reused and
corrupt workdirs, full disks, torn metrics. Each resume test proves that the rerun
resumed (its first step is the checkpoint's + 1), not only that it finished."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from experiments import reporting, sweep, trainer, validation
from tests.test_experiments import record_train_batches, tiny_config

MQAR = "configs/mqar.py:small"


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture
def train_batches(monkeypatch):
    return record_train_batches(monkeypatch)


def _rows(workdir, split="train"):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["split"] == split]


# -- issue 13 item 10 ----------------------------------------------------------


@pytest.mark.slow
def test_non_finite_loss_names_a_checkpoint_that_resumes(tmp_path, train_batches):
    # Warmup from 0 makes step 1 harmless; step 2's huge learning rate ruins the
    # parameters, which shows as a non-finite loss only at step 3.
    common = ["seq_len=32", "steps=5", "checkpoint_every=1", "log_every=1"]
    with pytest.raises(FloatingPointError, match=r"the last good checkpoint is step \d") as info:
        trainer.train(tiny_config(MQAR, *common, "optim.lr=1e30"), tmp_path)
    kept = int(re.search(r"last good checkpoint is step (\d+)", str(info.value)).group(1))
    train_batches.clear()
    final = trainer.train(tiny_config(MQAR, *common, "optim.lr=1e-3"), tmp_path)
    assert train_batches[0] == kept  # it resumed from the checkpoint named
    assert np.isfinite(final["loss"])


# -- issue 13 item 11 ----------------------------------------------------------

BAD = [
    ("optim.grad_clip=-1", "optim.grad_clip"),
    ("optim.b2=1.5", "optim.b2"),
    ("optim.b1=-0.1", "optim.b1"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"),
    ("optim.weight_decay=-5", "optim.weight_decay"),
    ("optim.lr=-1", "optim.lr"),
    ("stop_at=-3", "stop_at"),
    ("model.chunk_size=-1", "model.chunk_size"),  # 0: the family's default
    ("model.decay=foo", "model.decay"),
    ("model.decay=1.5", "model.decay"),
    ("model.dtype=float33", "model.dtype"),
    ("model.num_features=-3", "model.num_features"),
    ("model.width=0", "model.width"),
    ("model.num_heads=0", "model.num_heads"),
    ("model.depth=0", "model.depth"),
    ("model.method=fast", "model.method"),
    ("model.attention=sparse", "model.attention"),
    ("model.feature_map=nope", "model.feature_map"),
    ("mqar.vocab_size=8", "mqar.vocab_size"),
    ("seed=-1", "seed"),
    ("eval_every=0", "eval_every"),
    ("model.feature_map=favor_plus model.normalize=false", "model.normalize"),
]


@pytest.mark.parametrize("overrides,field", BAD, ids=[b[0] for b in BAD])
def test_bad_settings_fail_naming_the_field_before_the_workdir_is_touched(
    tmp_path, overrides, field, monkeypatch
):
    compute = []
    monkeypatch.setattr(trainer, "build_task", lambda c: compute.append(c))  # any compute
    config = tiny_config(MQAR, "seq_len=32", *overrides.split())
    with pytest.raises(ValueError, match=rf"\b{re.escape(field)}\b") as info:
        trainer.train(config, tmp_path / "run")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists() and not compute


def test_every_attention_kind_has_a_row_of_fields():
    from linattn_jax import layers

    assert set(validation.ATTENTION_FIELDS) == set(layers.ATTENTION_KINDS)


def test_the_defaults_of_fields_a_kind_ignores_are_valid(tmp_path):
    # Softmax attention reads no feature map or chunk size; their defaults pass the checks
    # every field gets (issue 29: bad values fail whatever the kind).
    validation.validate(
        tiny_config(MQAR, "seq_len=32", "model.attention=softmax", "model.chunk_size=0")
    )


# -- issue 13 item 12 ----------------------------------------------------------


class Killed(Exception):
    pass


@pytest.mark.slow
def test_a_resumed_run_rewrites_the_metrics_after_its_checkpoint(
    tmp_path, train_batches, monkeypatch
):
    config = lambda: tiny_config(MQAR, "seq_len=32", "steps=6", "log_every=1")
    build_task = trainer.build_task

    def killed_at_step_4(c):
        task = build_task(c)

        def batch(step, split):
            if split == "train" and step == 3:
                raise Killed  # after steps 1-3 were logged and step 2 was saved
            return task.batch(step, split)

        return dataclasses.replace(task, batch=batch)

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "build_task", killed_at_step_4)
        with pytest.raises(Killed):
            trainer.train(config(), tmp_path)
    assert _rows(tmp_path) == [1, 2, 3]
    train_batches.clear()
    trainer.train(config(), tmp_path)
    assert train_batches[0] == 2  # resumed after checkpoint 2
    assert _rows(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert _rows(tmp_path, "eval") == [2, 4, 6]


# -- issue 13 item 13 ----------------------------------------------------------


@pytest.mark.slow
def test_a_workdir_of_another_config_is_refused(tmp_path, train_batches):
    run = lambda *extra: tiny_config(MQAR, "seq_len=32", "model.feature_map=taylor", *extra)
    trainer.train(run("steps=2"), tmp_path)
    stored = (tmp_path / "config.json").read_text()
    for change, field in [
        ("model.feature_map=elu", "model.feature_map"),  # same shapes: would load silently
        ("model.width=32", "model.width"),  # other shapes: a long checkpoint traceback
        ("seed=1", "seed"),
    ]:
        with pytest.raises(ValueError, match=rf"{re.escape(field)}=.*--config.resume=false") as e:
            trainer.train(run("steps=4", change), tmp_path)
        assert "\n" not in str(e.value)
        assert (tmp_path / "config.json").read_text() == stored
    # The schedule, cadence and logging may change: it resumes.
    train_batches.clear()
    trainer.train(run("steps=4", "optim.lr=3e-3", "log_every=1", "eval_every=4"), tmp_path)
    assert train_batches[0] == 2
    # resume=false starts over.
    train_batches.clear()
    trainer.train(run("steps=2", "model.feature_map=elu", "resume=false"), tmp_path)
    assert train_batches[0] == 0
    assert json.loads((tmp_path / "config.json").read_text())["model"]["feature_map"] == "elu"
    assert _rows(tmp_path) == [2]


# -- issue 13 item 14 ----------------------------------------------------------


@pytest.mark.slow
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path, train_batches, caplog):
    def truncate(step):
        for path in (tmp_path / "checkpoints" / str(step)).rglob("*"):
            if path.is_file() and path.stat().st_size > 1000:
                os.truncate(path, path.stat().st_size // 2)  # a kill mid-write

    trainer.train(tiny_config(MQAR, "seq_len=32", "steps=4"), tmp_path)  # saves 2 and 4
    truncate(4)
    train_batches.clear()
    final = trainer.train(tiny_config(MQAR, "seq_len=32", "steps=6"), tmp_path)
    assert train_batches[0] == 2
    assert np.isfinite(final["loss"])
    assert "checkpoint step 4" in caplog.text and "unreadable" in caplog.text
    assert (tmp_path / "checkpoints_unreadable" / "4").is_dir()
    # None readable: an error, and nothing is moved or started over.
    truncate(4)
    truncate(6)
    with pytest.raises(ValueError, match=r"no checkpoint in .* is readable .*resume=false"):
        trainer.train(tiny_config(MQAR, "seq_len=32", "steps=8"), tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "6"]


def test_an_unwritable_workdir_fails_at_once_in_one_line(tmp_path, monkeypatch):
    compute = []
    monkeypatch.setattr(trainer, "build_task", lambda c: compute.append(c))
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=r"^cannot write to the workdir .*file/run: ") as e:
        trainer.train(tiny_config(MQAR, "seq_len=32"), tmp_path / "file" / "run")
    assert "\n" not in str(e.value) and not compute


@pytest.mark.slow
def test_a_full_disk_fails_at_the_first_save_in_one_line(tmp_path):
    # A file-size limit makes every write past 8 kB fail as on a full disk (even as root).
    script = textwrap.dedent(f"""
        import resource, runpy, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
        sys.argv = ["train", "--config", {MQAR!r}, "--workdir", {str(tmp_path)!r},
                    "--config.steps=20", "--config.checkpoint_every=2", "--config.log_every=1",
                    "--config.eval_every=100", "--config.seq_len=32", "--config.batch_size=4",
                    "--config.model.width=16", "--config.model.depth=1",
                    "--config.progress=false"]
        runpy.run_module("experiments.train", run_name="__main__")
    """)
    # Not the tests' compilation cache: its entries would be written truncated.
    env = os.environ | {"JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=os.getcwd()
    )
    assert out.returncode == 1, out.stderr[-3000:]
    # One line: no traceback of ours, nor of orbax's writer threads (issue 29).
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert re.search(
        r"checkpoint step 2 to .*: File too large \(.* free on the disk of .*\); no checkpoint "
        r"was kept",
        lines[0],
    ), lines[0]
    assert _rows(tmp_path) == [1, 2]  # stopped at the first save


# -- issue 13 item 15 ----------------------------------------------------------


def test_a_torn_metrics_line_does_not_break_the_plots(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    config = tiny_config(MQAR, "seq_len=32")
    (run / "config.json").write_text(config.to_json())
    rows = [
        {"step": 2, "split": "train", "loss": 4.0, "accuracy": 0.1},
        {"step": 2, "split": "eval", "loss": 3.5, "accuracy": 0.2},
    ]
    torn = '{"step": 4, "split": "train", "lo'  # killed mid-write
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)
    reporting.plot_metrics(run)
    assert (run / "curves.png").stat().st_size > 0
    sweep.plot(tmp_path, [("run", config)])
    assert (tmp_path / "results.png").stat().st_size > 0


# -- issue 29 ------------------------------------------------------------------


def _train_cli(tmp_path, *extra, before="", cache=True):
    """``python -m experiments.train`` on a tiny MQAR run in ``tmp_path``, in a subprocess
    (stderr as a terminal sees it), after the Python lines ``before``; ``cache=False``: not
    through the tests' compilation cache (a process that limits file sizes would write
    its entries truncated)."""
    script = textwrap.dedent(before) + textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["train", "--config", {MQAR!r}, "--workdir", {str(tmp_path)!r},
                    "--config.steps=20", "--config.checkpoint_every=2", "--config.log_every=1",
                    "--config.eval_every=100", "--config.seq_len=32", "--config.batch_size=4",
                    "--config.model.width=16", "--config.model.depth=1",
                    "--config.progress=false", *{list(extra)!r}]
        runpy.run_module("experiments.train", run_name="__main__")
    """)
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    if not cache:
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=os.getcwd()
    )


@pytest.mark.slow
def test_a_full_disk_at_a_later_save_is_one_line_naming_the_step(tmp_path):
    # The disk fills after the first checkpoint: the writes of step 4's save fail inside
    # orbax's writer threads (a file-size limit makes them fail as on a full disk).
    out = _train_cli(
        tmp_path,
        before="""
        import resource, signal
        from experiments import checkpoints
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        save = checkpoints.Checkpointer.save
        def fill_the_disk_after_the_first_save(self, step, *args):
            if step > 2:
                resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
            return save(self, step, *args)
        checkpoints.Checkpointer.save = fill_the_disk_after_the_first_save
        """,
        cache=False,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr[-3000:]  # no thread's traceback either
    assert re.fullmatch(
        rf".*: error: could not write checkpoint step 4 to {re.escape(str(tmp_path))}/checkpoints: "
        rf"File too large \(\S+ \S*B free on the disk of {re.escape(str(tmp_path))}\); the last "
        r"checkpoint kept is step 2 \(free some space, then rerun to resume from it\)",
        lines[0],
    ), lines[0]


@pytest.mark.slow
def test_a_full_disk_names_the_failed_save_not_the_next(tmp_path, monkeypatch):
    # Orbax saves in the background: step 4's save fails with ENOSPC after it started, and
    # shows only when the next save (step 6) or the end waits for it.
    import errno
    import shutil

    import orbax.checkpoint as ocp

    failing = []
    save, wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished

    def save_that_fills_the_disk(self, step, *args, **kwargs):
        if step == 4:
            failing.append(step)
            return True  # started; fails in the background
        return save(self, step, *args, **kwargs)

    def wait_that_reports_it(self):
        if failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.directory / "4"))
        return wait(self)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_that_fills_the_disk)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", wait_that_reports_it)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=3 * 2**20))
    config = tiny_config(MQAR, "seq_len=32", "steps=8")
    with pytest.raises(OSError) as info:
        trainer.train(config, tmp_path)
    assert str(info.value) == (
        f"could not write checkpoint step 4 to {tmp_path}/checkpoints: No space left on device "
        f"(3.0 MiB free on the disk of {tmp_path}); the last checkpoint kept is step 2 (free "
        f"some space, then rerun to resume from it)"
    )
    assert _rows(tmp_path) == [2, 4, 6]  # step 6's save waited for step 4's


def test_every_field_is_checked_whatever_the_kind():
    for kind, bad in [
        ("deltanet", "model.method=fast"),
        ("kda", "model.feature_map=nope"),
        ("softmax", "model.decay=foo"),
        ("gla", "model.num_features=-1"),
    ]:
        config = tiny_config(MQAR, "seq_len=32", f"model.attention={kind}", bad)
        field = bad.split("=")[0]
        with pytest.raises(ValueError, match=rf"^{re.escape(field)} must be .*, got "):
            validation.validate(config)


def test_a_field_the_kind_ignores_does_not_block_a_resume(tmp_path):
    from experiments.checkpoints import prepare_workdir

    run = lambda *extra: tiny_config(MQAR, "seq_len=32", "model.attention=deltanet", *extra)
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)  # a run to resume
    prepare_workdir(run(), tmp_path)
    # DeltaNet reads no feature map, method or decay: changing them resumes ...
    ignored = run("model.feature_map=taylor", "model.method=scan", "model.decay=0.5")
    assert (
        validation.config_changes(json.loads((tmp_path / "config.json").read_text()), ignored) == []
    )
    prepare_workdir(ignored, tmp_path)
    # ... but a field it reads still refuses.
    with pytest.raises(ValueError, match=r"model.chunk_size=8 there, 4 now"):
        prepare_workdir(run("model.chunk_size=4"), tmp_path)


@pytest.mark.slow
def test_no_readable_checkpoint_is_one_line(tmp_path):
    trainer.train(tiny_config(MQAR, "seq_len=32", "steps=4"), tmp_path)  # saves 2 and 4
    for path in (tmp_path / "checkpoints").rglob("*"):
        if path.is_file():
            os.truncate(path, 0)  # a disk that lost them
    out = _train_cli(tmp_path, "--config.steps=6", "--config.model.chunk_size=8")
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(out.stderr.splitlines()) == 1, out.stderr[-3000:]
    assert re.search(r"error: no checkpoint in .* is readable \(step 4: ", out.stderr)
