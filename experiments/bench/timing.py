"""How the benchmark suites measure: the median wall and process-CPU time of a call
after warm-up, XLA's compiled scratch memory, this machine's ``jnp.dot`` throughput
as a yardstick, and the restart that gives the process glibc's malloc settings (and
any XLA flags) that are read only at start-up; and where they write their tables.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

# glibc returns buffers over 32 MiB to the OS after each call, so every call pays
# page faults for them again; these keep the memory (read once, at process start).
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(2**32),
    "MALLOC_TRIM_THRESHOLD_": str(2**32),
    "MALLOC_TOP_PAD_": str(2**30),
}


def time_ms(
    fn: Callable, args: tuple, repeats: int, warmup: int | float = 1
) -> tuple[float, float]:
    """Median wall and process-CPU time of ``fn(*args)`` in ms, after ``warmup``
    calls (an int; the first one compiles) or at least ``warmup`` seconds of calls
    (a float).

    On a shared machine the CPU time is the steadier of the two: it leaves out the
    time this process waited for a core.
    """
    start = time.perf_counter()
    calls = 0
    while (calls < warmup) if isinstance(warmup, int) else (time.perf_counter() - start < warmup):
        jax.block_until_ready(fn(*args))
        calls += 1
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def scratch_mib(fn: Callable, args: tuple) -> float:
    """XLA's compiled temporary (scratch) memory of ``jax.jit(fn)`` in MiB."""
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes / 2**20


def dot_gflops(n: int = 2048, repeats: int = 10) -> float:
    """This machine's float32 ``jnp.dot`` throughput on an n x n matmul."""
    x = jnp.ones((n, n), jnp.float32)
    ms = time_ms(jax.jit(jnp.dot), (x, x), repeats)[0]
    return 2 * n**3 / (ms * 1e-3) / 1e9


def restart_with(env: dict[str, str]) -> None:
    """Restarts this process as ``python -m experiments.benchmark`` with the same
    arguments under ``env`` added to its environment, unless it already has ``env``
    or ``LINATTN_BENCH_MALLOC`` is not ``1`` (glibc and XLA read these at start-up)."""
    if os.environ.get("LINATTN_BENCH_MALLOC", "1") == "1" and any(
        os.environ.get(k) != v for k, v in env.items()
    ):
        os.execve(
            sys.executable,
            [sys.executable, "-m", "experiments.benchmark", *sys.argv[1:]],
            os.environ | env,
        )


def write_table(out: Path, name: str, text: str, command: str | None = None) -> str:
    """``text`` (a markdown table) as ``out / name``, ending in one newline, under the
    command that made it when given; returns ``text``."""
    out.mkdir(parents=True, exist_ok=True)
    header = "" if command is None else f"`{command}`\n\n"
    (out / name).write_text(header + text.rstrip("\n") + "\n")
    return text
