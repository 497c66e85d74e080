"""What FSDP saves: the bytes of parameters and of AdamW's state that each device holds,
and the time of a training step, under data parallelism (everything replicated) and
FSDP (``mesh.fsdp=8``: split over every device), for the text LM at two sizes on 8
(forced CPU) devices, as a markdown table. The memory ratio is the point; CPU times only
show that the split step runs, not what an accelerator's interconnect would give.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
from flax import nnx

from experiments import trainer
from experiments.bench import comm
from experiments.bench.timing import write_table
from experiments.configuration import load_config, override
from experiments.tasks import build_task
from linattn_jax import sharding

SHARDS = comm.SHARDS
ENV = comm.ENV  # the forced devices: the benchmark restarts itself with them
SIZES = ("configs/text_lm.py:small", "configs/text_lm.py")
MESHES = {"data parallel": [], "fsdp": [f"mesh.fsdp={SHARDS}"]}


def _run(spec: str, mesh: list[str], repeats: int) -> dict:
    """Bytes per device and the median step time of ``spec``'s model on ``mesh``."""
    config = load_config(spec)
    for assignment in ["progress=false", *mesh]:
        override(config, assignment)
    sharder = trainer.Sharder.of(config)
    task = build_task(config)
    with jax.set_mesh(sharder.mesh):
        model, optimizer = trainer.create_state(config, sharder)
        batch = sharder.put_batch(task.batch(0, "train"))
        jax.block_until_ready(trainer.train_step(model, optimizer, *batch, task.kind))  # compile
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(trainer.train_step(model, optimizer, *batch, task.kind))
            times.append((time.perf_counter() - start) * 1e3)
    params = nnx.state(model, nnx.Param)
    return {
        "config": spec,
        "parameters": sum(x.size for x in jax.tree.leaves(params)),
        "param_bytes": sharding.shard_bytes(params),
        "optimizer_bytes": sharding.shard_bytes(nnx.state(optimizer)),
        "ms": statistics.median(times),
    }


def measure(repeats: int, sizes=SIZES) -> list[dict]:
    """One row per config of ``sizes`` and mesh of ``MESHES``.

    Raises:
      ValueError: fewer than ``SHARDS`` devices.
    """
    if jax.device_count() < SHARDS:
        raise ValueError(f"needs {SHARDS} devices, found {jax.device_count()}")
    rows = []
    for spec in sizes:
        for mesh, overrides in MESHES.items():
            rows.append({"mesh": mesh} | _run(spec, overrides, repeats))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, each FSDP row against its config's data parallel."""
    base = {r["config"]: r for r in rows if r["mesh"] == "data parallel"}
    lines = [
        f"| config | parameters | mesh ({SHARDS} devices) | parameter bytes / device "
        "| AdamW state bytes / device | / data parallel | step ms (CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["param_bytes"] / base[r["config"]]["param_bytes"] if r["config"] in base else 1
        lines.append(
            f"| {r['config']} | {r['parameters']:,} | {r['mesh']} | {r['param_bytes']:,} "
            f"| {r['optimizer_bytes']:,} | {ratio:.3f} | {r['ms']:.0f} |"
        )
    return "\n".join(lines)


def write(rows: list[dict], out: Path) -> str:
    """``fsdp.md`` in ``out``; returns its table."""
    return write_table(out, "fsdp.md", table(rows))


def run(args: argparse.Namespace, command: str) -> None:
    """Measures, writes to ``args.out`` and prints the table."""
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        print(write(measure(args.repeats), Path(args.out)))
