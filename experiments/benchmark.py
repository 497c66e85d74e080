"""Speed and memory of every attention form, as CSV, a markdown table and a plot.

    python -m experiments.benchmark --out bench_out

times, for b=1, h=8, d=dv=64, float32 and each length, the forward and the
forward+backward (grad of sum(out) w.r.t. q, k, v) of: non-causal linear
attention, causal scan, causal chunked (several chunk sizes), and softmax
attention (``jax.nn.dot_product_attention``, causal and not); and reads the
compiled scratch memory of each from XLA (``memory_analysis()``), plus that of
plain autodiff through a per-token ``lax.scan`` (compiled, never run). The
medians come from one run, so ratios between rows are what to quote.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

import linattn_jax as la

FORMS = ("noncausal", "scan", "chunked", "softmax", "softmax_causal")

# glibc returns buffers over 32 MiB to the OS after each call, so every call pays
# page faults for them again; these keep the memory (read once, at process start).
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(2**32),
    "MALLOC_TRIM_THRESHOLD_": str(2**32),
    "MALLOC_TOP_PAD_": str(2**30),
}


def median_ms(fn: Callable, args: tuple, repeats: int) -> float:
    """Median wall time of ``fn(*args)`` in ms, after one compiling call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def scratch_mib(fn: Callable, args: tuple) -> float:
    """XLA's compiled temporary (scratch) memory of ``jax.jit(fn)`` in MiB."""
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes / 2**20


def attention_fn(form: str, chunk_size: int = 64) -> Callable:
    """``(q, k, v) -> out`` for one form; all ``[b, t, h, d]``."""
    if form == "noncausal":
        return la.linear_attention
    if form in ("scan", "chunked"):
        return functools.partial(la.causal_linear_attention, method=form, chunk_size=chunk_size)
    if form in ("softmax", "softmax_causal"):
        return functools.partial(jax.nn.dot_product_attention, is_causal=form == "softmax_causal")
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def plain_autodiff_scan(q, k, v):
    """Causal linear attention as a per-token ``lax.scan`` with no custom gradient."""
    phi = la.feature_maps.elu
    seq_first = functools.partial(jnp.moveaxis, source=1, destination=0)
    b, _, h, d = q.shape

    def step(carry, x):
        s, z = carry
        qi, ki, vi = x
        s = s + jnp.einsum("bhf,bhv->bhfv", ki, vi)
        z = z + ki
        out = jnp.einsum("bhf,bhfv->bhv", qi, s) / (
            jnp.einsum("bhf,bhf->bh", qi, z)[..., None] + 1e-6
        )
        return (s, z), out

    init = (jnp.zeros((b, h, d, v.shape[-1])), jnp.zeros((b, h, d)))
    _, out = jax.lax.scan(step, init, (seq_first(phi(q)), seq_first(phi(k)), seq_first(v)))
    return jnp.moveaxis(out, 0, 1)


RECURRENCES = {
    # name: (form, gate shape: None, "head" or "channel")
    "additive_decay": ("additive", "head"),
    "gla": ("additive", "channel"),
    "deltanet": ("delta", None),
    "gated_deltanet": ("delta", "head"),
    "kda": ("delta", "channel"),
}


def recurrence_case(name: str, method: str, t: int, b: int = 1, h: int = 8, d: int = 64):
    """``(fn, args)`` for one recurrence: ``fn(*args) -> out``, differentiable in every arg."""
    form, gated = RECURRENCES[name]
    keys = jax.random.split(jax.random.PRNGKey(t), 5)
    q, k, v = (jax.random.normal(kk, (b, t, h, d), jnp.float32) for kk in keys[:3])
    gate_shape = {None: None, "head": (b, t, h), "channel": (b, t, h, d)}[gated]
    gate = None if gate_shape is None else -jax.nn.softplus(jax.random.normal(keys[3], gate_shape))
    if form == "additive":
        fn = lambda q, k, v, gate: la.causal_linear_attention(q, k, v, gate=gate, method=method)
        return fn, (q, k, v, gate)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
    fn = lambda q, k, v, beta, gate: la.delta_rule(q, k, v, beta, gate=gate, method=method)
    return fn, (q, k, v, beta, gate)


