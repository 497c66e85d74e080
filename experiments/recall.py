"""MQAR accuracy against state size, one line per attention kind (Zoology's plot).

    python -m experiments.recall --config configs/recall.py --workdir runs/recall
    python -m experiments.recall --config configs/recall.py:small --workdir runs/recall_small

Trains every (kind, width, learning rate) of the config's ``recall`` grid, one
workdir each (a rerun skips the finished runs and resumes the others), keeps the best
learning rate per (kind, width), and writes ``<workdir>/recall.md`` (the table),
``recall.json`` and ``recall.png`` (test accuracy against the state size in
floats per layer, log x). The state size is read from the model: the floats its
attention layer keeps to decode one sequence at the longest test length (a linear
layer's S and, when normalised, Z; the delta rule's S; Mamba-2's SSD state; softmax's KV
cache).
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import jax
from absl import logging
from ml_collections import ConfigDict

from experiments import cli, reporting, trainer
from experiments.configuration import flatten
from experiments.tasks import mqar_shapes
from experiments.validation import validate
from linattn_jax import layers, ops

# What each kind sets, over the config's model fields.
KINDS = {
    "softmax": {"attention": "softmax"},
    "elu": {"attention": "linear", "feature_map": "elu"},
    "based": {"attention": "linear", "feature_map": "taylor", "feature_dim": 16},
    "hedgehog": {"attention": "linear", "feature_map": "hedgehog"},
    "retnet": {
        "attention": "linear",
        "feature_map": "identity",
        "decay": "retnet",
        "normalize": False,
    },
    "gla": {"attention": "gla"},
    "deltanet": {"attention": "deltanet"},
    "gated_deltanet": {"attention": "gated_deltanet"},
    "kda": {"attention": "kda"},
    "mlstm": {"attention": "mlstm"},
    # A hybrid: the 2-layer models of the grid alternate the two (Qwen3-Next's is 3:1).
    "hybrid": {"attention": "gated_deltanet : softmax"},
    # Mamba-2 (its own convolution, no short_conv): one SSD head of p = 2 * width channels
    # and a state of n = 32 per channel, so h n p = 64 * width floats (the delta rule's
    # width² at width 64).
    "mamba2": {"attention": "mamba2", "short_conv": 0, "mamba2.state_dim": 32},
    # RWKV-4 (its own token shifts, no short_conv): the time mix and the channel mix as the
    # MLP; the WKV's per-token scan (its chunked form is slower on every device measured).
    "rwkv": {"attention": "rwkv", "mlp": "rwkv", "short_conv": 0, "method": "scan"},
    # Griffin's recurrent block (its own convolution): a state of one float per channel.
    "rglru": {"attention": "rglru", "short_conv": 0},
    # Mamba-1 (its own convolution): 2 * width channels of n = 16 states each, 32 * width
    # floats.
    "mamba": {"attention": "mamba", "short_conv": 0},
}
LABELS = {
    "softmax": "softmax attention",
    "elu": "linear, elu+1",
    "based": "Based (Taylor, feature_dim 16)",
    "hedgehog": "Hedgehog",
    "retnet": "RetNet-style decay",
    "gla": "GLA",
    "deltanet": "DeltaNet",
    "gated_deltanet": "Gated DeltaNet",
    "kda": "KDA",
    "mlstm": "mLSTM (xLSTM)",
    "hybrid": "Gated DeltaNet : softmax, 1:1",
    "mamba2": "Mamba-2 (SSD, state 32)",
    "rwkv": "RWKV-4",
    "rglru": "RG-LRU (Griffin)",
    "mamba": "Mamba-1 (selective scan, state 16)",
}


def _list(config: ConfigDict, field: str, cast) -> list:
    text = config.recall[field]
    try:
        values = [cast(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"recall.{field} must be a comma-separated list, got {text!r}")
    return values


def grid(config: ConfigDict) -> list[tuple[str, int, float, ConfigDict]]:
    """``(kind, width, lr, run config)`` for every point of ``config.recall``, validated.

    Raises:
      ValueError: an unknown kind, a bad list, or a run config that cannot run.
    """
    kinds = _list(config, "kinds", str.strip)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"recall.kinds has unknown kinds {unknown}; known: {tuple(KINDS)}")
    runs = []  # the smallest models of every kind first: a stopped sweep keeps a plot
    for width in _list(config, "widths", int):
        for kind in kinds:
            for lr in _list(config, "lrs", float):
                run = ConfigDict(config.to_dict())
                run.lock()
                for field, value in (KINDS[kind] | {"width": width}).items():
                    *section, name = field.split(".")  # "mamba2.state_dim": a section's
                    target = run.model[section[0]] if section else run.model
                    target[name] = value
                run.optim.lr = lr
                validate(run)
                runs.append((kind, width, lr, run))
    return runs


def run_name(kind: str, width: int, lr: float) -> str:
    """``("elu", 16, 0.003)`` -> ``"elu_w16_lr0.003"``: the run's workdir."""
    return f"{kind}_w{width}_lr{lr:g}"


