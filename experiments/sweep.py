"""Runs one config under several overrides; writes one results table and one plot.

    python -m experiments.sweep --config configs/mqar.py:small \
        --sweep attention=softmax,elu,taylor --workdir runs/mqar_sweep

``--sweep field=v1,v2,...`` takes any config field; several ``--sweep`` flags
make their product. ``attention=`` is a shorthand: ``softmax`` selects softmax
attention, any other value is linear attention with that feature map.
``--set field=value`` applies to every run. Each run gets its own workdir (and
resumes from it when re-run); the table goes to ``<workdir>/results.md`` and
the plot to ``<workdir>/results.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from absl import logging

from experiments import trainer

HEADER = (
    "| task | attention | feature map | width x depth | seq len | steps | eval loss | result |\n"
    "|---|---|---|---|---|---|---|---|"
)


def expand(assignment: str) -> list[list[str]]:
    """``"attention=softmax,elu"`` -> one list of overrides per value."""
    name, sep, values = assignment.partition("=")
    if not sep or not values:
        raise ValueError(f"--sweep must look like field=v1,v2, got {assignment!r}")
    runs = []
    for value in values.split(","):
        if name == "attention":
            runs.append(
                ["model.attention=softmax"]
                if value == "softmax"
                else ["model.attention=linear", f"model.feature_map={value}"]
            )
        else:
            runs.append([f"{name}={value}"])
    return runs


def run_name(overrides: list[str]) -> str:
    return "_".join(o.split("=", 1)[1] for o in overrides).replace("/", "-") or "base"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--sweep", action="append", default=[])
    parser.add_argument("--set", action="append", default=[], dest="fixed")
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

    plans = [sum(combo, []) for combo in itertools.product(*map(expand, args.sweep))] or [[]]
    configs = []
    for overrides in plans:  # build and validate every run before training any
        config = trainer.load_config(args.config)
        for assignment in args.fixed + overrides:
            trainer.override(config, assignment)
        trainer.validate(config)
        configs.append((run_name(overrides), config))

    workdir = Path(args.workdir)
    rows, finals = [], {}
    for name, config in configs:
        final = trainer.train(config, workdir / name)
        finals[name] = final
        rows.append(trainer.results_row(config, final))
    table = "\n".join([HEADER, *rows])
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.md").write_text(table + "\n")
    (workdir / "results.json").write_text(json.dumps(finals, indent=2))
    plot(workdir, [name for name, _ in configs])
    print(table)


def plot(workdir: Path, names: list[str]) -> None:
    """``results.png``: every run's eval accuracy (or loss) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        lines = (workdir / name / "metrics.jsonl").read_text().splitlines()
        rows = [r for r in map(json.loads, lines) if r["split"] == "eval"]
        ax.plot([r["step"] for r in rows], [r["accuracy"] for r in rows], "o-", label=name)
    ax.set(xlabel="step", ylabel="eval accuracy", title=workdir.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(workdir / "results.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
