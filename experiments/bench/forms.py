"""Speed and memory of every attention form: for b=1, h=8, d=dv=64, float32 and each
length, the forward and the forward+backward (grad of sum(out) w.r.t. q, k, v) of
non-causal linear attention, the causal scan, causal chunked (several chunk sizes)
and softmax attention (``jax.nn.dot_product_attention``, causal and not), with the
compiled scratch memory of each read from XLA, plus that of plain autodiff through a
per-token ``lax.scan`` (compiled, never run); written as CSV, a markdown table with
the ratios the project tracks, and a plot. The medians come from one run, so ratios
between rows are what to quote.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

import linattn_jax as la
from experiments.bench.timing import MALLOC_ENV, dot_gflops, scratch_mib, time_ms
from experiments.reporting import pyplot

FORMS = ("noncausal", "scan", "chunked", "softmax", "softmax_causal")
FIELDS = [
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


def fwd_bwd(fn: Callable) -> Callable:
    """``(q, k, v) ->`` the gradients of ``sum(fn(q, k, v))`` w.r.t. q, k and v."""
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


def measure(lengths, chunk_sizes, repeats, softmax_max, scan_max, backward=True):
    """One row per (length, form, chunk size), printed as it is measured.

    Returns:
      (rows, this machine's ``jnp.dot`` GFLOP/s).
    """
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
            row = dict(t=t, form=form, chunk_size=c or "")
            row["fwd_ms"] = time_ms(fn, (q, k, v), repeats)[0]
            row["fwd_scratch_mib"] = scratch_mib(fn, (q, k, v))
            if backward:
                row["fwd_bwd_ms"] = time_ms(grad, (q, k, v), repeats)[0]
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


def write(rows, dot, out: Path, command: str) -> None:
    """``results.csv``, ``results.md`` (the table and ``summary``) and ``results.png``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({f: row.get(f, "") for f in FIELDS})
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
    """Forward and forward+backward median ms against length, one line per form."""
    plt = pyplot()
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


def run(args: argparse.Namespace, command: str) -> None:
    """Measures ``args``' lengths and chunk sizes, writes to ``args.out`` and prints the table."""
    ints = lambda s: [int(x) for x in s.split(",") if x]
    rows, dot = measure(
        ints(args.lengths),
        ints(args.chunk_sizes),
        args.repeats,
        args.softmax_max,
        args.scan_max,
        backward=not args.forward_only,
    )
    write(rows, dot, Path(args.out), command)
    print((Path(args.out) / "results.md").read_text())
