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


DECODE_MODEL = dict(vocab_size=256, width=128, depth=2, num_heads=4, chunk_size=64)
DECODE_KINDS = {
    "linear": dict(attention="linear", feature_map="elu", decay="retnet"),
    "softmax": dict(attention="softmax"),
}


def _decode_model(kind: str):
    from flax import nnx

    from linattn_jax import models

    return models.LanguageModel(**DECODE_MODEL, **DECODE_KINDS[kind], rngs=nnx.Rngs(0))


def _state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def _synthetic_state(model, b: int, context: int, cache: int):
    """The state after ``context`` tokens without running them: the right sizes and
    positions (a softmax cache of ``cache`` slots, its first ``context`` valid).
    Decoding's cost does not depend on the values held."""
    from linattn_jax import layers

    def fill(x):
        if isinstance(x, layers.KVCache):
            valid = jnp.broadcast_to(jnp.arange(cache) < context, (b, cache))
            return x._replace(position=jnp.full((b,), context, jnp.int32), mask=valid)
        if isinstance(x, layers.LinearAttentionCache):
            return x._replace(position=jnp.full((b,), context, jnp.int32))
        return x

    is_cache = lambda x: isinstance(x, (layers.KVCache, layers.LinearAttentionCache))
    return jax.tree.map(fill, model.init_state(b, cache), is_leaf=is_cache)


def _old_python_loop_ms(model, prompt_len: int, steps: int) -> float:
    """ms per token of the pre-issue-16 ``generate``: one jitted call per token from Python."""
    from flax import nnx

    prefill = nnx.jit(lambda m, tokens, state: m(tokens, state=state, return_state=True))
    step = nnx.jit(lambda m, token, state: m(token, state=state, return_state=True))

    def generate():
        prompt = jnp.zeros((1, prompt_len), jnp.int32)
        logits, state = prefill(model, prompt, model.init_state(1, prompt_len + steps))
        tokens = [prompt]
        for i in range(steps):
            token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
            tokens.append(token)
            if i + 1 < steps:
                logits, state = step(model, token, state)
        return jnp.concatenate(tokens, axis=1)

    wall, cpu = wall_and_cpu_ms(generate, (), 5, 1)
    return wall / steps, cpu / steps


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def _decode_steps(graphdef, variables, logits, state, steps: int):
    """``generate``'s compiled decoding loop (greedy) from ``logits [b, vocab]`` and a state."""
    from flax import nnx

    from linattn_jax import models

    greedy = lambda logits, i: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    model = nnx.merge(graphdef, variables)
    return models.decode_loop(model, logits, state, steps=steps, sample=greedy)


@functools.partial(jax.jit, static_argnames="graphdef")
def _prefill(graphdef, variables, prompt, state):
    from flax import nnx

    return nnx.merge(graphdef, variables)(prompt, state=state, return_state=True)


def _decode_row(
    model, kind: str, b: int, context: int, steps: int, run_prefill: bool, warmup_s: float
) -> dict:
    """One benchmark row: prefill (if ``run_prefill``) then ``steps`` decoding steps."""
    from flax import nnx

    graphdef, variables = nnx.split(model)
    row = dict(attention=kind, batch=b, context=context, decode_steps=steps)
    empty = model.init_state(b, context + steps)
    row["state_bytes_per_sequence"] = _state_bytes(empty) // b
    if run_prefill:
        prompt = jnp.zeros((b, context), jnp.int32)
        prefill = _prefill.lower(graphdef, variables, prompt, empty).compile()
        # Long prefills run once (already compiled); short ones after a warm-up call.
        repeats, warmup = (1, 0) if b * context >= 65536 else (3, 1)
        row["prefill_ms"] = wall_and_cpu_ms(prefill, (variables, prompt, empty), repeats, warmup)[0]
        logits, state = prefill(variables, prompt, empty)
        logits = logits[:, -1]
    else:
        state = _synthetic_state(model, b, context, context + steps)
        logits = jnp.zeros((b, DECODE_MODEL["vocab_size"]), jnp.float32)
    row["decode_from"] = "prefill" if run_prefill else "synthetic state"
    decode = functools.partial(_decode_steps, graphdef, steps=steps)
    # Linear steps are cheap: many runs steady the median, after 2 s of warm-up runs
    # (for some seconds after a long prefill they run up to 2x slower); long softmax
    # runs: one, after one warm-up run.
    repeats, warmup = (
        (15, warmup_s) if kind == "linear" else ((3, 1) if context < 65536 else (1, 1))
    )
    ms, cpu_ms = wall_and_cpu_ms(decode, (variables, logits, state), repeats, warmup)
    row["ms_per_step"] = ms / steps
    row["cpu_ms_per_step"] = cpu_ms / steps
    row["tokens_per_s"] = 1e3 * b * steps / ms
    return row


