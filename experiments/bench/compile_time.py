"""Compile time of a config's training step (forward, backward, AdamW) against depth, with
the layers unrolled and scanned (``model.scan_layers``): tracing and lowering, then XLA's
compilation, in seconds, as a markdown table and CSV.

Unrolled, the program holds every layer, so both times grow with the depth; scanned, it
holds one period of the layout (``models.stack``), whatever the depth. A persistent
compilation cache (``JAX_COMPILATION_CACHE_DIR``) would serve repeated programs: leave it
unset for these numbers.

``--hf`` instead sweeps a loaded Qwen3.5-shaped model (``hf.pretrained.abstract_model``:
three Gated DeltaNet layers to one attention layer, bfloat16, at ``--width``) over
``--depths``: its forward of ``--prefill`` tokens (tracing and lowering, XLA's compile, a
step) and ``generate`` of ``--decode-steps`` greedy tokens (its compile, the first call less
the second, and the time per token), unrolled unless ``--scan-layers`` (``measure_hf``).
``--recurrence scan`` runs the Gated DeltaNet layers' per-token scan instead of their chunked
form: what the model costs to compile with the simplest recurrence, a bound on what any
change to the chunked form can save.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
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
HF_FIELDS = (
    "depth",
    "recurrence",
    "scan_layers",
    "forward_lower_s",
    "forward_compile_s",
    "forward_ms",
    "generate_compile_s",
    "decode_ms_per_token",
)


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


def hf_config(depth: int, width: int) -> dict:
    """A normalised ``qwen3_5_text`` config of ``depth`` layers (Qwen3.5's layout: every
    fourth layer attention) at ``width``, vocabulary 4096: heads of 64 channels, Gated
    DeltaNet with as many key as value heads, an MLP of 3.5 ``width``."""
    from linattn_jax import hf

    heads = max(1, width // 64)
    raw = dict(
        model_type="qwen3_5_text",
        vocab_size=4096,
        hidden_size=width,
        intermediate_size=width * 7 // 2,
        num_hidden_layers=depth,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
    )
    return hf.qwen3_5.FORMAT.normalize_config(raw)


def hf_model(depth: int, width: int, recurrence: str = "chunked", scan_layers: bool = False):
    """The ``LanguageModel`` of ``hf_config(depth, width)`` with random bfloat16 weights, as
    ``from_pretrained`` builds it, its Gated DeltaNet layers' ``method`` ``recurrence``."""
    import jax.numpy as jnp

    from linattn_jax.hf import pretrained
    from linattn_jax.models import LanguageModel

    config = hf_config(depth, width)
    fmt = pretrained.format_of(config)
    options = fmt.model_options(config, jnp.bfloat16)
    kinds = dict(options["kind_options"])
    kinds["gated_deltanet"] = {**kinds["gated_deltanet"], "method": recurrence}
    options = {**options, "kind_options": kinds, "scan_layers": scan_layers}
    model = LanguageModel(**options, rngs=nnx.Rngs(0))
    fmt.finish(model, config)
    return model


def _median_s(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_hf(
    depths,
    width: int = 256,
    prefill: int = 128,
    steps: int = 16,
    recurrence: str = "chunked",
    scan_layers: bool = False,
) -> list[dict]:
    """One row per depth (``measure_hf_depth``), printed as it is measured."""
    rows = []
    for depth in depths:
        rows.append(measure_hf_depth(depth, width, prefill, steps, recurrence, scan_layers))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_hf_depth(
    depth: int,
    width: int,
    prefill: int,
    steps: int,
    recurrence: str = "chunked",
    scan_layers: bool = False,
) -> dict:
    """The Qwen3.5-shaped model of ``depth`` layers (``hf_config``, random bfloat16
    weights; its Gated DeltaNet layers' ``method`` ``recurrence``, its layers scanned with
    ``scan_layers``): its forward of ``prefill`` tokens traced and lowered, compiled by XLA
    and run (the median of 3); ``generate`` of ``steps`` greedy tokens after a 16-token
    prompt (NaN when ``steps`` is 0): its compile (the first call less the median of 3
    more) and time per token. New functions each time: nothing comes from JAX's in-memory
    caches."""
    import jax.numpy as jnp

    model = hf_model(depth, width, recurrence, scan_layers)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    tokens = jnp.ones((1, prefill), jnp.int32)
    start = time.perf_counter()
    lowered = forward.lower(state, tokens)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    row = dict(depth=depth, recurrence=recurrence, scan_layers=scan_layers)
    row["forward_lower_s"] = lowered_at - start
    row["forward_compile_s"] = compiled_at - lowered_at
    row["forward_ms"] = 1e3 * _median_s(lambda: compiled(state, tokens))
    row |= dict(generate_compile_s=math.nan, decode_ms_per_token=math.nan)
    if steps:
        prompt = jnp.ones((1, 16), jnp.int32)
        call = lambda: model.generate(prompt, steps, temperature=0.0)
        start = time.perf_counter()
        jax.block_until_ready(call())
        first = time.perf_counter() - start
        again = _median_s(call)
        row |= dict(generate_compile_s=first - again, decode_ms_per_token=1e3 * again / steps)
    return row


def hf_table(rows: list[dict], width: int, prefill: int, steps: int) -> str:
    """``measure_hf``'s rows as a markdown table (ending in a newline)."""
    lines = [
        f"| depth (3 Gated DeltaNet : 1 attention, width {width}) | recurrence | layers "
        f"| forward of {prefill} tokens: trace + lower s | XLA compile s | run ms "
        f"| generate ({steps} tokens): compile s | ms / token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['depth']} | {r['recurrence']} | {'scanned' if r['scan_layers'] else 'unrolled'} "
        f"| {r['forward_lower_s']:.2f} | {r['forward_compile_s']:.2f} "
        f"| {r['forward_ms']:.1f} | {r['generate_compile_s']:.2f} "
        f"| {r['decode_ms_per_token']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, command: str) -> None:
    """Measures ``args.config`` at ``args.depths`` (``--hf``: the Qwen3.5-shaped model,
    ``measure_hf``), writes to ``args.out``, prints the table."""
    depths = [int(x) for x in args.depths.split(",") if x]
    if args.hf:
        rows = measure_hf(
            depths, args.width, args.prefill, args.decode_steps, args.recurrence, args.scan_layers
        )
        out = Path(args.out)
        text = write_table(
            out, "compile_hf.md", hf_table(rows, args.width, args.prefill, args.decode_steps),
            command,
        )  # fmt: skip
        with open(out / "compile_hf.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=HF_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(text)
        return
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        rows = measure(args.config, depths)
    print(write(rows, args.config, Path(args.out)))