def recurrences(lengths, repeats: int, scan_max: int, names=tuple(RECURRENCES)) -> list[dict]:
    """Forward and forward+backward of every recurrence family, chunked and scan."""
    rows = []
    for t in lengths:
        key = jax.random.PRNGKey(t)
        q, k, v = (jax.random.normal(kk, (1, t, 8, 64)) for kk in jax.random.split(key, 3))
        cases = [("noncausal", "", la.linear_attention, (q, k, v))]
        for name in names:
            for method in ("chunked", "scan"):
                if method == "scan" and t > scan_max:
                    continue
                cases.append((name, method, *recurrence_case(name, method, t)))
        for name, method, fn, args in cases:
            argnums = tuple(i for i, a in enumerate(args) if a is not None)
            grad = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a)), argnums=argnums)
            row = dict(t=t, recurrence=name, method=method)
            row["fwd_ms"] = median_ms(jax.jit(fn), args, repeats)
            row["fwd_bwd_ms"] = median_ms(jax.jit(grad), args, repeats)
            row["fwd_bwd_scratch_mib"] = scratch_mib(grad, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def recurrence_table(rows: list[dict]) -> str:
    lines = [
        "| t | recurrence | method | fwd ms | fwd+bwd ms | fwd+bwd scratch MiB |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['t']} | {r['recurrence']} | {r['method']} | {r['fwd_ms']:.1f} "
        f"| {r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_scratch_mib']:.1f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def fwd_bwd(fn: Callable) -> Callable:
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))


def forward_flops(form: str, t: int, h: int, d: int, chunk_size: int) -> float:
    """Matmul FLOPs executed by one forward (masked halves counted), b=1."""
    dv = d  # S and Z apart: the denominator is a reduction, not counted
    if form == "noncausal":
        return 2 * h * (2 * t * d * dv)
    if form == "chunked":
        c = min(chunk_size, t)
        return 2 * h * t * (c * d + c * dv + 2 * d * dv)
    return float("nan")


def dot_gflops(n: int = 2048, repeats: int = 10) -> float:
    """This machine's float32 ``jnp.dot`` throughput on an n x n matmul."""
    x = jnp.ones((n, n), jnp.float32)
    ms = median_ms(jax.jit(jnp.dot), (x, x), repeats)
    return 2 * n**3 / (ms * 1e-3) / 1e9


