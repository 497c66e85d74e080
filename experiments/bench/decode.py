"""Prefill time and decoding speed of ``LanguageModel`` (vocab 256, width 128, depth
2, 4 heads) with linear attention (elu, RetNet decay) against softmax attention (KV
cache), per batch size and context length, and the compiled ``generate`` against a
Python loop of one jitted call per token; as CSV, JSON, a markdown table with the
targets, and a plot.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.bench.timing import time_ms
from experiments.reporting import pyplot
from linattn_jax import layers, models

MODEL = dict(vocab_size=256, width=128, depth=2, num_heads=4, chunk_size=64)
KINDS = {
    "linear": dict(attention="linear", feature_map="elu", decay="retnet"),
    "softmax": dict(attention="softmax"),
}


def decode_model(kind: str) -> models.LanguageModel:
    """The benchmark's ``LanguageModel`` with attention ``kind`` (a key of ``KINDS``)."""
    return models.LanguageModel(**MODEL, **KINDS[kind], rngs=nnx.Rngs(0))


def state_bytes(state) -> int:
    """Bytes of every array of a decoding state (or of its shapes)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def synthetic_state(model, b: int, context: int, cache: int):
    """The state after ``context`` tokens without running them: the right sizes and
    positions (a softmax cache of ``cache`` slots, its first ``context`` valid).
    Decoding's cost does not depend on the values held."""

    def fill(x):
        if isinstance(x, layers.KVCache):
            valid = jnp.broadcast_to(jnp.arange(cache) < context, (b, cache))
            count = jnp.full((b,), context, jnp.int32)
            return x._replace(position=count, mask=valid, real=count)
        if isinstance(x, layers.LinearAttentionCache):
            return x._replace(position=jnp.full((b,), context, jnp.int32))
        return x

    is_cache = lambda x: isinstance(x, (layers.KVCache, layers.LinearAttentionCache))
    return jax.tree.map(fill, model.init_state(b, cache), is_leaf=is_cache)


def python_loop_ms_per_token(model, prompt_len: int, steps: int) -> tuple[float, float]:
    """Wall and CPU ms per token of greedy decoding driven from Python, one jitted
    model call per token (the baseline that the compiled ``generate`` is measured
    against)."""
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

    wall, cpu = time_ms(generate, (), 5, 1)
    return wall / steps, cpu / steps


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def decode_steps(graphdef, variables, logits, state, steps: int):
    """``generate``'s compiled decoding loop (greedy) from ``logits [b, vocab]`` and a state."""
    greedy = lambda logits, i: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    model = nnx.merge(graphdef, variables)
    return models.decode_loop(model, logits, state, steps=steps, sample=greedy)


@functools.partial(jax.jit, static_argnames="graphdef")
def prefill(graphdef, variables, prompt, state):
    """The model on ``prompt`` from ``state``: (logits, the state after it)."""
    return nnx.merge(graphdef, variables)(prompt, state=state, return_state=True)


def decode_row(
    model, kind: str, b: int, context: int, steps: int, run_prefill: bool, warmup_s: float
) -> dict:
    """One benchmark row: prefill (if ``run_prefill``) then ``steps`` decoding steps."""
    graphdef, variables = nnx.split(model)
    row = dict(attention=kind, batch=b, context=context, decode_steps=steps)
    empty = model.init_state(b, context + steps)
    row["state_bytes_per_sequence"] = state_bytes(empty) // b
    if run_prefill:
        prompt = jnp.zeros((b, context), jnp.int32)
        compiled = prefill.lower(graphdef, variables, prompt, empty).compile()
        # Long prefills run once (already compiled); short ones after a warm-up call.
        repeats, warmup = (1, 0) if b * context >= 65536 else (3, 1)
        row["prefill_ms"] = time_ms(compiled, (variables, prompt, empty), repeats, warmup)[0]
        logits, state = compiled(variables, prompt, empty)
        logits = logits[:, -1]
    else:
        state = synthetic_state(model, b, context, context + steps)
        logits = jnp.zeros((b, MODEL["vocab_size"]), jnp.float32)
    row["decode_from"] = "prefill" if run_prefill else "synthetic state"
    decode = functools.partial(decode_steps, graphdef, steps=steps)
    # Linear steps are cheap: many runs steady the median, after 2 s of warm-up runs
    # (for some seconds after a long prefill they run up to 2x slower); long softmax
    # runs: one, after one warm-up run.
    repeats, warmup = (
        (15, warmup_s) if kind == "linear" else ((3, 1) if context < 65536 else (1, 1))
    )
    ms, cpu_ms = time_ms(decode, (variables, logits, state), repeats, warmup)
    row["ms_per_step"] = ms / steps
    row["cpu_ms_per_step"] = cpu_ms / steps
    row["tokens_per_s"] = 1e3 * b * steps / ms
    return row