def finished(config: ConfigDict, workdir: Path) -> dict | None:
    """The final evaluation of a finished run of exactly ``config`` in ``workdir``
    (``recall.*``, ``progress`` and ``resume`` aside), or None."""
    try:
        stored = json.loads((workdir / "config.json").read_text())
        final = json.loads((workdir / "final.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    ignored = lambda name: name.startswith("recall.") or name in ("progress", "resume")
    same = lambda c: {k: v for k, v in flatten(c).items() if not ignored(k)}
    return final if same(stored) == same(config) and final.get("step") == config.steps else None


def state_floats(config: ConfigDict) -> int:
    """Floats of attention state per layer for one sequence at the longest test length (a
    hybrid's: the mean over its layers)."""
    return _state_floats(config.to_json(sort_keys=True))


@functools.cache
def _state_floats(config_json: str) -> int:
    config = ConfigDict(json.loads(config_json))
    length = max(t for t, _ in mqar_shapes(config, "eval"))
    model = trainer.build_model(config)
    total = 0
    for block in model.blocks:
        attention = block.attention
        cache = jax.eval_shape(lambda attention=attention: attention.init_state(1, length))
        if isinstance(cache, layers.KVCache):
            held = (cache.k, cache.v)
        elif isinstance(cache, layers.Mamba2Cache | layers.MambaCache):
            held = cache.ssm  # the convolution's few floats are not counted
        elif isinstance(cache, layers.RGLRUCache):
            held = cache.lru  # h; the convolution's few floats are not counted
        elif isinstance(cache, ops.mlstm.State):
            held = cache  # C, n and m
        elif isinstance(cache, layers.RWKVState):
            held = cache  # the WKV's num, den and m, and the time mix's previous input
        elif isinstance(cache, layers.LinearAttentionCache) and not attention.normalize:
            held = cache.state.s  # no denominator: Z is never read
        else:
            held = cache.state
        total += sum(x.size for x in jax.tree.leaves(held))
    return total // len(model.blocks)


def best_points(config: ConfigDict, finals: dict[str, dict]) -> list[dict]:
    """One row per (kind, width): the learning rate with the best mean test accuracy."""
    points = {}
    for kind, width, lr, run in grid(config):
        final = finals.get(run_name(kind, width, lr))
        if final is None:
            continue
        best = points.get((kind, width))
        if best is None or final["accuracy"] > best["accuracy"]:
            points[kind, width] = {"kind": kind, "width": width, "lr": lr, "config": run} | final
    rows = []
    for point in points.values():
        run = point.pop("config")
        rows.append(point | {"state_floats": state_floats(run)})
    return rows


def table(rows: list[dict], splits: list[str]) -> str:
    """The markdown table of ``best_points``' rows, one accuracy column per test split."""
    head = " | ".join(f"acc {s}" for s in splits)
    lines = [
        f"| kind | width | state floats / layer | best lr | {head} | mean |",
        "|---|---|---|---|" + "---|" * len(splits) + "---|",
    ]
    for r in rows:
        accs = " | ".join(f"{100 * r[f'accuracy@{s}']:.1f}%" for s in splits)
        lines.append(
            f"| {LABELS[r['kind']]} | {r['width']} | {r['state_floats']:,} | {r['lr']:g} "
            f"| {accs} | {100 * r['accuracy']:.1f}% |"
        )
    return "\n".join(lines)


def figure(rows: list[dict], splits: list[str]):
    """Mean test accuracy against state floats (log x), one line per kind."""
    plt = reporting.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    markers = "osD^vP*Xhp<>"
    for i, kind in enumerate(dict.fromkeys(r["kind"] for r in rows)):
        pts = sorted((r["state_floats"], r["accuracy"]) for r in rows if r["kind"] == kind)
        x, y = zip(*pts, strict=True)
        style = dict(color="black", linestyle="--") if kind == "softmax" else {}
        ax.plot(x, y, marker=markers[i % len(markers)], label=LABELS[kind], **style)
    ax.set(
        xscale="log",
        xlabel="state size (floats per layer; softmax: KV cache at the longest test length)",
        ylabel=f"MQAR test accuracy (mean of {', '.join(splits)})",
        ylim=(-0.02, 1.02),
        title="Recall against memory: MQAR accuracy by state size",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def write_results(config: ConfigDict, workdir: Path, finals: dict[str, dict]) -> list[dict]:
    """``recall.md``, ``recall.json`` and ``recall.png`` in ``workdir``; returns the rows."""
    splits = [f"{t}x{n}" for t, n in mqar_shapes(config, "eval")]
    rows = best_points(config, finals)
    (workdir / "recall.md").write_text(table(rows, splits) + "\n")
    (workdir / "recall.json").write_text(json.dumps(rows, indent=2))
    if rows:
        plt = reporting.pyplot()
        fig = figure(rows, splits)
        fig.savefig(workdir / "recall.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the grid; returns the exit status (1 when a run failed)."""
    parser = cli.make_parser("python -m experiments.recall", __doc__.split("\n")[0])
    try:
        args, config = cli.parse(parser, argv)
        cli.use_compilation_cache(args.compilation_cache)
        if config.task != "mqar" or "recall" not in config:
            raise ValueError(f"{args.config} is not a recall config (task mqar with recall.*)")
        runs = grid(config)
    except ValueError as e:
        return cli.report(parser.prog, e, cli.wants_verbose(argv))
    if args.print_config:
        print(cli.format_config(config))
        return 0
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    finals, failed, begin = {}, 0, time.perf_counter()
    for i, (kind, width, lr, run) in enumerate(runs, 1):
        name, start = run_name(kind, width, lr), time.perf_counter()
        try:
            final = finished(run, workdir / name) or trainer.train(
                run, workdir / name, verbose=args.verbose, lines=False
            )
        except (ValueError, OSError, FloatingPointError) as e:
            if args.verbose:
                traceback.print_exception(e)
            failed += 1
            took = reporting.elapsed(time.perf_counter() - start)
            result = f"failed after {took}: {' '.join(str(e).split())}"
        else:
            finals[name] = final
            took = reporting.elapsed(time.perf_counter() - start)
            result = f"{reporting.summary(final)} ({took})"
        print(f"[{i}/{len(runs)}] {name}: {result}", flush=True)
        write_results(config, workdir, finals)  # after every run: a stopped grid keeps its table
        jax.clear_caches()  # each run's compiled steps: dozens of runs exhaust LLVM's memory maps
    print((workdir / "recall.md").read_text(), end="")
    print(
        f"{len(runs)} runs in {reporting.elapsed(time.perf_counter() - begin)}; plot: "
        f"{workdir / 'recall.png'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
