"""One run over several processes (one per host): ``initialize`` starts JAX's distributed
runtime from a config's ``distributed`` fields, leaving those unset to JAX's detection of the
cluster (SLURM, Open MPI, TPU pods, ...), and ``is_primary`` names the process that writes a
workdir's files (metrics, plots, final results); every process writes its own checkpoint
shards (orbax).
"""

from __future__ import annotations

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
    try:
        jax.distributed.initialize(
            coordinator_address=d.coordinator_address or None,
            num_processes=d.num_processes or None,
            process_id=None if d.process_id < 0 else d.process_id,
            initialization_timeout=d.initialization_timeout,
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


def is_primary() -> bool:
    """Whether this process writes the workdir's files (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process gets here (nothing with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
