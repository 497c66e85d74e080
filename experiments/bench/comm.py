"""What sequence parallelism sends: bytes per device per layer of linear attention's
state all-gather and the delta rule's ``(M, S_local)`` all-gather against the K/V
all-gather of softmax sequence parallelism, read from the compiled programs on 8
(forced CPU) devices and checked against the analytic count, as a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import linattn_jax as la
from experiments.bench.timing import write_table

SHARDS = 8
# XLA reads its flags at start-up: the benchmark restarts itself with these.
ENV = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={SHARDS}"}


def communication_bytes(
    b: int,
    t: int,
    h: int,
    d: int,
    dv: int,
    f: int,
    shards: int,
    decayed: bool = False,
    itemsize: int = 4,
) -> dict[str, int]:
    """Bytes each device receives per layer: this state all-gather vs a K/V all-gather.

    Each device receives the other ``shards - 1`` shards' states, ``f x (v+1)`` per
    (b, h), plus their total decay (one number per (b, h)) when ``decayed``; for the
    delta rule, their ``(M, S_local)``, ``d x (d + v)`` per (b, h).
    """
    per_shard = b * h * (f * (dv + 1) + (1 if decayed else 0))
    return {
        "linear_state_allgather": (shards - 1) * per_shard * itemsize,
        "delta_state_allgather": (shards - 1) * b * h * d * (d + dv) * itemsize,
        "kv_allgather": (shards - 1) * (t // shards) * b * h * (d + dv) * itemsize,
    }


_ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def allgather_bytes(hlo_text: str) -> int:
    """Total bytes of the all-gather results in a compiled HLO module's text."""
    total = 0
    for line in hlo_text.splitlines():
        match = re.search(r"=\s*\(?(\w+)\[([\d,]*)\][^=]*\ball-gather(?:-start)?\(", line)
        if match and match.group(1) in _ITEMSIZE:
            dims = [int(x) for x in match.group(2).split(",") if x]
            total += _ITEMSIZE[match.group(1)] * math.prod(dims)
    return total


def measure(lengths=(65536, 262144, 1048576), shards: int = SHARDS) -> list[dict]:
    """Bytes per device per layer at each length (b=1, h=8, d=dv=f=64, float32),
    from the compiled programs (``_hlo``) and ``communication_bytes`` (``_analytic``).

    Raises:
      ValueError: fewer than ``shards`` devices.
    """
    if jax.device_count() < shards:
        raise ValueError(f"needs {shards} devices, found {jax.device_count()}")
    mesh = Mesh(np.array(jax.devices()[:shards]), ("seq",))
    b, h, d = 1, 8, 64
    gather_kv = jax.shard_map(
        lambda k, v: (
            jax.lax.all_gather(k, "seq", axis=1, tiled=True),
            jax.lax.all_gather(v, "seq", axis=1, tiled=True),
        ),
        mesh=mesh,
        in_specs=(P(None, "seq"), P(None, "seq")),
        out_specs=(P(), P()),
        check_vma=False,
    )
    linear = jax.jit(
        functools.partial(
            la.sequence_parallel_causal_linear_attention, axis_name="seq", mesh=mesh, chunk_size=256
        )
    )
    delta = jax.jit(functools.partial(la.sequence_parallel_delta_rule, axis_name="seq", mesh=mesh))
    received = lambda fn, *args: (
        allgather_bytes(fn.lower(*args).compile().as_text()) * (shards - 1) // shards
    )
    rows = []
    for t in lengths:
        x = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
        beta = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
        expected = communication_bytes(b, t, h, d, d, d, shards)
        row = dict(
            t=t,
            shards=shards,
            linear_hlo=received(linear, x, x, x),
            linear_analytic=expected["linear_state_allgather"],
            delta_hlo=received(delta, x, x, x, beta),
            delta_analytic=expected["delta_state_allgather"],
            kv_hlo=received(jax.jit(gather_kv), x, x),
            kv_analytic=expected["kv_allgather"],
        )
        row["ratio"] = row["kv_hlo"] / row["linear_hlo"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| t | devices | linear: state all-gather, bytes/device (HLO = analytic) "
        "| delta rule: (M, S) all-gather (HLO = analytic) "
        "| softmax: K/V all-gather, bytes/device (HLO = analytic) | ratio (linear) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['t']} | {r['shards']} | {r['linear_hlo']:,} = {r['linear_analytic']:,}"
        f" | {r['delta_hlo']:,} = {r['delta_analytic']:,}"
        f" | {r['kv_hlo']:,} = {r['kv_analytic']:,} | {r['ratio']:,.0f}x |"
        for r in rows
    ]
    return "\n".join(lines)


def write(rows: list[dict], out: Path) -> str:
    """``communication.md`` in ``out``; returns its table."""
    return write_table(out, "communication.md", table(rows))


def run(args: argparse.Namespace, command: str) -> None:
    """Measures, writes to ``args.out`` and prints the table."""
    print(write(measure(), Path(args.out)))
