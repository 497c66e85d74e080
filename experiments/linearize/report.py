"""The linearisation's report: ``results.json``, ``results.md`` (the table and the goal's
three numbers) and ``results.png`` (each stage's curves against the tokens trained on)."""

from __future__ import annotations

import json
from pathlib import Path

from experiments import reporting
from experiments.linearize.student import LABELS

ROWS = (
    ("teacher", "teacher (softmax)"),
    ("transfer", "student after stage 1 (attention transfer)"),
    ("finetune", "student after stage 2 (fine-tuning)"),
    ("scratch", "scratch baseline (the student's architecture, the same tokens)"),
)
# The goal: within 5% of the teacher's loss, with at most 5% of its tokens, closing at
# least 80% of the gap between the scratch baseline and the teacher.
GOAL = {"loss_over_teacher": 0.05, "tokens_fraction": 0.05, "gap_closed": 0.8}


def goal(results: dict) -> dict:
    """The goal's three numbers and whether each is met (the token fraction is None for a
    teacher whose training tokens are unknown)."""
    teacher, student, scratch = (results[k]["loss"] for k in ("teacher", "finetune", "scratch"))
    tokens = results["transfer"]["tokens"] + results["finetune"]["tokens"]
    fraction = tokens / results["teacher"]["tokens"] if results["teacher"]["tokens"] else None
    gap = scratch - teacher
    closed = (scratch - student) / gap if gap else None
    out = {"loss_over_teacher": student / teacher - 1, "tokens_fraction": fraction}
    out["gap_closed"] = closed
    out["met"] = {
        "loss_over_teacher": out["loss_over_teacher"] <= GOAL["loss_over_teacher"],
        "tokens_fraction": fraction is not None and fraction <= GOAL["tokens_fraction"],
        "gap_closed": closed is not None and closed >= GOAL["gap_closed"],
    }
    return out


def table(results: dict) -> str:
    """The markdown table of the four models and the goal's lines."""
    teacher = results["teacher"]["loss"]
    lines = [
        f"Student: {LABELS[results['kind']]}, layers {results['layout']}; corpus: "
        f"{results['corpus']}.",
        "",
        "| model | held-out loss (nats/token) | perplexity | vs teacher | copy accuracy "
        "| tokens trained on |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in ROWS:
        r = results[key]
        copy = f"{100 * r['copy_accuracy']:.1f}%" if "copy_accuracy" in r else "-"
        tokens = f"{r['tokens']:,}" if r["tokens"] else "unknown"
        if key == "finetune":  # the student's, both stages
            tokens = f"{r['tokens'] + results['transfer']['tokens']:,} (stages 1 + 2)"
        lines.append(
            f"| {label} | {r['loss']:.4f} | {r['perplexity']:.2f} | "
            f"{100 * (r['loss'] / teacher - 1):+.1f}% | {copy} | {tokens} |"
        )
    g = goal(results)
    show = lambda x, f: "unknown" if x is None else f.format(x)
    mark = lambda name: "met" if g["met"][name] else "not met"
    lines += [
        "",
        f"- student's loss over the teacher's: {show(g['loss_over_teacher'], '{:+.1%}')} "
        f"(goal <= +5%: {mark('loss_over_teacher')})",
        f"- student's tokens over the teacher's: {show(g['tokens_fraction'], '{:.1%}')} "
        f"(goal <= 5%: {mark('tokens_fraction')})",
        f"- scratch-to-teacher gap closed: {show(g['gap_closed'], '{:.1%}')} "
        f"(goal >= 80%: {mark('gap_closed')})",
    ]
    return "\n".join(lines)


def figure(workdir: Path, results: dict):
    """Stage 1's transfer loss per layer, and the held-out loss of stage 2 (after stage 1's
    tokens) and of the scratch baseline, against the tokens trained on."""
    plt = reporting.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = {s: reporting.read_metrics(workdir / s / "metrics.jsonl") for s in results["stages"]}
    transfer = [r for r in rows["transfer"] if r["split"] == "eval"]
    for key in sorted({k for r in transfer for k in r if k.startswith("mse@")}):
        layer = results["transfer"]["candidates"][int(key.split("@")[1])]
        left.plot([r["tokens"] for r in transfer], [r[key] for r in transfer], "o-",
                  label=f"layer {layer}")  # fmt: skip
    left.set(xlabel="tokens", ylabel="transfer loss (relative MSE)", yscale="log",
             title="stage 1: attention transfer")  # fmt: skip
    offset = results["transfer"]["tokens"]
    curves = [("finetune", offset, "student (stage 2)"), ("scratch", 0, "scratch")]
    for name, shift, label in curves:
        evals = [r for r in rows[name] if r["split"] == "eval"]
        right.plot([r["tokens"] + shift for r in evals], [r["loss"] for r in evals], "o-",
                   label=label)  # fmt: skip
    right.axhline(results["teacher"]["loss"], color="black", linestyle="--", label="teacher")
    right.plot([offset], [results["transfer"]["loss"]], "s", label="student after stage 1")
    right.set(xlabel="tokens", ylabel="held-out loss (nats/token)", title="held-out loss")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def write(workdir: Path, results: dict) -> None:
    """``results.json``, ``results.md`` and ``results.png`` in ``workdir``."""
    results["goal"] = goal(results)
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    (workdir / "results.md").write_text(table(results) + "\n")
    plt = reporting.pyplot()
    fig = figure(workdir, results)
    fig.savefig(workdir / "results.png", dpi=100)
    plt.close(fig)
