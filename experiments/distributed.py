"""One run over several processes (one per host): ``initialize`` starts JAX's distributed
runtime from a config's ``distributed`` fields, leaving those unset to JAX's detection of the
cluster (SLURM, Open MPI, TPU pods, ...), and ``is_primary`` names the process that writes a
workdir's files (metrics, plots, final results); every process writes its own checkpoint
shards (orbax).

A peer that never joins makes ``initialize`` exit (status ``LOST_PEER_STATUS``) with one
line on stderr naming the missing process, the coordinator and the timeout, before JAX's
own deadline would abort the process with a C++ check failure (its coordination client
terminates the process from a thread of its own: nothing in Python can catch it).
Once they have joined, every process writes a heartbeat to the coordinator's key-value store
every quarter of ``distributed.heartbeat_timeout``, and process 0 watches the others': a peer
silent for that long (killed, or its host gone) makes process 0 exit in the same way
(``lost_process_message``), again before JAX's own heartbeat deadline aborts it. The
other processes cannot outrun JAX when process 0 dies (their client aborts them at once):
``experiments.supervisor`` stands by each of them from a parent process and puts that abort
in one line (``supervisor.lost_coordinator_message``), exit status ``LOST_PEER_STATUS``.
The checkpoints already on disk stay as they are (one being written at that moment, if any,
may be left incomplete; the tests check only that the completed ones stay).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time

import jax
from jax.experimental import multihost_utils
from ml_collections import ConfigDict

from experiments.validation import validate_distributed


def initialize(config: ConfigDict) -> None:
    """Joins this process to the config's others (nothing for ``num_processes=1``, or when
    JAX's runtime has already started). Must come before anything uses a device. On CPUs it
    turns JAX's persistent compilation cache off for this process (jaxlib 0.12.1: below).

    Raises:
      ValueError: a bad ``distributed`` field, fields left unset that JAX could not
        detect (no cluster found), naming the fields to set, or a process that has used a
        device already (a sweep: only ``experiments.train`` runs over several processes).
    """
    validate_distributed(config)
    d = config.distributed
    if d.num_processes == 1 or jax.distributed.is_initialized():
        return
    # Collectives between the processes' CPU devices (GPUs and TPUs bring their own).
    jax.config.update("jax_cpu_collectives_implementation", d.cpu_collectives)
    joined = _watch_joining(d)
    try:
        # JAX's deadline a little later than ours: the watchdog reports first, in one line.
        jax.distributed.initialize(
            coordinator_address=d.coordinator_address or None,
            num_processes=d.num_processes or None,
            process_id=None if d.process_id < 0 else d.process_id,
            initialization_timeout=d.initialization_timeout + JAX_GRACE_S,
            heartbeat_timeout_seconds=d.heartbeat_timeout + JAX_GRACE_S,
        )
    except ValueError as e:
        raise ValueError(
            f"jax.distributed.initialize: {e} (no cluster detected): set "
            f"distributed.coordinator_address, distributed.num_processes and "
            f"distributed.process_id, got {d.coordinator_address!r}, {d.num_processes} and "
            f"{d.process_id}"
        ) from None
    except RuntimeError as e:  # JAX's runtime must start before any device is used
        raise ValueError(
            f"distributed.num_processes={d.num_processes} needs JAX's distributed runtime, "
            f"which must start before anything uses a device ({e}); experiments.train "
            f"starts it first, a sweep or recall grid runs in one process"
        ) from None
    finally:
        joined.set()
    if jax.default_backend() == "cpu":
        # The CPU programs of a multi-process run are compiled afresh, never read back from
        # the persistent compilation cache: with jaxlib 0.12.1 a program read back from it
        # deadlocks in its gloo all-reduces (every device of every process waiting in one),
        # where the same program freshly compiled runs (jaxlib 0.10.2 and 0.12.0: both run).
        jax.config.update("jax_enable_compilation_cache", False)
    state = client_state()
    if state is not None:
        report_joined(state.process_id, state.num_processes, state.coordinator_address)
        _watch_peers(d, state)


LOST_PEER_STATUS = 1  # a run that failed (experiments.cli: 2 is a bad command line)
JAX_GRACE_S = 30  # JAX's initialization deadline after ours


def lost_peer_message(d) -> str:
    """The one line ``initialize`` prints when the processes of ``d`` (a config's
    ``distributed``) did not all join within ``d.initialization_timeout`` seconds."""
    n, me = d.num_processes, d.process_id
    coordinator = d.coordinator_address or "(detected)"
    if me == 0 and n == 2:
        lost = "process 1 never joined"
    elif me == 0:
        lost = f"one of processes 1 to {n - 1} never joined"
    elif me > 0:
        lost = "the coordinator (process 0) or another process never joined"
    else:
        lost = "a process never joined"
    return (
        f"distributed: error: {lost}: process {me} of num_processes={n} waited "
        f"distributed.initialization_timeout={d.initialization_timeout} s at the coordinator "
        f"{coordinator}; start every process (the same coordinator_address and "
        f"num_processes, process_id 0 to {n - 1}) within the timeout"
    )


def _watch_joining(d) -> threading.Event:
    """An event to set once ``jax.distributed.initialize`` returns; if it is not set within
    ``d.initialization_timeout`` seconds, ``lost_peer_message`` and exit."""
    joined = threading.Event()

    def watch():
        if not joined.wait(d.initialization_timeout):
            sys.stderr.write(lost_peer_message(d) + "\n")  # one write: line and newline
            sys.stderr.flush()
            os._exit(LOST_PEER_STATUS)  # the main thread is blocked inside JAX's C++ client

    threading.Thread(target=watch, name="distributed-join-watchdog", daemon=True).start()
    return joined


def lost_process_message(d, lost: list[int], n: int) -> str:
    """The one line process 0 of ``n`` prints when processes ``lost`` of ``d`` (a config's
    ``distributed``) have sent no heartbeat for ``d.heartbeat_timeout`` seconds mid-run."""
    names = ", ".join(map(str, lost))
    return (
        f"distributed: error: lost process {names} (no heartbeat for "
        f"distributed.heartbeat_timeout={d.heartbeat_timeout} s): process 0 of "
        f"num_processes={n} at the coordinator "
        f"{d.coordinator_address or '(detected)'} stops; the checkpoints on disk are kept "
        f"(resume from the last one with every process running)"
    )


REPORT_FD_ENV = "EXPERIMENTS_REPORT_FD"  # a supervised child's pipe to its parent


def report_joined(process_id: int, num_processes: int, coordinator: str) -> None:
    """In a child of ``experiments.supervisor`` (``REPORT_FD_ENV`` names its pipe): tells
    the parent this process's place in the run, once joined. Elsewhere nothing."""
    fd = os.environ.pop(REPORT_FD_ENV, None)
    if fd is not None:
        with os.fdopen(int(fd), "w") as pipe:
            pipe.write(f"{process_id} {num_processes} {coordinator}\n")


