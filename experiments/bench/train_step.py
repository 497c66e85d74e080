"""The time of one training step (forward, backward, AdamW) of a config's model for
each feature map variant (elu; Taylor, with and without feature_dim 16), timed in
turn over several rounds, against elu's, as a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import jax
from flax import nnx

from experiments import trainer
from experiments.bench.timing import write_table
from experiments.configuration import load_config, override
from experiments.tasks import build_task

# A training step of the config's model per feature map (the Taylor speed target).
VARIANTS = {
    "elu": ["model.feature_map=elu"],
    "taylor": ["model.feature_map=taylor"],
    "taylor, feature_dim 16": ["model.feature_map=taylor", "model.feature_dim=16"],
}


def _compiled_step(spec: str, overrides: list[str]):
    """``() -> metrics``: one training step of ``spec``'s model under ``overrides``
    on its first batch, compiled."""
    config = load_config(spec)
    for assignment in overrides:
        override(config, assignment)
    sharder = trainer.Sharder(1)
    model = trainer.build_model(config, sharder.mesh)
    optimizer = nnx.Optimizer(model, trainer.build_optimizer(config), wrt=nnx.Param)
    batch = sharder.put_batch(build_task(config).batch(0, "train"))
    step = functools.partial(trainer.train_step, model, optimizer, *batch, "lm")
    jax.block_until_ready(step())  # compile
    return step


def measure(spec: str, repeats: int, rounds: int = 5) -> list[dict]:
    """Median ms of one training step of ``spec``'s model for each of ``VARIANTS``,
    each round timing ``repeats`` steps of every variant in turn."""
    steps = {name: _compiled_step(spec, overrides) for name, overrides in VARIANTS.items()}
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(repeats):
                out = step()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / repeats * 1e3)
    base = statistics.median(times["elu"])
    return [
        {"variant": n, "ms": statistics.median(t), "vs_elu": statistics.median(t) / base}
        for n, t in times.items()
    ]


def table(rows: list[dict], spec: str) -> str:
    """The rows as a markdown table."""
    lines = [f"| {spec} train step | ms | / elu |", "|---|---|---|"]
    lines += [f"| {r['variant']} | {r['ms']:.1f} | {r['vs_elu']:.2f}x |" for r in rows]
    return "\n".join(lines)


def write(rows: list[dict], spec: str, out: Path) -> str:
    """``train_steps.md`` in ``out``; returns its table."""
    return write_table(out, "train_steps.md", table(rows, spec))


def run(args: argparse.Namespace, command: str) -> None:
    """Measures ``args.config``'s model, writes to ``args.out`` and prints the table."""
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        rows = measure(args.config, args.repeats)
    print(write(rows, args.config, Path(args.out)))
