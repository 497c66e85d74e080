"""What runs report: ``metrics.jsonl`` and TensorBoard events (``MetricsLog``), a
run's results row and one-line summary, elapsed times, run titles, and the figures
of a run's curves and of a sweep's results, all drawn through one headless matplotlib
preamble (``pyplot``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
from absl import logging
from ml_collections import ConfigDict

from experiments.configuration import flatten
from experiments.tasks import TASKS

# The header of the table of results_row rows.
RESULTS_HEADER = (
    "| task | attention | feature map | width x depth | seq len | steps | eval loss | result |\n"
    "|---|---|---|---|---|---|---|---|"
)
# The config fields that table shows (a sweep gives any other field it varies a column).
RESULTS_FIELDS = (
    "task",
    "model.attention",
    "model.feature_map",
    "model.width",
    "model.depth",
    "seq_len",
    "steps",
)


def results_header(extra: tuple[str, ...] = ()) -> str:
    """``RESULTS_HEADER`` with a first column per field of ``extra`` (``optim.lr``)."""
    if not extra:
        return RESULTS_HEADER
    head, rule = RESULTS_HEADER.split("\n")
    return "| " + " | ".join(extra) + " " + head + "\n" + "|---" * len(extra) + rule


def pyplot():
    """``matplotlib.pyplot`` on the headless Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- metrics --------------------------------------------------------------------


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a torn line (a kill mid-write) is skipped."""
    rows = []
    if not path.is_file():
        return rows
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            logging.warning("%s:%d is torn (a kill mid-write?); skipping it", path, number)
            continue
        if isinstance(row, dict) and "step" in row and "split" in row:
            rows.append(row)
    return rows


def truncate_metrics(path: Path, step: int) -> None:
    """Keeps the rows up to ``step`` (the restored checkpoint): a resumed run
    rewrites the steps after it."""
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def summary_writer(workdir: Path, start: int):
    """TensorBoard events in the workdir; those after ``start`` (a resumed run
    rewrites them) are purged. Only process 0 writes (None elsewhere)."""
    if jax.process_index():
        return None
    return _tensorboardx().SummaryWriter(str(workdir), purge_step=start + 1, flush_secs=30)


def _tensorboardx():
    """The ``tensorboardX`` module, imported without torch. Its writer imports torch, where
    torch is installed, only to accept torch tensors as values: 2.5 s at the start of each
    run, more than JAX's own import, for a run that logs Python floats. So while it is
    imported, a torch not imported yet is hidden (``sys.modules["torch"] = None``: Python's
    import then raises ``ImportError``, which tensorboardX catches) and shown again after;
    a process that imported torch before keeps it, and tensorboardX takes its tensors."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX
    else:
        sys.modules["torch"] = None
        try:
            import tensorboardX
        finally:
            if sys.modules.get("torch", False) is None:
                del sys.modules["torch"]
    return tensorboardX


class MetricsLog:
    """A run's rows, appended to ``workdir/metrics.jsonl`` and, as scalars tagged
    ``split/key``, to TensorBoard; the rows after ``start`` (a resumed run's
    checkpoint) are dropped from both first. Only process 0 writes (elsewhere ``write``
    does nothing). A context manager that closes both."""

    def __init__(self, workdir: Path, start: int):
        self.file = self.writer = None
        if jax.process_index():
            return
        path = workdir / "metrics.jsonl"
        truncate_metrics(path, start)
        self.writer = summary_writer(workdir, start)
        try:
            self.file = open(path, "a")
        except BaseException:
            self._close_writer()
            raise

    def write(self, row: dict) -> None:
        """One row: ``step``, ``split`` and the metrics, flushed at once."""
        if self.file is None:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in row.items():
                if key not in ("step", "split"):
                    self.writer.add_scalar(f"{row['split']}/{key}", value, row["step"])

    def _close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def close(self) -> None:
        try:
            if self.file is not None:
                self.file.close()
        finally:
            self._close_writer()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        try:
            self.close()
        except OSError:
            if exc_type is None:
                raise
            # A full disk fails the flush too: the error in flight is the one to report.


# -- progress -------------------------------------------------------------------


def progress_line(row: dict, end: int, seconds: float) -> str:
    """``"step 50/1000 | loss 2.3141 | lr 0.0015 | grad_norm 0.912 | tokens/s 10234 |
    elapsed 12s"``: a train row of ``metrics.jsonl`` in words."""
    return (
        f"step {row['step']}/{end} | loss {row['loss']:.4f} | lr {row['learning_rate']:.3g} | "
        f"grad_norm {row['grad_norm']:.3g} | tokens/s {row['tokens_per_s']:.0f} | "
        f"elapsed {elapsed(seconds)}"
    )


