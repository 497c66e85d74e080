"""``hf-load``: how long ``linattn_jax.hf.from_pretrained`` takes to load a synthetic Qwen3.5
checkpoint of about ``--params`` parameters (bfloat16), the process's peak memory while it
does, the loaded model's forward of ``--prefill`` tokens (tracing and lowering, XLA's compile,
the run), ``generate``'s compile (its first call less its second) and decoding speed: unrolled
and with ``scan_layers=True`` (the layers' period compiled once), side by side.

The checkpoint (Qwen3.5's layout, three Gated DeltaNet layers to one attention layer,
its 248,320-token vocabulary, tied embeddings, width 1024; the depth set by ``--params``) is
written once with ``safetensors`` into ``--out`` and reused. Each measurement runs in a
fresh process with glibc's default malloc settings and no compilation cache, so its peak RSS
(``resource.getrusage``) is the loader's, beside the RSS after the imports, and each first call
compiles.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from linattn_jax import hf

# Qwen3.5's small dense shape (width 1024), tied embeddings: only the depth varies.
BASE = dict(
    model_type="qwen3_5_text",
    architectures=["Qwen3_5ForCausalLM"],
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    dtype="bfloat16",
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
)

MEASURE = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp
from linattn_jax import hf

def rss_mib():
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("VmRSS"))
    return int(line.split()[1]) / 1024

path, steps, batch, scan = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
prefill = int(sys.argv[5])
before = rss_mib()
start = time.perf_counter()
model, config = hf.from_pretrained(path, jnp.bfloat16, scan_layers=scan)
jax.block_until_ready(jax.tree.leaves(model))
load_s = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out = dict(load_s=load_s, rss_before_mib=before, peak_rss_mib=peak)
if prefill:
    from flax import nnx
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    tokens = jnp.ones((batch, prefill), jnp.int32)
    start = time.perf_counter()
    lowered = forward.lower(state, tokens)  # tracing and lowering to StableHLO
    out["forward_lower_s"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()  # XLA
    out["forward_compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(state, tokens))
    out["forward_s"] = time.perf_counter() - start
if steps:
    prompt = jnp.ones((batch, 16), jnp.int32)
    start = time.perf_counter()
    jax.block_until_ready(model.generate(prompt, steps, temperature=0.0))
    first = time.perf_counter() - start  # compiles
    start = time.perf_counter()
    jax.block_until_ready(model.generate(prompt, steps, temperature=0.0))
    again = time.perf_counter() - start
    out["generate_compile_s"] = first - again
    out["decode_tokens_per_s"] = batch * steps / again
print(json.dumps(out))
"""


def config_for(params: float) -> dict:
    """``BASE`` with the depth (a multiple of 4) whose parameter count is nearest ``params``."""
    period = dict(BASE, num_hidden_layers=4)
    embed = BASE["vocab_size"] * BASE["hidden_size"]
    per_period = _count(period) - embed - BASE["hidden_size"]
    periods = max(1, round((params - embed) / per_period))
    return dict(BASE, num_hidden_layers=4 * periods)


def _count(config: dict) -> int:
    tensors = hf.expected_tensors(hf.qwen3_5.FORMAT.normalize_config(config))
    return sum(math.prod(shape) for shape, _ in tensors.values())


def write_checkpoint(path: str, config: dict, max_shard_size: str = "400MB") -> float:
    """Writes random bfloat16 weights of ``config`` to ``path`` (one tensor at a time);
    returns the seconds it took. Norm gains are 0 (the ``1 + w`` form), ``A_log`` and
    ``dt_bias`` small, the rest N(0, 0.02)."""
    import ml_dtypes

    start = time.perf_counter()
    normalized = hf.qwen3_5.FORMAT.normalize_config(config)
    tensors = hf.expected_tensors(normalized)
    rng = np.random.default_rng(0)

    def make(name: str) -> np.ndarray:
        shape = tensors[name][0]
        if "norm" in name:
            x = np.zeros(shape, np.float32)
        elif name.endswith(("A_log", "dt_bias")):
            x = rng.uniform(0.0, 1.0, shape).astype(np.float32)
        else:
            x = rng.standard_normal(shape, np.float32) * np.float32(0.02)
        return x.astype(ml_dtypes.bfloat16)

    shapes = {name: (shape, np.dtype(ml_dtypes.bfloat16)) for name, (shape, _) in tensors.items()}
    hf.safetensors_io.write(path, shapes, make, max_shard_size)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return time.perf_counter() - start


def run(args, command: str) -> None:
    config = config_for(args.params)
    count = _count(config)
    path = os.path.join(args.out, f"hf_qwen3_5_{count / 1e9:.2f}b")
    written = None
    existing = os.path.join(path, "config.json")
    if not (os.path.exists(existing) and json.load(open(existing)) == config):
        os.makedirs(path, exist_ok=True)
        written = write_checkpoint(path, config)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    # A fresh process each (no compilation cache: JAX's is off unless the environment
    # sets it), with glibc's default malloc.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k != "JAX_COMPILATION_CACHE_DIR"
    }
    measured = []
    for scan in (0, 1):
        argv = [path, args.decode_steps, args.decode_batch, scan, args.prefill]
        result = subprocess.run(
            [sys.executable, "-c", MEASURE, *map(str, argv)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode:
            raise RuntimeError(f"the measuring process failed:\n{result.stderr[-4000:]}")
        measured.append(json.loads(result.stdout.strip().splitlines()[-1]))
    both = lambda fmt, key: [fmt(m[key]) for m in measured]
    rows = [
        ("command", [f"`{command}`", ""]),
        ("parameters", [f"{count / 1e9:.3f} B ({config['num_hidden_layers']} layers)", ""]),
        ("checkpoint", [f"{size / 2**20:.0f} MiB of bfloat16 safetensors", ""]),
        ("written in", ["reused" if written is None else f"{written:.1f} s", ""]),
        ("load (from_pretrained, bfloat16)", both("{:.2f} s".format, "load_s")),
        ("RSS after the imports", both("{:.0f} MiB".format, "rss_before_mib")),
        ("peak RSS", both("{:.0f} MiB".format, "peak_rss_mib")),
        (
            "peak RSS - imports, over the checkpoint",
            [f"{(m['peak_rss_mib'] - m['rss_before_mib']) / (size / 2**20):.2f}" for m in measured],
        ),
    ]
    if args.prefill:
        rows += [
            (
                f"forward of {args.prefill} tokens: trace + lower",
                both("{:.1f} s".format, "forward_lower_s"),
            ),
            ("... XLA compile", both("{:.1f} s".format, "forward_compile_s")),
            ("... run", both("{:.2f} s".format, "forward_s")),
        ]
    if args.decode_steps:
        rows += [
            (
                "generate: first call - second (compiling)",
                both("{:.1f} s".format, "generate_compile_s"),
            ),
            (
                f"decode, batch {args.decode_batch}, {args.decode_steps} greedy steps",
                both("{:.1f} tokens/s".format, "decode_tokens_per_s"),
            ),
        ]
    table = "| | unrolled | scan_layers=True |\n|---|---|---|\n" + "\n".join(
        f"| {a} | {b} | {c} |" for a, (b, c) in rows
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hf_load.md"), "w") as f:
        f.write(table + "\n")
    print(table)
