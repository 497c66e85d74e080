"""Trains one experiment config.

    python -m experiments.train --config configs/mqar.py:small --workdir runs/mqar_small \
        --config.model.feature_map=taylor --config.optim.lr=3e-3
    python -m experiments.train --config configs/mqar.py:small --print_config

Any config field can be overridden with ``--config.<field>=<value>`` (the same
syntax as ``experiments.sweep``); ``--print_config`` lists the fields and their
values. A misspelt field or a bad value is one line of error naming it.
Re-running with the same ``--workdir`` resumes from its latest checkpoint. One run over
several processes (one per host): the same command in each, with
``--config.distributed.coordinator_address=HOST:PORT``, ``num_processes=N`` and its own
``process_id``, or ``--multihost`` where JAX detects the cluster (SLURM, Open MPI, TPU pods).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from absl import logging

from experiments import cli, distributed, supervisor, trainer


def main(argv: Sequence[str] | None = None) -> int:
    """Trains the command line's config; returns the exit status (2: a bad command
    line or config, 1: a failed run)."""
    parser = cli.make_parser("python -m experiments.train", __doc__.split("\n")[0])
    parser.add_argument(
        "--multihost",
        action="store_true",
        help="one process of several, one per host, found by JAX's detection of the cluster "
        "(SLURM, Open MPI, TPU pods): --config.distributed.num_processes=0; or give "
        "--config.distributed.coordinator_address, num_processes and process_id",
    )
    try:
        args, config = cli.parse(parser, argv)
        cli.use_compilation_cache(args.compilation_cache)
        if args.print_config:
            print(cli.format_config(config))
            return 0
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
        if args.multihost and config.distributed.num_processes == 1:
            config.distributed.num_processes = 0
        d = config.distributed
        if supervisor.wanted(d.num_processes, d.process_id, argv):
            # This command again, as a child whose loss of the coordinator is one line.
            return supervisor.run()
        supervisor.follow_parent()  # a supervised child ends with its parent
        distributed.initialize(config)  # first of all (train does it too, if not yet)
        with distributed.lost_peers_reported():
            final = trainer.train(config, args.workdir, verbose=args.verbose)
    except (ValueError, OSError, FloatingPointError) as e:
        return cli.report(parser.prog, e, cli.wants_verbose(argv))
    if distributed.is_primary():
        print(json.dumps(final, indent=2))
    return 0


if __name__ == "__main__":
    status = main()
    if status == 1:  # a failed run: skip the teardown, where the writer threads of a
        sys.stdout.flush()  # failed orbax save print asyncio tracebacks
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
