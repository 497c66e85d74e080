"""Processes 1 and beyond of a multi-process run, each watched by a parent of its own, so
that the loss of the coordinator (process 0) ends it in one line.

When process 0 dies, JAX's distributed client in every other process hears it at once (its
poll of the coordination service fails) and ends the process from a C++ thread of its own:
an error log, a "Check failure stack trace" and SIGABRT. Nothing inside the process can
catch that. So ``experiments.train`` runs such a process as a child of itself (``run``: the
same command line again, ``CHILD_ENV`` set in its environment) and stands by it:

- the child's stdout is the parent's; its stderr passes through the parent ``HOLD_S``
  seconds late, so that what it wrote in the moment before an abort can be held back;
- once joined, the child writes its place in the run (process index, process count,
  coordinator address) to a pipe (``distributed.report_joined``);
- if the child then ends by SIGABRT, is not process 0, and its coordinator no longer
  accepts connections, the parent drops the held lines, prints ``lost_coordinator_message``
  and exits ``distributed.LOST_PEER_STATUS``. The checkpoints on disk stay as they are.
  Any other end passes through: the held lines, then the child's status (``128 + n`` for
  a signal ``n``).

A SIGTERM to the parent goes on to the child; a SIGINT from the terminal reaches the child
directly (the same process group), and the parent ignores it. A parent that dies (killed,
its host gone) takes the child with it (``follow_parent``): a process is lost whole.
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from experiments.distributed import LOST_PEER_STATUS, REPORT_FD_ENV

CHILD_ENV = "EXPERIMENTS_SUPERVISED"  # in the child: its parent's process id
HOLD_S = 2.0  # how late the child's stderr comes out (an abort follows its logs in ms)
CONNECT_TIMEOUT_S = 2.0  # a coordinator that accepts no connection within this is gone
PARENT_POLL_S = 0.5  # how often a child looks for its parent


def wanted(num_processes: int, process_id: int, argv: Sequence[str] | None) -> bool:
    """Whether this process should run its run as a supervised child: one of several
    processes that may not be the coordinator (``process_id`` not 0: given > 0, or -1,
    detected), started from the command line (``argv`` None or the command line's own),
    and not the child already."""
    own_command = argv is None or list(argv) == sys.argv[1:]
    return num_processes != 1 and process_id != 0 and own_command and CHILD_ENV not in os.environ


def follow_parent() -> None:
    """In a child of ``run`` (``CHILD_ENV`` set): a daemon thread that kills this process
    (SIGKILL) once its parent is gone, as the parent's own death would have. Elsewhere
    nothing."""
    parent = os.environ.get(CHILD_ENV)
    if parent is None:
        return

    def watch():
        while os.getppid() == int(parent):
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="supervisor-parent", daemon=True).start()


def lost_coordinator_message(process_id: int, num_processes: int, coordinator: str) -> str:
    """The one line a process other than 0 prints when the coordinator is gone."""
    return (
        f"distributed: error: lost process 0 (the coordinator {coordinator} accepts no "
        f"connection): process {process_id} of num_processes={num_processes} stops; the "
        f"checkpoints on disk are kept (resume from the last one with every process running)"
    )


def run() -> int:
    """Runs this process's command line again as a child and stands by it (the module's
    docstring); returns the exit status for this process."""
    read_end, write_end = os.pipe()
    env = os.environ | {CHILD_ENV: str(os.getpid()), REPORT_FD_ENV: str(write_end)}
    command = [sys.executable, *sys.orig_argv[1:]]
    child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, pass_fds=(write_end,))
    os.close(write_end)
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM)),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
    }
    try:
        held = _pass_through_late(child.stderr)
        status = child.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    with os.fdopen(read_end, "rb") as report:
        place = report.read().decode().split()
    if status == -signal.SIGABRT and len(place) == 3 and place[0] != "0":
        if not _accepts_connections(place[2]):
            _write_line(lost_coordinator_message(int(place[0]), int(place[1]), place[2]))
            return LOST_PEER_STATUS
    for line in held:
        sys.stderr.buffer.write(line)
    sys.stderr.flush()
    return status if status >= 0 else 128 - status


def _pass_through_late(stream) -> collections.deque:
    """Copies ``stream``'s lines to stderr, each ``HOLD_S`` seconds after it came, until
    the stream ends; returns the lines still held then (the last ``HOLD_S`` seconds')."""
    lines: queue.Queue = queue.Queue()

    def read():
        for line in stream:
            lines.put((time.monotonic(), line))
        lines.put(None)

    threading.Thread(target=read, name="supervisor-stderr", daemon=True).start()
    held: collections.deque = collections.deque()
    while True:
        wait = None if not held else max(0.0, held[0][0] + HOLD_S - time.monotonic())
        try:
            item = lines.get(timeout=wait)
        except queue.Empty:
            item = ()
        if item is None:
            return collections.deque(line for _, line in held)
        if item:
            held.append(item)
        while held and held[0][0] + HOLD_S <= time.monotonic():
            sys.stderr.buffer.write(held.popleft()[1])
        sys.stderr.flush()


def _accepts_connections(address: str) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``CONNECT_TIMEOUT_S``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def _write_line(line: str) -> None:
    sys.stderr.write(line + "\n")  # one write: line and newline
    sys.stderr.flush()