def wall_and_cpu_ms(
    fn: Callable, args: tuple, repeats: int, warmup: int | float
) -> tuple[float, float]:
    """Median wall and process-CPU time of ``fn(*args)`` in ms, after ``warmup``
    calls (an int) or at least ``warmup`` seconds of calls (a float).

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


def decode_per_token(
    contexts=(1024, 8192, 65536, 262144),
    batches=(1, 16),
    *,
    prefill_tokens: int = 262144,
    prefill_scores_bytes: int = 2**30,
    cache_bytes: int = 2**32,
    softmax_ms_budget: float = 60_000.0,
    readme_prompt: int = 16,
    readme_steps: int = 256,
    warmup_s: float = 2.0,
) -> dict:
    """Prefill time and decoding speed of ``LanguageModel`` (the README's model:
    vocab 256, width 128, depth 2, 4 heads) with linear attention (elu, RetNet
    decay) and softmax attention (KV cache), per batch size and context length.

    Prefill is run (and timed) where it fits: linear while ``b * context <=
    prefill_tokens``, softmax while its ``[b, h, t, t]`` float32 scores take at most
    ``prefill_scores_bytes``. Elsewhere decoding starts from a synthetic state of the
    same shapes and position. Decoding is ``generate``'s own compiled loop (greedy),
    timed over a run of steps (one call: its time includes copying the given
    state into the loop, a few % for the largest KV caches). Softmax is skipped
    where its cache would exceed ``cache_bytes`` or its runs would take longer
    than ``softmax_ms_budget``. Linear decoding is timed after ``warmup_s`` seconds
    of warm-up runs.

    Returns:
      ``{"rows": [...], "loop": {...}}``: one row per (attention, batch, context)
      and the compiled ``generate`` against the old Python loop at the README size.
    """
    rows = []
    for kind in DECODE_KINDS:
        model = _decode_model(kind)
        for b in batches:
            last = None  # softmax: (context, ms per step) of the previous row
            for context in contexts:
                steps = 256 if kind == "linear" else (64 if context <= 8192 else 8)
                if kind == "linear":
                    run_prefill = b * context <= prefill_tokens
                else:
                    heads = DECODE_MODEL["num_heads"]
                    run_prefill = b * heads * context**2 * 4 <= prefill_scores_bytes
                    shapes = jax.eval_shape(functools.partial(model.init_state, b, context + steps))
                    cache = _state_bytes(shapes)  # not allocated: it may not fit
                    # Its step reads the whole cache: time grows linearly with the context.
                    estimate = 0 if last is None else last[1] * context / last[0] * steps * 2
                    if cache > cache_bytes or estimate > softmax_ms_budget:
                        row = dict(attention=kind, batch=b, context=context)
                        row["state_bytes_per_sequence"] = cache // b
                        row["skipped"] = "cache too large" if cache > cache_bytes else "too slow"
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        continue
                row = _decode_row(model, kind, b, context, steps, run_prefill, warmup_s)
                last = (context, row["ms_per_step"])
                rows.append(row)
                print(json.dumps(row), flush=True)

    model = _decode_model("linear")
    prompt = jnp.zeros((1, readme_prompt), jnp.int32)
    old, old_cpu = _old_python_loop_ms(model, readme_prompt, min(64, readme_steps))
    generate = lambda: model.generate(prompt, readme_steps, temperature=0.0)
    new, new_cpu = (ms / readme_steps for ms in wall_and_cpu_ms(generate, (), 5, 2))
    loop = dict(
        prompt=readme_prompt,
        steps=readme_steps,
        old_python_loop_ms_per_token=old,
        compiled_generate_ms_per_token=new,
        speedup=old / new,
        old_python_loop_cpu_ms_per_token=old_cpu,
        compiled_generate_cpu_ms_per_token=new_cpu,
        cpu_speedup=old_cpu / new_cpu,
    )
    print(json.dumps(loop), flush=True)
    return dict(rows=rows, loop=loop)


def write_decode_outputs(result: dict, out: Path, command: str) -> str:
    """decode.csv, decode.md (tables and targets) and decode.png; returns the markdown."""
    rows, loop = result["rows"], result["loop"]
    out.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "decode.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    cell = lambda r, k, f: "—" if k not in r else format(r[k], f)
    lines = [
        f"`{command}` ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, jax {jax.__version__})",
        "",
        "| attention | batch | context | prefill ms | decode ms/step (CPU ms) | tokens/s "
        "| state bytes/sequence | decoding from |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['attention']} | {r['batch']} | {r['context']:,}"
            f" | {cell(r, 'prefill_ms', ',.0f')}"
            f" | {cell(r, 'ms_per_step', '.3f')} ({cell(r, 'cpu_ms_per_step', '.3f')})"
            f" | {cell(r, 'tokens_per_s', ',.0f')}"
            f" | {r['state_bytes_per_sequence']:,} | {r.get('decode_from', r.get('skipped'))} |"
        )
    by = {(r["attention"], r["batch"], r["context"]): r for r in rows if "ms_per_step" in r}
    lines += ["", "| target | measured |", "|---|---|"]
    for b in sorted({r["batch"] for r in rows}):
        lin = sorted(
            (c, r["ms_per_step"]) for (a, bb, c), r in by.items() if a == "linear" and bb == b
        )
        upto = [(c, ms) for c, ms in lin if c <= 65536]
        if len(upto) >= 2:
            wall, cpu = (
                max(r[key] for r in same) / min(r[key] for r in same) - 1
                for same in [[by[("linear", b, c)] for c, _ in upto]]
                for key in ("ms_per_step", "cpu_ms_per_step")
            )
            lines.append(
                f"| linear decode flat in context, b={b} (within 10%, {upto[0][0]:,} to "
                f"{upto[-1][0]:,}) | spread {100 * wall:.0f}% wall, {100 * cpu:.0f}% CPU: "
                f"{'met' if cpu <= 0.10 else 'not met'} (CPU time) |"
            )
        for c in (65536,):
            if ("linear", b, c) in by and ("softmax", b, c) in by:
                ratio = by[("softmax", b, c)]["ms_per_step"] / by[("linear", b, c)]["ms_per_step"]
                lines.append(
                    f"| linear vs softmax per step at {c:,}, b={b} | {ratio:,.0f}x faster |"
                )
    lines.append(
        f"| compiled `generate` >= 30x faster per token than the old Python loop "
        f"(b=1, {loop['prompt']}-token prompt, {loop['steps']} tokens) "
        f"| {loop['old_python_loop_ms_per_token']:.3f} -> "
        f"{loop['compiled_generate_ms_per_token']:.4f} ms: {loop['speedup']:.0f}x "
        f"(CPU time: {loop['cpu_speedup']:.0f}x), "
        f"{'met' if loop['speedup'] >= 30 else 'not met'} |"
    )
    text = "\n".join(lines) + "\n"
    (out / "decode.md").write_text(text)
    (out / "decode.json").write_text(json.dumps(result, indent=1))
    plot_decode(rows, out / "decode.png")
    return text


def plot_decode(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, style in (("linear", "-o"), ("softmax", "--s")):
        for b in sorted({r["batch"] for r in rows}):
            pts = sorted(
                (r["context"], r["tokens_per_s"])
                for r in rows
                if r["attention"] == kind and r["batch"] == b and "tokens_per_s" in r
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"{kind}, batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens already seen)")
    ax.set_ylabel("decoded tokens/s (all rows)")
    ax.set_title("LanguageModel decoding (vocab 256, width 128, depth 2)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def communication(lengths=(65536, 262144, 1048576), shards: int = 8) -> list[dict]:
    """Bytes per device per layer: sequence-parallel linear attention's state
    all-gather (and the delta rule's ``(M, S_local)``) against the K/V all-gather
    of softmax sequence parallelism, b=1,
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
        delta = jax.jit(
            functools.partial(la.sequence_parallel_delta_rule, axis_name="seq", mesh=mesh)
        )
        beta = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
        expected = sp.communication_bytes(b, t, h, d, d, d, shards)
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


# A training step of the MQAR model per feature map (the speed issue's Taylor target).
TRAIN_STEP_VARIANTS = {
    "elu": ["model.feature_map=elu"],
    "taylor": ["model.feature_map=taylor"],
    "taylor, feature_dim 16": ["model.feature_map=taylor", "model.feature_dim=16"],
}


def train_steps(spec: str, repeats: int, rounds: int = 5) -> list[dict]:
    """Median ms of one training step (forward, backward, AdamW) of ``spec``'s model
    for each of ``TRAIN_STEP_VARIANTS``, timed in turn over ``rounds`` rounds."""
    from flax import nnx

    from experiments import trainer

    steps = {}
    for name, overrides in TRAIN_STEP_VARIANTS.items():
        config = trainer.load_config(spec)
        for assignment in overrides:
            trainer.override(config, assignment)
        sharder = trainer.Sharder(1)
        model = trainer.build_model(config, sharder.mesh)
        optimizer = nnx.Optimizer(model, trainer.build_optimizer(config), wrt=nnx.Param)
        batch = sharder.put_batch(trainer.build_task(config).batch(0, "train"))
        step = functools.partial(trainer.train_step, model, optimizer, *batch, "lm")
        jax.block_until_ready(step())  # compile
        steps[name] = step
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
        help="prefill and decoding speed of LanguageModel, linear vs softmax, per context",
    )
    parser.add_argument("--decode-contexts", default="1024,8192,65536,262144")
    parser.add_argument("--decode-batches", default="1,16")
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
    parser.add_argument(
        "--train-steps",
        metavar="CONFIG",
        nargs="?",
        const="configs/mqar.py:small",
        help="a training step of CONFIG's model (default configs/mqar.py:small) for elu and "
        "Taylor features (with and without feature_dim 16)",
    )
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    if args.comm:
        rows = communication()
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
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "communication.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    if args.train_steps:
        with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
            rows = train_steps(args.train_steps, args.repeats)
        lines = [f"| {args.train_steps} train step | ms | / elu |", "|---|---|---|"]
        lines += [f"| {r['variant']} | {r['ms']:.1f} | {r['vs_elu']:.2f}x |" for r in rows]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "train_steps.md").write_text("\n".join(lines) + "\n")
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
        command = "python -m experiments.benchmark " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        contexts = [int(x) for x in args.decode_contexts.split(",") if x]
        batches = [int(x) for x in args.decode_batches.split(",") if x]
        result = decode_per_token(contexts, batches)
        print(write_decode_outputs(result, Path(args.out), command.strip()))
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
