"""One run over several processes: two real processes on localhost train as one process of
as many devices does, only process 0 writes the workdir's files, and a kill of both resumes;
the ``distributed`` fields are checked before JAX's runtime starts."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import distributed, trainer, validation
from experiments.configuration import load_config, override
from tests.test_experiments import TINY

ROOT = Path(__file__).parents[1]
MQAR = "configs/mqar.py:small"
# Checkpoints at steps 2 and 4, eval at 4, every step logged.
RUN = [
    *(f"--config.{a}" for a in TINY),
    "--config.seq_len=32",
    "--config.steps=4",
    "--config.batch_size=8",
    "--config.log_every=1",
    "--config.eval_every=4",
    "--config.progress=true",
    "--config.optim.accumulate=2",  # micro-batches split over the data devices too
]
# The entry point, where HANG_AT=N makes the loop wait forever for step N + 1's batch (a
# run to kill once checkpoint N is on disk): the second time it is asked for, the first
# being the check of the parameters before checkpoint N is saved.
MAIN = textwrap.dedent("""
    import dataclasses, os, sys, time
    from experiments import train, trainer
    hang_at, build_task = int(os.environ.get("HANG_AT", -1)), trainer.build_task
    def hanging(config):
        task, asked = build_task(config), []
        def batch(step, split):
            asked.append((step, split))
            while asked.count((hang_at, "train")) > 1:
                time.sleep(1)
            return task.batch(step, split)
        return dataclasses.replace(task, batch=batch)
    trainer.build_task = hanging
    sys.exit(train.main(sys.argv[1:]))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return env | {"XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"} | extra


def _start(workdir, devices, *argv, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", MAIN, "--config", MQAR, "--workdir", str(workdir), *RUN, *argv],
        env=_env(devices, **env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def _running(*procs: subprocess.Popen):
    """The processes, killed (and reaped) if still running at the end."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def _processes(workdir, **env):
    """The two processes of a run (2 CPU devices each), as ``_running``."""
    address = f"--config.distributed.coordinator_address=127.0.0.1:{_free_port()}"
    argv = (address, "--config.distributed.num_processes=2")
    return _running(
        *(_start(workdir, 2, *argv, f"--config.distributed.process_id={i}", **env) for i in (0, 1))
    )


def _finish(procs, timeout=240) -> list[str]:
    """The processes' stdouts, once both exited 0."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def _rows(workdir, split="train"):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


@pytest.mark.slow
def test_two_processes_train_as_one_write_once_and_resume_after_a_kill(tmp_path):
    # One process of 4 devices (the same 4-way data mesh), alongside. The two processes
    # compile afresh, their cache unused (jaxlib 0.12.1's programs read back from it
    # deadlock): the resume would read back the first run's programs.
    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")}
    with _running(_start(tmp_path / "one", 4)) as one:
        with _processes(tmp_path / "two", HANG_AT="2", **cache) as procs:
            checkpoint = tmp_path / "two" / "checkpoints" / "2"
            deadline = time.monotonic() + 240
            while not checkpoint.is_dir() and time.monotonic() < deadline:
                if any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.5)
            for p in procs:
                p.send_signal(signal.SIGKILL)
            if not checkpoint.is_dir():
                pytest.fail(f"no checkpoint 2 before the kill: {procs[0].communicate()[1][-3000:]}")
        assert [r["step"] for r in _rows(tmp_path / "two")] == [1, 2]
        with _processes(tmp_path / "two", **cache) as procs:
            first, second = _finish(procs)
        single = _finish(one)[0]
    assert not list((tmp_path / "cache").rglob("*"))

    # It resumed: the resume line, then step 3 first.
    steps = [int(s) for s in re.findall(r"^step (\d+)/4 \| loss", first, re.M)]
    assert f"resuming from step 2 of {tmp_path / 'two'}" in first and steps == [3, 4], first
    assert "saved checkpoint 4" in first
    assert not re.search(r"^(step|resuming|saved)", second, re.M), second  # process 1: silent
    # One row per step and evaluation (process 0's), equal to the one process's.
    two, four = _rows(tmp_path / "two"), _rows(tmp_path / "one")
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    assert [r["step"] for r in _rows(tmp_path / "two", "eval")] == [4]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in four], rtol=1e-6)
    final = json.loads((tmp_path / "two" / "final.json").read_text())
    expected = json.loads(single[single.index("{") :])
    for key in ("loss", "accuracy"):  # summed in another order across processes
        np.testing.assert_allclose(final[key], expected[key], rtol=1e-6)
    assert json.loads(first[first.index("{") :]) == final and "{" not in second


def test_the_distributed_fields_are_checked_before_the_runtime_starts(tmp_path):
    cases = [
        ("num_processes=-1", r"distributed.num_processes must be an integer >= 0"),
        ("process_id=-2", r"distributed.process_id must be an integer >= -1"),
        ("coordinator_address=localhost", r"distributed.coordinator_address must be '' "),
        ("cpu_collectives=nccl", r"distributed.cpu_collectives must be one of \('gloo', 'mpi'\)"),
        ("process_id=1", r"distributed.process_id=1 needs distributed.num_processes > 1"),
        (
            "coordinator_address=10.0.0.1:1234",
            r"distributed.coordinator_address='10.0.0.1:1234' needs distributed.num_processes",
        ),
    ]
    for assignment, message in cases:
        config = load_config(MQAR)
        override(config, f"distributed.{assignment}")
        with pytest.raises(ValueError, match=message):
            validation.validate_distributed(config)
        with pytest.raises(ValueError, match=message):
            trainer.train(config, tmp_path)
    config = load_config(MQAR)
    for assignment in ("num_processes=2", "process_id=2"):
        override(config, f"distributed.{assignment}")
    with pytest.raises(ValueError, match=r"process_id=2 must be below .*num_processes=2"):
        distributed.initialize(config)
    assert not (tmp_path / "config.json").exists()

    # This process has used its devices (a sweep would have): too late to join others.
    jax.devices()
    override(config, "distributed.process_id=0")
    with pytest.raises(ValueError, match=r"must start before anything uses a device"):
        distributed.initialize(config)


def test_multihost_without_a_cluster_names_the_fields_to_set(tmp_path):
    argv = ["--config", MQAR, "--workdir", str(tmp_path / "run"), "--multihost"]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.train", *argv],
        env=_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert re.fullmatch(
        r"python -m experiments.train: error: jax.distributed.initialize: .* \(no cluster "
        r"detected\): set distributed.coordinator_address, distributed.num_processes and "
        r"distributed.process_id, got '', 0 and -1\n",
        out.stderr,
    ), out.stderr
    assert not (tmp_path / "run").exists()


def test_the_heartbeat_finds_jax_private_key_value_store(tmp_path):
    """``distributed.client_state`` reads JAX's private ``jax._src.distributed.global_state``
    (JAX has no public handle on the coordinator's key-value store): on a JAX where it moved,
    the heartbeat and the supervised processes' reports would silently stop. A one-process
    runtime (in a process of its own: it must start before any device is used) finds it and
    stores a key."""
    code = textwrap.dedent(f"""
        import jax
        from experiments import distributed
        jax.distributed.initialize("127.0.0.1:{_free_port()}", num_processes=1, process_id=0)
        state = distributed.client_state()
        assert state is not None, "jax._src.distributed.global_state: no client"
        state.client.key_value_set("k", "v")
        print(state.process_id, state.num_processes, state.client.key_value_try_get("k"))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(1), cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout == "0 1 v\n", out.stderr[-3000:]