class Progress:
    """What a run shows as it goes, from process 0 only: tqdm's bar while stderr is a
    terminal, and while stdout is not (a cluster job, ``nohup``, CI, a pipe), one plain
    line there per logged row, and the lines of ``note`` (resuming, checkpoints saved).
    ``shown=False`` shows nothing, ``lines=False`` no lines."""

    def __init__(self, start: int, end: int, desc: str, shown: bool = True, lines: bool = True):
        from tqdm.auto import tqdm

        shown = shown and jax.process_index() == 0
        self.lines = shown and lines and not sys.stdout.isatty()
        # disable=None: only on a terminal.
        self.bar = tqdm(initial=start, total=end, desc=desc, disable=None if shown else True)
        self.end, self.began = end, time.perf_counter()

    def note(self, text: str) -> None:
        if self.lines:
            print(text, flush=True)

    def step(self) -> None:
        self.bar.update()

    def row(self, row: dict) -> None:
        """A train row of ``metrics.jsonl``, as the bar's postfix or a line."""
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        self.note(progress_line(row, self.end, time.perf_counter() - self.began))

    def close(self) -> None:
        self.bar.close()


# -- results in words -----------------------------------------------------------


def results_row(config: ConfigDict, final: dict, extra: tuple[str, ...] = ()) -> str:
    """A markdown row (under ``results_header(extra)``) of a run's final evaluation,
    first the values of the fields ``extra``."""
    fields = flatten(config)
    first = "".join(f"| {fields.get(name, '-')} " for name in extra)
    m = config.model
    metric = (
        f"{final['bits_per_byte']:.3f} bits/byte"
        if "bits_per_byte" in final
        else f"{100 * final['accuracy']:.1f}% accuracy"
    )
    return first + (
        f"| {config.task} | {m.attention} | {m.feature_map if m.attention == 'linear' else '-'}"
        f" | {m.width}x{m.depth} | {config.seq_len} | {config.steps} | {final['loss']:.3f} "
        f"| {metric} |"
    )


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
    """``"42s"`` under a minute, else ``"1m08s"`` (minutes, and two digits of seconds)."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def run_title(config: ConfigDict | dict) -> str:
    """``"mqar, linear attention (taylor), width 64"``: what a plot of the run shows."""
    c = ConfigDict(config) if isinstance(config, dict) else config
    m = c.model
    kind = f"{m.attention} attention" + (f" ({m.feature_map})" if m.attention == "linear" else "")
    return f"{c.task}, {kind}, width {m.width}"


# -- figures --------------------------------------------------------------------


def curves_figure(rows: list[dict], config: ConfigDict | dict | None):
    """Train and eval loss (bits per byte for text) and accuracy against step."""
    plt = pyplot()
    import matplotlib.ticker

    text = config is not None and config["task"] == "text_lm"
    scale = 1 / math.log(2) if text else 1.0
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    for split, style in [("train", "-"), ("eval", "o-")]:
        pts = [(r["step"], r["loss"] * scale, r["accuracy"]) for r in rows if r["split"] == split]
        if pts:
            steps, loss, acc = zip(*pts, strict=True)
            ax_loss.plot(steps, loss, style, label=split)
            ax_acc.plot(steps, acc, style, label=split)
    ax_loss.set(xlabel="step", ylabel="bits per byte" if text else "loss", yscale="log")
    for set_formatter in (ax_loss.yaxis.set_major_formatter, ax_loss.yaxis.set_minor_formatter):
        set_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False))  # 2.5, not 2.5e0
    ax_acc.set(xlabel="step", ylabel="next-byte accuracy" if text else "accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    if config is not None:
        fig.suptitle(run_title(config))
    fig.tight_layout()
    return fig


def plot_metrics(workdir: Path) -> None:
    """``workdir/curves.png`` from ``metrics.jsonl`` (titled from ``config.json``)."""
    plt = pyplot()
    workdir = Path(workdir)
    stored = workdir / "config.json"
    config = json.loads(stored.read_text()) if stored.is_file() else None
    fig = curves_figure(read_metrics(workdir / "metrics.jsonl"), config)
    fig.savefig(workdir / "curves.png", dpi=100)
    plt.close(fig)


def results_figure(runs: list[tuple[str, ConfigDict, list[dict]]]):
    """Every run's headline eval metric against step, with the chance level.

    Args:
      runs: (name, config, metrics rows) per run; all of one task.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    spec = TASKS[runs[0][1].task] if runs else TASKS["mqar"]
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
