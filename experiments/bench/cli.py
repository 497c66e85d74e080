"""The command line of ``python -m experiments.benchmark``: one subcommand per suite
(``forms``, ``recurrences``, ``decode``, ``comm``, ``fsdp``, ``train-step``, ``compile``,
``hf-load``, ``peers``, ``triangular``, ``moe``, ``device``, ``scan-layers``), each taking
only its own flags, and the flat command line without a subcommand, which takes every flag and
runs the suite that ``--recurrences``, ``--decode``, ``--comm`` or ``--train-steps`` names
(the forms when none does; ``compile``, ``fsdp``, ``hf-load``, ``peers``, ``triangular``,
``moe``, ``device`` and ``scan-layers`` are subcommands only).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from experiments.bench import (
    comm,
    compile_time,
    decode,
    device,
    forms,
    fsdp,
    hf_load,
    moe,
    peers,
    recurrences,
    scan_layers,
    train_step,
    triangular,
)
from experiments.bench.timing import MALLOC_ENV, restart_with

DESCRIPTION = "Speed and memory of every attention form, as CSV, a markdown table and a plot."
TRAIN_CONFIG = "configs/mqar.py:small"

# Every suite's flags, each defined once.
FLAGS = {
    "--lengths": dict(
        default="512,1024,2048,4096,8192,16384,65536", help="sequence lengths, comma-separated"
    ),
    "--chunk-sizes": dict(default="64,128,256", help="the chunked form's chunk sizes"),
    "--repeats": dict(type=int, default=5, help="timed calls (train-step: steps) per median"),
    "--softmax-max": dict(type=int, default=8192, help="longest t for softmax (its t x t scores)"),
    "--scan-max": dict(type=int, default=65536, help="longest t for the per-token scan"),
    "--forward-only": dict(action="store_true", help="time the forward alone"),
    "--decode-contexts": dict(
        default="1024,8192,65536,262144", help="decoding's context lengths, comma-separated"
    ),
    "--decode-batches": dict(default="1,16", help="decoding's batch sizes, comma-separated"),
    "--config": dict(
        metavar="CONFIG",
        default=TRAIN_CONFIG,
        help=f"the experiment config whose model is timed (default {TRAIN_CONFIG})",
    ),
    "--depths": dict(default="2,4,8,16", help="compile's model depths, comma-separated"),
    "--hf": dict(
        action="store_true",
        help="compile: sweep a Qwen3.5-shaped model (3 Gated DeltaNet : 1 attention, bfloat16) "
        "over --depths instead: its forward's and generate's compile and step times",
    ),
    "--width": dict(type=int, default=256, help="compile --hf: the model width"),
    "--recurrence": dict(
        default="chunked",
        choices=("chunked", "scan"),
        help="compile --hf: the Gated DeltaNet layers' method (scan: the simplest recurrence)",
    ),
    "--scan-layers": dict(action="store_true", help="compile --hf: the layers scanned"),
    "--params": dict(type=float, default=0.5e9, help="hf-load: the checkpoint's parameters"),
    "--decode-steps": dict(type=int, default=64, help="hf-load: greedy steps timed (0: none)"),
    "--decode-batch": dict(type=int, default=1, help="hf-load: the decoding batch"),
    "--prefill": dict(
        type=int, default=512, help="hf-load: the tokens of the timed forward (0: none)"
    ),
    "--families": dict(
        default="",
        help="recurrences: the families timed (default all); peers --impl: theirs "
        "(default gated_deltanet; causal, noncausal: a (q, k, v) peer such as Performer's; "
        "state_products_cC, all_products_cC: the bare chunk matmuls in ours' place)",
    ),
    "--cpu-groups": dict(
        default="", help="recurrences: tokens per group of chunks on CPU (default: one chunk)"
    ),
    "--impl": dict(
        metavar="MODULE:FUNCTION",
        default=None,
        help="peers: an external JAX function to time against ours (default: Performer-style)",
    ),
    "--feature-map": dict(
        default="elu",
        choices=("elu", "relu"),
        help="peers: both sides' features against the Performer-style baseline",
    ),
    "--heads": dict(type=int, default=8, help="peers: heads of the Performer case"),
    "--limit-s": dict(type=float, default=300.0, help="seconds each triangular case may run"),
    "--moe-widths": dict(default="256,512,1024", help="moe: the model widths, comma-separated"),
    "--tokens": dict(type=int, default=4096, help="moe: the tokens of each step"),
    "--out": dict(default="bench_out", help="the folder the results are written to"),
    "--dtypes": dict(default="bfloat16,float32", help="device: the kernels' dtypes"),
    "--budget-s": dict(
        type=float, default=200.0, help="device: seconds after which the rest is skipped"
    ),
    "--smallest": dict(action="store_true", help="device: every part at toy sizes (CPU)"),
    "--peers": dict(
        default="",
        help="device: peers timed beside ours on the same inputs, FAMILY=MODULE:FUNCTION, "
        "comma-separated (placed outside the project, as peers --impl)",
    ),
    "--depth": dict(type=int, default=8, help="scan-layers: the models' depth"),
    "--layouts": dict(
        default=scan_layers.LAYOUTS, help="scan-layers: the attention layouts, comma-separated"
    ),
}

# Subcommand: (its module, what it measures, its flags besides --out).
SUITES = {
    "forms": (
        forms,
        "forward and forward+backward of every attention form (the default)",
        (
            "--lengths",
            "--chunk-sizes",
            "--repeats",
            "--softmax-max",
            "--scan-max",
            "--forward-only",
        ),
    ),
    "recurrences": (
        recurrences,
        "the additive, GLA and delta-rule recurrences (chunked and scan) at --lengths",
        (
            "--lengths",
            "--repeats",
            "--scan-max",
            ("--chunk-sizes", dict(default="", help="chunk sizes (default: each family's)")),
            "--families",
            "--cpu-groups",
        ),
    ),
    "peers": (
        peers,
        "ours against other JAX implementations: a Performer-style baseline (additive, "
        "causal and non-causal) or --impl MODULE:FUNCTION on --families",
        (
            "--lengths",
            "--repeats",
            "--families",
            "--impl",
            "--feature-map",
            "--heads",
        ),
    ),
    "triangular": (
        triangular,
        "the delta rule's triangular systems batched over all chunks: each method, float32 "
        "and bfloat16 inputs, at the first of --lengths and each of --chunk-sizes",
        ("--lengths", "--chunk-sizes", "--repeats", "--limit-s"),
    ),
    "decode": (
        decode,
        "prefill and decoding speed of LanguageModel, linear vs softmax, per context",
        ("--decode-contexts", "--decode-batches"),
    ),
    "comm": (comm, "communication of sequence parallelism on 8 (forced CPU) devices", ()),
    "fsdp": (
        fsdp,
        "parameter and AdamW bytes per device and step time of the text LM at two sizes, "
        "data parallel vs FSDP, on 8 (forced CPU) devices",
        (("--repeats", dict(default=3, help="timed steps per median")),),
    ),
    "train-step": (
        train_step,
        "a training step of CONFIG's model (default configs/mqar.py:small) for elu and "
        "Taylor features (with and without feature_dim 16)",
        ("--config", "--repeats"),
    ),
    "compile": (
        compile_time,
        f"compile time of a training step of CONFIG's model (default {compile_time.CONFIG}) "
        "against --depths, its layers unrolled and scanned",
        (
            (
                "--config",
                dict(default=compile_time.CONFIG, help=f"default {compile_time.CONFIG}"),
            ),
            "--depths",
            "--hf",
            "--width",
            "--recurrence",
            "--scan-layers",
            ("--prefill", dict(default=128, help="--hf: the forward's tokens")),
            ("--decode-steps", dict(default=16, help="--hf: generate's greedy tokens")),
        ),
    ),
    "hf-load": (
        hf_load,
        "load time and peak memory of from_pretrained on a synthetic Qwen3.5 checkpoint of "
        "--params parameters (written once to --out), its compile and decoding times, unrolled "
        "and scanned",
        ("--params", "--decode-steps", "--decode-batch", "--prefill"),
    ),
}
SUITES["moe"] = (
    moe,
    "a MoE layer's training step against a dense SwiGLU of the same active parameters at "
    "--moe-widths, its scratch memory, and the dispatch's share",
    ("--moe-widths", "--tokens", "--repeats"),
)
SUITES["device"] = (
    device,
    "one table for a lent GPU: the additive form (per-head and per-channel gate), Gated "
    "DeltaNet, Mamba-2's SSD and the mLSTM, ours in XLA and Pallas (where accepted), "
    "jax-linear-attention's (where importable) and --peers; a MoE layer against a dense SwiGLU "
    "of the same active parameters; forward and forward+backward at --lengths and --dtypes, "
    "then a Qwen3.5-shaped model's prefill and greedy decoding, within --budget-s",
    (
        ("--lengths", dict(default="4096,32768")),
        ("--dtypes", {}),
        (
            "--families",
            dict(help="device: additive_decay, gla, gated_deltanet, ssd, mlstm, moe (default all)"),
        ),
        "--peers",
        ("--repeats", dict(default=5)),
        ("--params", dict(help="device: the model's parameters (Qwen3.5's width 1024)")),
        ("--prefill", dict(default=8192, help="device: the model's prefill tokens (0: none)")),
        ("--decode-steps", dict(default=128, help="device: greedy steps timed (0: none)")),
        ("--decode-batch", dict(help="device: the prefill's and decoding's batch")),
        "--budget-s",
        "--smallest",
    ),
)
SUITES["scan-layers"] = (
    scan_layers,
    "a model's forward and per-token decoding with its layers scanned against unrolled "
    "(the same parameters), for each of --layouts, interleaved; ratios scanned / unrolled",
    (
        "--layouts",
        "--depth",
        "--width",
        ("--prefill", dict(default=256, help="scan-layers: the forward's tokens")),
        ("--decode-steps", dict(default=32, help="scan-layers: decoding steps timed")),
        ("--decode-batch", dict(help="scan-layers: the forward's and decoding's batch")),
        ("--repeats", dict(default=10)),
    ),
)
# The flat command line's suite flags, in the order they win: (attribute, suite).
PICKS = (("comm", "comm"), ("train_steps", "train-step"), ("recurrences", "recurrences"))
PICKS += (("decode", "decode"),)


def _add(parser: argparse.ArgumentParser, flags) -> None:
    """Each flag of FLAGS, or ``(flag, what this suite changes in it)``."""
    for flag in flags:
        flag, own = flag if isinstance(flag, tuple) else (flag, {})
        parser.add_argument(flag, **(FLAGS[flag] | own))


def make_parser() -> argparse.ArgumentParser:
    """The flat command line (every flag, a suite picked by flag) with one
    subcommand per suite."""
    parser = argparse.ArgumentParser(
        usage="%(prog)s [SUITE] [flags]",
        description=DESCRIPTION,
        epilog="Each suite is also a subcommand with only its own flags: "
        "python -m experiments.benchmark SUITE --help.",
    )
    # Not the flat line's:
    own = ("--config", "--out", "--dtypes", "--budget-s", "--smallest", "--peers", "--depth")
    own += ("--layouts",)
    _add(parser, [f for f in FLAGS if f not in own])
    for attribute, suite in PICKS:
        flag = "--" + attribute.replace("_", "-")
        if suite == "train-step":
            parser.add_argument(
                flag, metavar="CONFIG", nargs="?", const=TRAIN_CONFIG, help=SUITES[suite][1]
            )
        else:
            parser.add_argument(flag, action="store_true", help=SUITES[suite][1])
    _add(parser, ["--out"])
    subcommands = parser.add_subparsers(dest="suite", metavar="SUITE", title="suites")
    for name, (_, description, flags) in SUITES.items():
        sub = subcommands.add_parser(name, help=description, description=description)
        _add(sub, (*flags, "--out"))
    return parser


def parse(argv: Sequence[str]) -> tuple[str, argparse.Namespace]:
    """The suite that ``argv`` runs and its arguments (exits with status 2 on bad ones)."""
    argv = list(argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.suite is not None:
        if argv[0] != args.suite:  # the flags before it would be overridden by its defaults
            parser.error(f"the suite comes first: {args.suite} and then its flags")
        return args.suite, args
    suite = next((suite for attribute, suite in PICKS if getattr(args, attribute)), "forms")
    if suite == "train-step":
        args.config = args.train_steps
    return suite, args


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the suite of ``argv`` (the process's arguments when None; the process
    first restarts itself under ``MALLOC_ENV``, and ``comm.ENV`` for ``comm`` and ``fsdp``)."""
    tokens = sys.argv[1:] if argv is None else list(argv)
    if argv is None:
        on_devices = "--comm" in tokens or tokens[:1] in (["comm"], ["fsdp"])
        restart_with(MALLOC_ENV | (comm.ENV if on_devices else {}))
    suite, args = parse(tokens)
    command = ("python -m experiments.benchmark " + " ".join(tokens)).strip()
    SUITES[suite][0].run(args, command)
