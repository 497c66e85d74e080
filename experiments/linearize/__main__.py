"""Linearises a softmax transformer: ``python -m experiments.linearize --config
configs/linearize.py[:small] --workdir W`` (``configs/linearize.py`` says what each field
does; ``--config.<field>=<value>`` overrides any). Rerunning with the same workdir resumes."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from absl import logging

from experiments import cli
from experiments.linearize.run import linearize


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line's linearisation; returns the exit status (2: a bad command
    line or config, 1: a failed run)."""
    parser = cli.make_parser("python -m experiments.linearize", __doc__.split("\n")[0])
    try:
        args, config = cli.parse(parser, argv)
        cli.use_compilation_cache(args.compilation_cache)
        if args.print_config:
            print(cli.format_config(config))
            return 0
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
        results = linearize(config, args.workdir, verbose=args.verbose)
    except (ValueError, OSError, FloatingPointError) as e:
        return cli.report(parser.prog, e, cli.wants_verbose(argv))
    print(json.dumps(results["goal"], indent=2))
    print(Path(args.workdir, "results.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
