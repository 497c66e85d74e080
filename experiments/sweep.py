"""Runs one config under several overrides; writes one results table and one plot.

    python -m experiments.sweep --config configs/mqar.py:small \
        --sweep attention=softmax,elu,taylor --workdir runs/mqar_sweep

``--sweep field=v1,v2,...`` takes any config field; several ``--sweep`` flags
make their product. ``attention=`` is a shorthand: an attention kind other than
``linear`` (``softmax``, ``gla``, ``deltanet``, ``gated_deltanet``, ``kda``) or a layout
(``"3 gated_deltanet : 1 softmax"``, a hybrid) selects that, any other value is linear
attention with that feature map.
``--config.<field>=<value>`` applies to every run (as in ``experiments.train``).
Each run gets its own workdir (and resumes from it when re-run) and prints one
line as it finishes; the table goes to ``<workdir>/results.md`` and the plot to
``<workdir>/results.png``.
"""

from __future__ import annotations

import difflib
import itertools
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from absl import logging
from ml_collections import ConfigDict

from experiments import cli, reporting, trainer, validation
from experiments.configuration import override
from linattn_jax import layers
from linattn_jax.layers import registry


def expand(assignment: str) -> list[list[str]]:
    """``"attention=softmax,elu"`` -> one list of overrides per value."""
    name, sep, values = assignment.partition("=")
    name = name.removeprefix("config.")
    if not sep or not values:
        raise ValueError(f"--sweep must look like field=v1,v2, got {assignment!r}")
    runs = []
    for value in values.split(","):
        if name == "attention":
            _check_attention(value)
            kind = value in layers.ATTENTION_KINDS and value != "linear"
            runs.append(
                [f"model.attention={value}"]
                if kind or registry.is_layout(value)
                else ["model.attention=linear", f"model.feature_map={value}"]
            )
        else:
            runs.append([f"{name}={value}"])
    return runs


def _check_attention(value: str) -> None:
    """``attention=``'s value: an attention kind, a layout of kinds or a feature map, or a
    ValueError naming both lists and the closest of their names."""
    maps = validation.feature_map_names()
    if value in layers.ATTENTION_KINDS or value in maps or registry.is_layout(value):
        return
    close = difflib.get_close_matches(value, (*layers.ATTENTION_KINDS, *maps), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"--sweep attention={value} is neither an attention kind {layers.ATTENTION_KINDS} nor "
        f"a feature map {maps}{hint}"
    )


def swept_columns(plans: list[list[str]]) -> tuple[str, ...]:
    """The swept fields that take more than one value and that the results table does not
    already show: each gets a column of its own, so that the rows can be told apart."""
    values: dict[str, set[str]] = {}
    for overrides in plans:
        for assignment in overrides:
            field, _, value = assignment.partition("=")
            values.setdefault(field, set()).add(value)
    return tuple(
        field
        for field, seen in values.items()
        if len(seen) > 1 and field not in reporting.RESULTS_FIELDS
    )


def run_name(overrides: list[str]) -> str:
    """``["model.attention=linear", "model.feature_map=elu"]`` -> ``"linear_elu"``."""
    name = "_".join(o.split("=", 1)[1] for o in overrides).replace("/", "-")
    return name.replace(" ", "").replace(":", "-") or "base"  # a layout: "3kda-1softmax"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the sweep; returns the exit status (1 when a run failed)."""
    parser = cli.make_parser("python -m experiments.sweep", __doc__.split("\n")[0])
    parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="FIELD=V1,V2,...",
        help="one run per value of a config field (model.width=64,128); repeat for a "
        "product of several; attention=softmax,gla,kda,elu,... is that attention kind or "
        "linear attention with that feature map",
    )
    try:
        args, base = cli.parse(parser, argv)
        cli.use_compilation_cache(args.compilation_cache)
        plans = [sum(c, []) for c in itertools.product(*map(expand, args.sweep))] or [[]]
        configs = []
        for overrides in plans:  # build and validate every run before training any
            config = ConfigDict(base.to_dict())
            config.lock()
            for assignment in overrides:
                override(config, assignment)
            validation.validate(config)
            configs.append((run_name(overrides), config))
    except ValueError as e:
        return cli.report(parser.prog, e, cli.wants_verbose(argv))
    if args.print_config:
        for name, config in configs:
            print(f"# {name}\n{cli.format_config(config)}")
        return 0
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

    workdir = Path(args.workdir)
    swept = swept_columns(plans)
    rows, finals, failed = [], {}, 0
    for name, config in configs:
        start = time.perf_counter()
        try:
            final = trainer.train(config, workdir / name, verbose=args.verbose, lines=False)
        except (ValueError, OSError, FloatingPointError) as e:
            if args.verbose:
                traceback.print_exception(e)
            failed += 1
            took = reporting.elapsed(time.perf_counter() - start)
            print(f"{name}: failed after {took}: {' '.join(str(e).split())}", flush=True)
            continue
        took = reporting.elapsed(time.perf_counter() - start)
        print(f"{name}: {reporting.summary(final)} ({took})", flush=True)
        finals[name] = final
        if "stopped_at" not in final:
            rows.append(reporting.results_row(config, final, swept))
    table = "\n".join([reporting.results_header(swept), *rows])
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.md").write_text(table + "\n")
    (workdir / "results.json").write_text(json.dumps(finals, indent=2))
    plot(workdir, [(name, config) for name, config in configs if name in finals])
    print(table)
    return 1 if failed else 0


def plot(workdir: Path, runs: list[tuple[str, ConfigDict]]) -> None:
    """``workdir/results.png`` from each run's ``metrics.jsonl``."""
    plt = reporting.pyplot()
    fig = reporting.results_figure(
        [(name, c, reporting.read_metrics(workdir / name / "metrics.jsonl")) for name, c in runs]
    )
    fig.savefig(workdir / "results.png", dpi=100, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