def run(lengths, chunk_sizes, repeats, softmax_max, scan_max, backward=True):
    b, h, d = 1, 8, 64
    rows = []
    dot = dot_gflops()
    for t in lengths:
        key = jax.random.PRNGKey(t)
        q, k, v = (
            jax.random.normal(kk, (b, t, h, d), jnp.float32) for kk in jax.random.split(key, 3)
        )
        cases = [("noncausal", None), ("scan", 64)] + [("chunked", c) for c in chunk_sizes]
        if t <= softmax_max:
            cases += [("softmax", None), ("softmax_causal", None)]
        for form, c in cases:
            if form == "scan" and t > scan_max:
                continue
            fn = jax.jit(attention_fn(form, c or 64))
            grad = jax.jit(fwd_bwd(fn))
            row = dict(t=t, form=form, chunk_size=c or "", fwd_ms=median_ms(fn, (q, k, v), repeats))
            row["fwd_scratch_mib"] = scratch_mib(fn, (q, k, v))
            if backward:
                row["fwd_bwd_ms"] = median_ms(grad, (q, k, v), repeats)
                row["fwd_bwd_scratch_mib"] = scratch_mib(grad, (q, k, v))
            flops = forward_flops(form, t, h, d, c or 64)
            row["fwd_gflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e9
            row["fwd_vs_dot"] = row["fwd_gflops"] / dot
            rows.append(row)
            print(json.dumps(row), flush=True)
        if backward:
            rows.append(
                dict(
                    t=t,
                    form="scan_plain_autodiff",
                    chunk_size="",
                    fwd_bwd_scratch_mib=scratch_mib(fwd_bwd(plain_autodiff_scan), (q, k, v)),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows, dot


def _fmt(x, spec=".1f"):
    return "" if x in (None, "") else format(x, spec)


def write_outputs(rows, dot, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = [
        "t",
        "form",
        "chunk_size",
        "fwd_ms",
        "fwd_bwd_ms",
        "fwd_scratch_mib",
        "fwd_bwd_scratch_mib",
        "fwd_gflops",
        "fwd_vs_dot",
    ]
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({f: row.get(f, "") for f in fields})
    lines = [
        f"`{command}`",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__}, {jax.default_backend()}; b=1, h=8, d=dv=64, float32; "
        f"jnp.dot 2048^2: {dot:.0f} GFLOP/s; "
        + ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in MALLOC_ENV)
        + ".",
        "",
        "| t | form | C | fwd ms | fwd+bwd ms | fwd scratch MiB | fwd+bwd scratch MiB "
        "| fwd / jnp.dot |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['t']} | {r['form']} | {r['chunk_size']} | {_fmt(r.get('fwd_ms'))} "
            f"| {_fmt(r.get('fwd_bwd_ms'))} | {_fmt(r.get('fwd_scratch_mib'))} "
            f"| {_fmt(r.get('fwd_bwd_scratch_mib'))} | {_fmt(r.get('fwd_vs_dot'), '.2f')} |"
        )
    lines += ["", *summary(rows)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "results.png")


def summary(rows) -> list[str]:
    """The ratios the project tracks, from the rows of this one run."""
    at = {(r["t"], r["form"], r["chunk_size"]): r for r in rows}
    best = lambda t, key: min(
        (r for r in rows if r["t"] == t and r["form"] == "chunked" and r.get(key) is not None),
        key=lambda r: r[key],
        default=None,
    )
    out = ["| ratio (this run) | value |", "|---|---|"]
    for t in sorted({r["t"] for r in rows}):
        nc, scan = at.get((t, "noncausal", "")), at.get((t, "scan", 64))
        chunked = best(t, "fwd_bwd_ms")
        soft = at.get((t, "softmax_causal", ""))
        plain = at.get((t, "scan_plain_autodiff", ""))
        if nc and chunked and "fwd_bwd_ms" in nc:
            out.append(
                f"| t={t}: chunked (C={chunked['chunk_size']}) fwd+bwd / non-causal "
                f"fwd+bwd | {chunked['fwd_bwd_ms'] / nc['fwd_bwd_ms']:.2f} |"
            )
            out.append(
                f"| t={t}: chunked fwd+bwd scratch / non-causal | "
                f"{chunked['fwd_bwd_scratch_mib'] / nc['fwd_bwd_scratch_mib']:.2f} |"
            )
        if nc and scan and "fwd_bwd_ms" in nc:
            out.append(
                f"| t={t}: scan fwd+bwd / non-causal fwd+bwd | "
                f"{scan['fwd_bwd_ms'] / nc['fwd_bwd_ms']:.2f} |"
            )
        if plain and chunked:
            out.append(
                f"| t={t}: plain-autodiff scan scratch / chunked scratch (fwd+bwd) | "
                f"{plain['fwd_bwd_scratch_mib'] / chunked['fwd_bwd_scratch_mib']:.1f} |"
            )
        if soft and chunked:
            out.append(
                f"| t={t}: softmax causal fwd+bwd / chunked fwd+bwd | "
                f"{soft['fwd_bwd_ms'] / chunked['fwd_bwd_ms']:.1f} |"
            )
        fastest = best(t, "fwd_ms")
        if nc and fastest:
            out.append(
                f"| t={t}: forward FLOP/s / jnp.dot FLOP/s: non-causal, chunked "
                f"(C={fastest['chunk_size']}) | {nc['fwd_vs_dot']:.2f}, "
                f"{fastest['fwd_vs_dot']:.2f} |"
            )
    return out


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, title in [
        (axes[0], "fwd_ms", "forward"),
        (axes[1], "fwd_bwd_ms", "forward + backward"),
    ]:
        series: dict[str, list] = {}
        for r in rows:
            if r.get(key) is not None:
                label = r["form"] + (f" C={r['chunk_size']}" if r["form"] == "chunked" else "")
                series.setdefault(label, []).append((r["t"], r[key]))
        for label, pts in series.items():
            ts, ms = zip(*sorted(pts), strict=True)
            ax.plot(ts, ms, marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="sequence length t", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median ms (b=1, h=8, d=64, float32)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def decode_per_token(prompts=(128, 8192), repeats: int = 20) -> list[dict]:
    """Median ms per generated token of ``LanguageModel`` after prompts of each length.

    Linear attention's step costs the same whatever the prompt; softmax's grows
    with its KV cache (sized to the prompt plus the generated tokens).
    """
    from flax import nnx

    from linattn_jax import models

    rows = []
    for attention in ("linear", "softmax"):
        for t in prompts:
            model = models.LanguageModel(
                256,
                256,
                2,
                4,
                attention=attention,
                chunk_size=64,
                max_length=t + repeats + 2,
                rngs=nnx.Rngs(0),
            )
            prompt = jnp.zeros((1, t), jnp.int32)
            _, state = models._prefill(model, prompt, model.init_state(1, t + repeats + 2))
            token = jnp.zeros((1, 1), jnp.int32)
            jax.block_until_ready(models._decode(model, token, state))  # compile
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                _, state = models._decode(model, token, state)
                jax.block_until_ready(state)
                times.append(time.perf_counter() - start)
            rows.append(
                dict(attention=attention, prompt=t, ms_per_token=1e3 * statistics.median(times))
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def communication(lengths=(65536, 262144, 1048576), shards: int = 8) -> list[dict]:
    """Bytes per device per layer: sequence-parallel linear attention's state
    all-gather against the K/V all-gather of softmax sequence parallelism, b=1,
    h=8, d=dv=f=64, float32, read from the compiled programs and checked against
    the analytic count (``sequence_parallel.communication_bytes``)."""
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from linattn_jax import sequence_parallel as sp

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
    rows = []
    for t in lengths:
        x = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
        linear = jax.jit(
            functools.partial(
                la.sequence_parallel_causal_linear_attention,
                axis_name="seq",
                mesh=mesh,
                chunk_size=256,
            )
        )
        received = lambda fn, *args: (
            sp.allgather_bytes(fn.lower(*args).compile().as_text()) * (shards - 1) // shards
        )
        expected = sp.communication_bytes(b, t, h, d, d, d, shards)
        row = dict(
            t=t,
            shards=shards,
            linear_hlo=received(linear, x, x, x),
            linear_analytic=expected["linear_state_allgather"],
            kv_hlo=received(jax.jit(gather_kv), x, x),
            kv_analytic=expected["kv_allgather"],
        )
        row["ratio"] = row["kv_hlo"] / row["linear_hlo"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> None:
    env = dict(MALLOC_ENV)
    if "--comm" in sys.argv[1:]:  # 8 CPU devices, which XLA reads at start-up too
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    if (
        argv is None
        and os.environ.get("LINATTN_BENCH_MALLOC", "1") == "1"
        and any(os.environ.get(k) != v for k, v in env.items())
    ):
        # Restart this process with the malloc settings (glibc reads them at start-up).
        os.execve(
            sys.executable,
            [sys.executable, "-m", "experiments.benchmark", *sys.argv[1:]],
            os.environ | env,
        )
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192,16384,65536")
    parser.add_argument("--chunk-sizes", default="64,128,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--softmax-max", type=int, default=8192, help="longest t for softmax (its t x t scores)"
    )
    parser.add_argument("--scan-max", type=int, default=65536)
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument(
        "--decode",
        action="store_true",
        help="time generate's per-token step after prompts of 128 and 8192",
    )
    parser.add_argument(
        "--comm",
        action="store_true",
        help="communication of sequence parallelism on 8 (forced CPU) devices",
    )
    parser.add_argument(
        "--recurrences",
        action="store_true",
        help="the additive, GLA and delta-rule recurrences (chunked and scan) at --lengths",
    )
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    if args.comm:
        rows = communication()
        lines = [
            "| t | devices | linear: state all-gather, bytes/device (HLO = analytic) "
            "| softmax: K/V all-gather, bytes/device (HLO = analytic) | ratio |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['t']} | {r['shards']} | {r['linear_hlo']:,} = {r['linear_analytic']:,}"
            f" | {r['kv_hlo']:,} = {r['kv_analytic']:,} | {r['ratio']:,.0f}x |"
            for r in rows
        ]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "communication.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    if args.recurrences:
        ints = lambda s: [int(x) for x in s.split(",") if x]
        rows = recurrences(ints(args.lengths), args.repeats, args.scan_max)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        table = recurrence_table(rows)
        (Path(args.out) / "recurrences.md").write_text(table)
        print(table)
        return
    if args.decode:
        rows = decode_per_token()
        lines = ["| attention | prompt | ms per generated token |", "|---|---|---|"]
        lines += [f"| {r['attention']} | {r['prompt']} | {r['ms_per_token']:.2f} |" for r in rows]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    ints = lambda s: [int(x) for x in s.split(",") if x]
    rows, dot = run(
        ints(args.lengths),
        ints(args.chunk_sizes),
        args.repeats,
        args.softmax_max,
        args.scan_max,
        backward=not args.forward_only,
    )
    command = "python -m experiments.benchmark " + " ".join(sys.argv[1:] if argv is None else argv)
    write_outputs(rows, dot, Path(args.out), command.strip())
    print((Path(args.out) / "results.md").read_text())


if __name__ == "__main__":
    main()
