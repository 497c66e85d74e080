"""Speed and memory of every attention form, as CSV, a markdown table and a plot.

    python -m experiments.benchmark --out bench_out
    python -m experiments.benchmark recurrences --lengths 16384,65536 --scan-max 16384

The suites (``forms``, the default; ``recurrences``, ``decode``, ``comm`` and
``train-step``) live in ``experiments.bench``, one module each; a suite runs as a
subcommand with its own flags, or, as before, from the flat command line, where
``--recurrences``, ``--decode``, ``--comm`` or ``--train-steps`` picks it.
"""

from __future__ import annotations

from experiments.bench.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
