"""Runs one config under several overrides; writes one results table and one plot.

    python -m experiments.sweep --config configs/mqar.py:small \
        --sweep attention=softmax,elu,taylor --workdir runs/mqar_sweep

``--sweep field=v1,v2,...`` takes any config field; several ``--sweep`` flags
make their product. ``attention=`` is a shorthand: an attention kind other than
``linear`` (``softmax``, ``gla``, ``deltanet``, ``gated_deltanet``, ``kda``) selects
that kind, any other value is linear attention with that feature map.
``--config.<field>=<value>`` applies to every run (as in ``experiments.train``).
Each run gets its own workdir (and resumes from it when re-run) and prints one
line as it finishes; the table goes to ``<workdir>/results.md`` and the plot to
``<workdir>/results.png``.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import logging
from ml_collections import ConfigDict

from experiments import train, trainer
from linattn_jax import layers

HEADER = (
    "| task | attention | feature map | width x depth | seq len | steps | eval loss | result |\n"
    "|---|---|---|---|---|---|---|---|"
)


def expand(assignment: str) -> list[list[str]]:
    """``"attention=softmax,elu"`` -> one list of overrides per value."""
    name, sep, values = assignment.partition("=")
    name = name.removeprefix("config.")
    if not sep or not values:
        raise ValueError(f"--sweep must look like field=v1,v2, got {assignment!r}")
    runs = []
    for value in values.split(","):
        if name == "attention":
            runs.append(
                [f"model.attention={value}"]
                if value in layers.ATTENTION_KINDS and value != "linear"
                else ["model.attention=linear", f"model.feature_map={value}"]
            )
        else:
            runs.append([f"{name}={value}"])
    return runs


def run_name(overrides: list[str]) -> str:
    return "_".join(o.split("=", 1)[1] for o in overrides).replace("/", "-") or "base"


def summary(final: dict) -> str:
    """``"100.0% accuracy, eval loss 0.000"`` (bits per byte for text)."""
    if "stopped_at" in final:
        return f"stopped at step {final['stopped_at']}"
    metric = (
        f"{final['bits_per_byte']:.3f} bits/byte"
        if "bits_per_byte" in final
        else f"{100 * final['accuracy']:.1f}% accuracy"
    )
    return f"{metric}, eval loss {final['loss']:.3f}"


def elapsed(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the sweep; returns the exit status (1 when a run failed)."""
    parser = train.make_parser("python -m experiments.sweep", __doc__.split("\n")[0])
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
        args, base = train.parse(parser, argv)
        plans = [sum(c, []) for c in itertools.product(*map(expand, args.sweep))] or [[]]
        configs = []
        for overrides in plans:  # build and validate every run before training any
            config = ConfigDict(base.to_dict())
            config.lock()
            for assignment in overrides:
                trainer.override(config, assignment)
            trainer.validate(config)
            configs.append((run_name(overrides), config))
    except ValueError as e:
        return train.report(parser.prog, e)
    if args.print_config:
        for name, config in configs:
            print(f"# {name}\n{train.format_config(config)}")
        return 0
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

    workdir = Path(args.workdir)
    rows, finals, failed = [], {}, 0
    for name, config in configs:
        start = time.perf_counter()
        try:
            final = trainer.train(config, workdir / name)
        except (ValueError, OSError, FloatingPointError) as e:
            failed += 1
            took = elapsed(time.perf_counter() - start)
            print(f"{name}: failed after {took}: {' '.join(str(e).split())}", flush=True)
            continue
        print(f"{name}: {summary(final)} ({elapsed(time.perf_counter() - start)})", flush=True)
        finals[name] = final
        if "stopped_at" not in final:
            rows.append(trainer.results_row(config, final))
    table = "\n".join([HEADER, *rows])
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.md").write_text(table + "\n")
    (workdir / "results.json").write_text(json.dumps(finals, indent=2))
    plot(workdir, [(name, config) for name, config in configs if name in finals])
    print(table)
    return 1 if failed else 0


def results_figure(runs: list[tuple[str, ConfigDict, list[dict]]]):
    """Every run's headline eval metric against step, with the chance level.

    Args:
      runs: (name, config, metrics rows) per run; all of one task.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    spec = trainer.TASKS[runs[0][1].task] if runs else trainer.TASKS["mqar"]
    metric = spec.metric
    markers = "osD^vP*Xhp<>"
    for i, (name, _, rows) in enumerate(runs):
        evals = [r for r in rows if r["split"] == "eval" and metric in r]
        ax.plot(
            [r["step"] for r in evals],
            [r[metric] for r in evals],
            marker=markers[i % len(markers)],
            markersize=4 + 2.5 * (len(runs) - 1 - i),  # nested rings where runs coincide
            fillstyle="none",
            linestyle=("-", "--", "-.", ":")[i % 4],
            label=name,
        )
    if runs:
        ax.axhline(spec.chance(runs[0][1]), color="gray", linestyle=":", label="chance")
    label = "eval bits per byte" if metric == "bits_per_byte" else "eval accuracy"
    ax.set(xlabel="step", ylabel=label)
    if runs:
        ax.set_title(f"{runs[0][1].task}: {label} by run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def plot(workdir: Path, runs: list[tuple[str, ConfigDict]]) -> None:
    """``workdir/results.png`` from each run's ``metrics.jsonl``."""
    import matplotlib.pyplot as plt

    fig = results_figure(
        [(name, c, trainer.read_metrics(workdir / name / "metrics.jsonl")) for name, c in runs]
    )
    fig.savefig(workdir / "results.png", dpi=100, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
