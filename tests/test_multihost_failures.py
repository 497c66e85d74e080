"""Multi-process failures (issue 40, item 7): process 0 whose peer never joins exits with one
line naming the missing process, the coordinator and the timeout (not JAX's SIGABRT and C++
stack trace), before touching the workdir, so its last checkpoint stays as it was."""

import re
import subprocess
import sys

from tests.test_multihost import MQAR, ROOT, _env, _free_port


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