_CLIENT_METHODS = ("key_value_set", "key_value_try_get")


def client_state():
    """JAX's distributed state once ``jax.distributed.initialize`` has returned: its
    ``process_id``, ``num_processes``, ``coordinator_address`` and ``client`` (the
    coordinator's key-value store: ``key_value_set``, ``key_value_try_get``), or None
    where a JAX release lacks any of them.

    JAX has no public handle on these (jax 0.10.2 and 0.11: ``jax.distributed`` exports
    only ``initialize``, ``is_initialized`` and ``shutdown``; ``multihost_utils`` reads the
    same private ``global_state``), so this is the one place that reads
    ``jax._src.distributed.global_state``; ``tests/test_multihost.py`` fails on a JAX
    where it is gone. Its process index and count, read here, start no backend (as
    ``jax.process_index()`` would).
    """
    from jax._src import distributed as jax_distributed  # no public handle on the client

    state = getattr(jax_distributed, "global_state", None)
    client = getattr(state, "client", None)
    fields = ("process_id", "num_processes", "coordinator_address")
    if client is None or not all(hasattr(client, m) for m in _CLIENT_METHODS):
        return None
    return state if all(getattr(state, f, None) is not None for f in fields) else None


_HEARTBEAT = "experiments.distributed/heartbeat/"  # + process index: a counter, or _DONE
_DONE = "done"


def _watch_peers(d, state) -> None:
    """Starts this process's heartbeat (a counter in the coordinator's key-value store,
    ``state.client`` of ``client_state()``, advanced every quarter of
    ``d.heartbeat_timeout``) and, on process 0, the watch of the others': a peer whose
    counter stands still for ``d.heartbeat_timeout`` seconds makes it print
    ``lost_process_message`` and exit ``LOST_PEER_STATUS``."""
    client = state.client
    me, n, every = state.process_id, state.num_processes, d.heartbeat_timeout / 4

    lock, stopped = threading.Lock(), threading.Event()

    def beat():
        count = 0
        while True:
            count += 1
            with lock:
                if stopped.is_set():
                    return
                try:
                    client.key_value_set(_HEARTBEAT + str(me), str(count), allow_overwrite=True)
                except Exception:  # the coordinator is gone: JAX reports that itself
                    return
            time.sleep(every)

    def watch():
        seen = {p: (None, time.monotonic()) for p in range(1, n)}  # last count, when it moved
        while True:
            time.sleep(every)
            now = time.monotonic()
            for p, (count, _) in list(seen.items()):
                try:
                    value = client.key_value_try_get(_HEARTBEAT + str(p))
                except Exception:  # not written yet (a slow start counts as silence)
                    value = None
                if value == _DONE:  # it finished its run: silence from now on is no loss
                    del seen[p]
                elif value is not None and value != count:
                    seen[p] = (value, now)
            lost = [p for p, (_, since) in seen.items() if now - since > d.heartbeat_timeout]
            if lost:
                sys.stderr.write(lost_process_message(d, lost, n) + "\n")  # one write
                sys.stderr.flush()
                os._exit(LOST_PEER_STATUS)  # the main thread may be blocked inside XLA

    def done():
        with lock, contextlib.suppress(Exception):
            stopped.set()
            client.key_value_set(_HEARTBEAT + str(me), _DONE, allow_overwrite=True)

    atexit.register(done)  # before JAX's own exit handler (registered at import) shuts down
    threading.Thread(target=beat, name="distributed-heartbeat", daemon=True).start()
    if me == 0:
        threading.Thread(target=watch, name="distributed-peer-watchdog", daemon=True).start()
        _WATCHED["settle_s"] = d.heartbeat_timeout + 3 * every


_WATCHED: dict[str, float] = {}  # settle_s: how long the watchdog needs to see a lost peer


@contextlib.contextmanager
def lost_peers_reported():
    """Where process 0 watches its peers (``initialize``), an exception inside (a collective
    that failed when a peer died: gloo's "Connection closed by peer") waits until the
    watchdog could tell whether a peer is lost: if one is, the watchdog's line and exit
    status end the process (not the exception's traceback, then JAX's SIGABRT in its
    shutdown barrier); if none is, the exception goes on."""
    try:
        yield
    except Exception:
        if "settle_s" in _WATCHED:
            time.sleep(_WATCHED["settle_s"])  # the watchdog exits the process meanwhile
        raise


def is_primary() -> bool:
    """Whether this process writes the workdir's files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process gets here (nothing with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
