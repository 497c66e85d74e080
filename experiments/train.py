"""Trains one experiment config.

    python -m experiments.train --config configs/mqar.py:small --workdir runs/mqar_small \
        --config.model.feature_map=taylor --config.optim.lr=3e-3

Any config field can be overridden with ``--config.<field>=<value>``; a field
that does not exist is an error that names it. Re-running with the same
``--workdir`` resumes from its latest checkpoint.
"""

import json

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/<experiment>.py[:variant]")
_WORKDIR = flags.DEFINE_string("workdir", None, "where checkpoints, metrics and plots go")
_MULTIHOST = flags.DEFINE_bool("multihost", False, "call jax.distributed.initialize() first")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    if _MULTIHOST.value:
        jax.distributed.initialize()
    final = trainer.train(_CONFIG.value, _WORKDIR.value)
    print(json.dumps(final, indent=2))


if __name__ == "__main__":
    app.run(main)
