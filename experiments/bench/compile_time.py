"""Compile time of a config's training step (forward, backward, AdamW) against depth, with
the layers unrolled and scanned (``model.scan_layers``): tracing and lowering, then XLA's
compilation, in seconds, as a markdown table and CSV.

Unrolled, the program holds every layer, so both times grow with the depth; scanned, it
holds one period of the layout (``models.stack``), whatever the depth. A persistent
compilation cache (``JAX_COMPILATION_CACHE_DIR``) would serve repeated programs: leave it
unset for these numbers.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import jax
from flax import nnx

from experiments import trainer
from experiments.bench.timing import write_table
from experiments.configuration import load_config, override
from experiments.tasks import TASKS, build_task

CONFIG = "configs/hybrid.py:small"
FIELDS = ("depth", "scan_layers", "layers_in_program", "lower_s", "compile_s", "total_s")


def step_program(config):
    """``(step, args, blocks)``: one training step of ``config``'s model as a pure function
    of the model's and optimiser's state and the first batch, and the blocks it holds."""
    model = trainer.build_model(config)
    optimizer = nnx.Optimizer(model, trainer.build_optimizer(config), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    batch = build_task(config).batch(0, "train")
    kind = TASKS[config.task].kind

    def step(state, inputs, labels, key_mask):
        model, optimizer = nnx.merge(graphdef, state)
        loss = lambda m: trainer.loss_and_metrics(m, inputs, labels, key_mask, kind)[0]
        optimizer.update(model, nnx.grad(loss)(model))
        return nnx.state((model, optimizer))

    return step, (state, batch.inputs, batch.labels, batch.key_mask), len(model.blocks)


def measure(spec: str, depths, overrides=()) -> list[dict]:
    """Seconds to lower and to compile the training step of ``spec``'s model at each depth,
    unrolled and scanned; one row each, printed as it is measured."""
    rows = []
    for depth in depths:
        for scan in (False, True):
            config = load_config(spec)
            for assignment in (*overrides, f"model.depth={depth}", f"model.scan_layers={scan}"):
                override(config, assignment)
            step, args, blocks = step_program(config)
            start = time.perf_counter()
            lowered = jax.jit(step).lower(*args)  # a new function each time: no cache hit
            lowered_at = time.perf_counter()
            lowered.compile()
            end = time.perf_counter()
            row = dict(depth=depth, scan_layers=scan, layers_in_program=blocks)
            row |= dict(lower_s=lowered_at - start, compile_s=end - lowered_at)
            rows.append(row | {"total_s": end - start})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict], spec: str) -> str:
    """The rows as a markdown table (ending in a newline)."""
    lines = [
        f"| {spec}: depth | layers | layers in the program | lower s | compile s | total s |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['depth']} | {'scanned' if r['scan_layers'] else 'unrolled'} "
        f"| {r['layers_in_program']} | {r['lower_s']:.2f} | {r['compile_s']:.2f} "
        f"| {r['total_s']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def write(rows: list[dict], spec: str, out: Path) -> str:
    """``compile.md`` and ``compile.csv`` in ``out``; returns the table."""
    text = write_table(out, "compile.md", table(rows, spec))
    with open(out / "compile.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return text


def run(args: argparse.Namespace, command: str) -> None:
    """Measures ``args.config`` at ``args.depths``, writes to ``args.out``, prints the table."""
    depths = [int(x) for x in args.depths.split(",") if x]
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        rows = measure(args.config, depths)
    print(write(rows, args.config, Path(args.out)))