def _softmax_skip(model, b, context, steps, last, cache_bytes, softmax_ms_budget) -> dict | None:
    """The row of a softmax point that is not run (its cache would exceed
    ``cache_bytes``, or its runs ``softmax_ms_budget``), or None to run it."""
    shapes = jax.eval_shape(functools.partial(model.init_state, b, context + steps))
    cache = state_bytes(shapes)  # not allocated: it may not fit
    # Its step reads the whole cache: time grows linearly with the context.
    estimate = 0 if last is None else last[1] * context / last[0] * steps * 2
    if cache <= cache_bytes and estimate <= softmax_ms_budget:
        return None
    row = dict(attention="softmax", batch=b, context=context)
    row["state_bytes_per_sequence"] = cache // b
    row["skipped"] = "cache too large" if cache > cache_bytes else "too slow"
    return row


def _loop_against_python(readme_prompt: int, readme_steps: int) -> dict:
    """The compiled ``generate`` against ``python_loop_ms_per_token``, per token."""
    model = decode_model("linear")
    prompt = jnp.zeros((1, readme_prompt), jnp.int32)
    old, old_cpu = python_loop_ms_per_token(model, readme_prompt, min(64, readme_steps))
    generate = lambda: model.generate(prompt, readme_steps, temperature=0.0)
    new, new_cpu = (ms / readme_steps for ms in time_ms(generate, (), 5, 2))
    return dict(
        prompt=readme_prompt,
        steps=readme_steps,
        old_python_loop_ms_per_token=old,
        compiled_generate_ms_per_token=new,
        speedup=old / new,
        old_python_loop_cpu_ms_per_token=old_cpu,
        compiled_generate_cpu_ms_per_token=new_cpu,
        cpu_speedup=old_cpu / new_cpu,
    )


def measure(
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
    """Prefill time and decoding speed per attention kind, batch size and context.

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
      and the compiled ``generate`` against the Python loop at the README size
      (``readme_prompt`` tokens of prompt, ``readme_steps`` decoded).
    """
    rows = []
    for kind in KINDS:
        model = decode_model(kind)
        for b in batches:
            last = None  # softmax: (context, ms per step) of the previous row
            for context in contexts:
                steps = 256 if kind == "linear" else (64 if context <= 8192 else 8)
                if kind == "linear":
                    run_prefill = b * context <= prefill_tokens
                else:
                    heads = MODEL["num_heads"]
                    run_prefill = b * heads * context**2 * 4 <= prefill_scores_bytes
                    skip = _softmax_skip(
                        model, b, context, steps, last, cache_bytes, softmax_ms_budget
                    )
                    if skip is not None:
                        rows.append(skip)
                        print(json.dumps(skip), flush=True)
                        continue
                row = decode_row(model, kind, b, context, steps, run_prefill, warmup_s)
                last = (context, row["ms_per_step"])
                rows.append(row)
                print(json.dumps(row), flush=True)
    loop = _loop_against_python(readme_prompt, readme_steps)
    print(json.dumps(loop), flush=True)
    return dict(rows=rows, loop=loop)


def _targets(rows: list[dict], loop: dict) -> list[str]:
    """The markdown table of the targets, met or not, from the rows of this run."""
    by = {(r["attention"], r["batch"], r["context"]): r for r in rows if "ms_per_step" in r}
    lines = ["| target | measured |", "|---|---|"]
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
    return lines


def write(result: dict, out: Path, command: str) -> str:
    """decode.csv, decode.md (tables and targets), decode.json and decode.png;
    returns the markdown."""
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
    lines += ["", *_targets(rows, loop)]
    text = "\n".join(lines) + "\n"
    (out / "decode.md").write_text(text)
    (out / "decode.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "decode.png")
    return text


def plot(rows, path: Path) -> None:
    """Decoded tokens/s against context, one line per (attention, batch)."""
    plt = pyplot()
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


def run(args: argparse.Namespace, command: str) -> None:
    """Measures at ``args``' contexts and batches, writes to ``args.out``, prints the tables."""
    contexts = [int(x) for x in args.decode_contexts.split(",") if x]
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    print(write(measure(contexts, batches), Path(args.out), command))
