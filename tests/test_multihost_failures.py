"""Multi-process failures (issue 40, item 7; issue 53): process 0 whose peer never joins exits
with one line naming the missing process, the coordinator and the timeout (not JAX's SIGABRT
and C++ stack trace), before touching the workdir, so its last checkpoint stays as it was; one
whose peer is killed mid-run exits with one line naming the lost process, the coordinator and
the heartbeat timeout, its checkpoints kept; and when process 0 dies, every other process
exits with one line naming it and the coordinator (``experiments.supervisor``)."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.test_multihost import MQAR, ROOT, _env, _free_port, _running, _start

# The entry point with a run that only joins (the distributed runtime starts) and waits:
# the loss of a process does not depend on what the run computes.
JOIN_AND_WAIT = textwrap.dedent("""
    import sys, time
    from experiments import train, trainer
    def wait(config, workdir, verbose=False):
        print("joined", flush=True)
        while True:
            time.sleep(1)
    trainer.train = wait
    sys.exit(train.main(sys.argv[1:]))
""")


def test_a_peer_that_never_joins_is_one_line_and_keeps_the_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    checkpoint = workdir / "checkpoints" / "2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "marker").write_text("kept")
    address = f"127.0.0.1:{_free_port()}"
    argv = [
        *("--config", MQAR, "--workdir", str(workdir)),
        f"--config.distributed.coordinator_address={address}",
        "--config.distributed.num_processes=2",
        "--config.distributed.process_id=0",
        "--config.distributed.initialization_timeout=2",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.train", *argv],
        env=_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert re.fullmatch(
        rf"distributed: error: process 1 never joined: process 0 of num_processes=2 waited "
        rf"distributed.initialization_timeout=2 s at the coordinator {re.escape(address)}; "
        r"[^\n]*\n",
        out.stderr,
    ), out.stderr[-3000:]
    assert sorted(p.relative_to(workdir).as_posix() for p in workdir.rglob("*")) == [
        "checkpoints",
        "checkpoints/2",
        "checkpoints/2/marker",
    ]


@pytest.mark.slow
def test_a_peer_killed_mid_run_is_one_line_and_keeps_the_checkpoint(tmp_path):
    # Process 1 waits forever for step 3's batch once checkpoint 2 is saved; process 0 goes
    # on into step 3's collectives and waits for it there when it is killed (gloo then fails
    # the collective: "Connection closed by peer"; before, JAX's SIGABRT came after that).
    workdir = tmp_path / "run"
    address = f"127.0.0.1:{_free_port()}"
    argv = (
        f"--config.distributed.coordinator_address={address}",
        "--config.distributed.num_processes=2",
        "--config.distributed.heartbeat_timeout=4",
    )
    first = _start(workdir, 1, *argv, "--config.distributed.process_id=0")
    with _running(
        first, _start(workdir, 1, *argv, "--config.distributed.process_id=1", HANG_AT="2")
    ) as (_, peer):
        checkpoint = workdir / "checkpoints" / "2"
        deadline = time.monotonic() + 240
        while not checkpoint.is_dir() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.5)
        assert checkpoint.is_dir(), first.communicate()[1][-3000:]
        time.sleep(1)  # process 0 into step 3
        peer.kill()
        _, err = first.communicate(timeout=60)
    assert first.returncode == 1, err[-3000:]
    assert re.fullmatch(
        rf"distributed: error: lost process 1 \(no heartbeat for distributed.heartbeat_timeout=4 "
        rf"s\): process 0 of num_processes=2 at the coordinator {re.escape(address)} stops; "
        r"[^\n]*\n",
        err,
    ), err[-3000:]
    assert (workdir / "checkpoints" / "2").is_dir()


def test_a_lost_coordinator_is_one_line_on_the_others_and_keeps_the_checkpoint(tmp_path):
    # Before: process 1 ended at once by SIGABRT, with JAX's C++ "Check failure stack trace".
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "2").mkdir(parents=True)
    (workdir / "checkpoints" / "2" / "marker").write_text("kept")
    address = f"127.0.0.1:{_free_port()}"
    argv = [
        *("--config", MQAR, "--workdir", str(workdir)),
        f"--config.distributed.coordinator_address={address}",
        "--config.distributed.num_processes=2",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JOIN_AND_WAIT, *argv, f"--config.distributed.process_id={i}"],
            env=_env(1),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # process 0 dies whole: its process group
        )
        for i in (0, 1)
    ]
    coordinator, peer = procs
    try:
        assert peer.stdout.readline() == "joined\n", peer.communicate()[1][-3000:]
        os.killpg(coordinator.pid, signal.SIGKILL)
        _, err = peer.communicate(timeout=60)
    finally:  # each process group whole (a supervisor's child too)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert peer.returncode == 1, err[-3000:]
    assert re.fullmatch(
        rf"distributed: error: lost process 0 \(the coordinator {re.escape(address)} accepts no "
        r"connection\): process 1 of num_processes=2 stops; the checkpoints on disk are kept "
        r"[^\n]*\n",
        err,
    ), err[-3000:]
    assert (workdir / "checkpoints" / "2" / "marker").read_text() == "kept"
