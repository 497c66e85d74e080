"""One run over several processes (one per host): ``initialize`` starts JAX's distributed
runtime from a config's ``distributed`` fields, leaving those unset to JAX's detection of the
cluster (SLURM, Open MPI, TPU pods, ...), and ``is_primary`` names the process that writes a
workdir's files (metrics, plots, final results); every process writes its own checkpoint
shards (orbax).

A peer that never joins makes ``initialize`` exit (status ``LOST_PEER_STATUS``) with one
line on stderr naming the missing process, the coordinator and the timeout, before JAX's
own deadline would abort the process with a C++ check failure (its coordination client
terminates the process from a thread of its own: nothing in Python can catch it).
"""

from __future__ import annotations

import os
import sys
import threading

import jax
from jax.experimental import multihost_utils
from ml_collections import ConfigDict

from experiments.validation import validate_distributed


def initialize(config: ConfigDict) -> None:
    """Joins this process to the config's others (nothing for ``num_processes=1``, or when
    JAX's runtime has already started). Must come before anything uses a device.

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


def is_primary() -> bool:
    """Whether this process writes the workdir's files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process gets here (nothing with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
