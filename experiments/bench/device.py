"""``device``: one table of what a lent accelerator (one H200 GPU) is for, in a few minutes:
the additive form with a per-head gate (``additive_decay``) and a per-channel gate (``gla``),
Gated DeltaNet (``gated_deltanet``), Mamba-2's SSD (``ssd``) and the mLSTM (``mlstm``), each
as ours in XLA (``method="chunked"``), ours in Pallas (``method="pallas"``, where the
installed ``linattn_jax`` accepts it: probed once per form, a ``ValueError`` naming the method
means absent), jax-linear-attention's kernels (``jla.ops.linear_attention(kind, ...,
impl=...)``, ``"chunked"`` and, on a GPU, ``"mosaic_gpu"``, where ``jla`` is importable and
has the family) and any peer named by ``--peers`` (``FAMILY=MODULE:FUNCTION``, called on our
inputs, as ``peers --impl``); a mixture of experts (``moe``: ``layers.MoE``, 8 experts of
hidden width d, top-2, over the b*t tokens of width d = ``MOE_WIDTH``) in its default
dispatch and with ``ragged_dot``, beside a dense SwiGLU of the same active parameters
(hidden 2d); forward and forward+backward, at each of ``--lengths`` and ``--dtypes``; then a
Qwen3.5-shaped model of about ``--params`` parameters (``hf_load.config_for``'s config,
random weights: nothing is read or downloaded), its prefill of ``--prefill`` tokens and
greedy decoding of ``--decode-steps`` tokens, in tokens/s.

Every recurrence runs on the same inputs of ``recurrences.recurrence_case`` (b=``BATCH``,
h=``HEADS``, d=dv=``DIM``; the activations in the case's dtype, gates, steps and beta
float32) and the same maths on every side: the additive families with identity features and
no denominator (what ``simple_gla`` and ``gla`` compute), the delta rule with scale 1. The
MoE's forward+backward is its training step's: the gradient in its parameters and input.
Times are wall ms (``jax.block_until_ready``), the median of ``--repeats`` calls after one
warm-up call of the compiled program; compile time (``lower`` + ``compile``) is reported
apart, and each forward's normwise distance to our XLA form's output (the MoE's: to its
default dispatch; the dense SwiGLU computes other maths and has none). A case that raises (a
kernel that does not take float32, say) keeps its row, with the error.

``--budget-s`` bounds the whole run: before each case the elapsed time plus an estimate of
the case (the last like case's cost, scaled by length) is checked against it, and the rest is
skipped with a note; the kernels may use ``KERNEL_SHARE`` of it when the model runs too.
``--smallest`` runs every part at toy sizes (``SMALLEST``, ``SMALLEST_MODEL``: over
``--lengths``, ``--dtypes`` and ``--repeats``), for a check on CPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import linattn_jax as la
from experiments.bench import hf_load, moe, peers
from experiments.bench.recurrences import recurrence_case
from experiments.bench.timing import time_ms, write_table
from linattn_jax import hf
from linattn_jax.layers import MoE, SwiGLU
from linattn_jax.models import LanguageModel

FAMILIES = {  # ours' family name: (our form, jax-linear-attention's kind or None)
    "additive_decay": ("additive", "simple_gla"),
    "gla": ("additive", "gla"),
    "gated_deltanet": ("delta", "gated_deltanet"),
    "ssd": ("ssd", None),
    "mlstm": ("mlstm", None),
    "moe": ("moe", None),
}
# The inputs of each form cast to the case's dtype (the rest, gates and steps, float32).
ACTIVATIONS = {"additive": (0, 1, 2), "delta": (0, 1, 2), "ssd": (0, 3, 4), "mlstm": (0, 1, 2)}
EXPERTS, TOP_K = moe.EXPERTS, moe.TOP_K  # the moe suite's: 8 experts, top-2
MOE_WIDTH = 1024  # the MoE's width d (--smallest: SMALLEST's dim)
DENSE = "dense SwiGLU, the same active parameters"
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
BATCH, HEADS, DIM = 2, 16, 128  # Qwen3.5's Gated DeltaNet heads
SMALLEST = dict(lengths="64", dtypes="float32", batch=1, heads=2, dim=16, repeats=1)
# A Qwen3.5 text model at toy size, for --smallest.
SMALLEST_MODEL = dict(
    hf_load.BASE,
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    full_attention_interval=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
)
KERNEL_SHARE = 0.7  # of --budget-s, for the kernels when the model runs after them
PROMPT = 16  # the decoding prompt's tokens


def _additive(method: str) -> Callable:
    def fn(q, k, v, gate):
        return la.causal_linear_attention(
            q, k, v, gate=gate, method=method, feature_map="identity", normalize=False
        )

    return fn


def _delta(method: str) -> Callable:
    def fn(q, k, v, beta, gate):
        return la.delta_rule(q, k, v, beta, gate=gate, method=method)

    return fn


def _ssd(method: str) -> Callable:
    return lambda x, dt, A, B, C: la.ssd(x, dt, A, B, C, method=method)


def _mlstm(method: str) -> Callable:
    return lambda q, k, v, i, f: la.mlstm(q, k, v, i, f, method=method)


OURS = {"additive": _additive, "delta": _delta, "ssd": _ssd, "mlstm": _mlstm}


def moe_case(method: str) -> Callable:
    """``make(t, dtype, b, d) -> (fn, args)``: ``fn(params, x)`` is the output of
    ``layers.MoE`` (``EXPERTS`` experts of hidden width d, ``TOP_K`` per token, ``method``)
    on ``x [b * t, d]``, or of the dense SwiGLU of hidden ``TOP_K * d`` where ``method`` is
    ``DENSE``; parameters and input in ``dtype``."""

    def make(t: int, dtype, b: int, d: int) -> tuple[Callable, tuple]:
        kind = dict(dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
        if method == DENSE:
            module = SwiGLU(d, TOP_K * d, **kind)
        else:
            module = MoE(d, EXPERTS, TOP_K, d, method=method, **kind)
        fn, params = moe.apply(module)
        x = jax.random.normal(jax.random.PRNGKey(t), (b * t, d), jnp.float32).astype(dtype)
        return fn, (params, x)

    return make


def accepts_pallas(form: str) -> tuple[bool, str]:
    """Whether our ``form`` (a key of ``OURS``) takes ``method="pallas"``, traced once on
    tiny abstract inputs: ``(False, why)`` on a ``ValueError`` naming the method."""
    family = next(name for name, (f, _) in FAMILIES.items() if f == form)
    _, args = recurrence_case(family, "chunked", 64, 1, 1, 16)
    try:
        jax.eval_shape(OURS[form]("pallas"), *args)
    except ValueError as e:
        if "method" in str(e):
            return False, str(e).splitlines()[0]
    except Exception:  # accepted, but not here (a GPU kernel on CPU): its rows say why
        pass
    return True, ""


def jla_ops():
    """``jla.ops`` where jax-linear-attention is importable, else None."""
    try:
        from jla import ops
    except ImportError:
        return None
    return ops


def _jla(ops, kind: str, impl: str) -> Callable:
    def fn(q, k, v, *gates):
        if kind == "gated_deltanet":
            beta, gate = gates
            return ops.linear_attention(kind, q, k, v, g=gate, beta=beta, impl=impl, scale=1.0)[0]
        return ops.linear_attention(kind, q, k, v, g=gates[0], impl=impl, scale=1.0)[0]

    return fn


def parse_peers(spec: str) -> dict[str, list[str]]:
    """``--peers``: ``"FAMILY=MODULE:FUNCTION,..."`` -> family -> its peers' specs."""
    out = {}
    for item in (x for x in spec.split(",") if x):
        family, _, impl = item.partition("=")
        if family not in FAMILIES or FAMILIES[family][0] == "moe" or ":" not in impl:
            names = sorted(f for f, (form, _) in FAMILIES.items() if form != "moe")
            raise ValueError(
                f"--peers must be FAMILY=MODULE:FUNCTION with FAMILY one of {names}, got {item!r}"
            )
        out.setdefault(family, []).append(impl)
    return out


def methods(
    families, on_gpu: bool, peer_specs: dict[str, list[str]] | None = None
) -> tuple[list[tuple[str, str, Callable]], list[str]]:
    """``(family, method, fn)`` for every timed implementation (for ``moe``, ``fn`` is
    ``moe_case``'s ``make``), and notes on those absent."""
    forms = {FAMILIES[f][0] for f in families} - {"moe"}
    pallas = {form: accepts_pallas(form) for form in OURS if form in forms}
    ops = jla_ops()
    out = []
    for family in families:
        form, kind = FAMILIES[family]
        if form == "moe":
            out += [(family, f"ours, method={m!r}", moe_case(m)) for m in ("auto", "ragged")]
            out.append((family, DENSE, moe_case(DENSE)))
            continue
        out.append((family, "ours, XLA chunked", OURS[form]("chunked")))
        if pallas[form][0]:
            out.append((family, "ours, Pallas", OURS[form]("pallas")))
        if ops is not None and kind is not None:
            out.append((family, "jla chunked", _jla(ops, kind, "chunked")))
            if on_gpu:
                out.append((family, "jla mosaic_gpu", _jla(ops, kind, "mosaic_gpu")))
        for impl in (peer_specs or {}).get(family, []):
            out.append((family, f"peer {impl}", peers.load(impl)))
    notes = [
        f"ours, Pallas ({form}): absent ({why})" for form, (ok, why) in pallas.items() if not ok
    ]
    if ops is None:
        notes.append("jax-linear-attention (jla): not importable, not timed")
    else:
        try:
            version = importlib.metadata.version("jax-linear-attention")
        except importlib.metadata.PackageNotFoundError:
            version = f"from {ops.__file__}"
        notes.append(f"jax-linear-attention {version}")
    return out, notes


def timed(fn: Callable, args: tuple, repeats: int) -> tuple[float, float, Callable]:
    """``(compile s, median wall ms, the compiled function)`` of ``jax.jit(fn)(*args)``."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    return compile_s, time_ms(compiled, args, repeats)[0], compiled


def kernel_case(fn, args, repeats: int, reference=None) -> tuple[dict, jax.Array | None]:
    """Forward and forward+backward (the gradient of the output's float32 sum in every input)
    of ``fn``: ms and compile s, the forward's normwise distance to ``reference`` (an output)
    where given, ``error`` when it raised; and the forward's output (None when it raised)."""
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    grad = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums)
    row, out = {}, None
    try:
        row["fwd_compile_s"], row["fwd_ms"], forward = timed(fn, args, repeats)
        out = forward(*args).astype(jnp.float32)
        if reference is not None:
            row["rel_err"] = float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))
        row["fwd_bwd_compile_s"], row["fwd_bwd_ms"], _ = timed(grad, args, repeats)
    except Exception as e:  # a kernel that refuses a dtype or shape keeps its row
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    return row, out


class Budget:
    """The run's clock against ``seconds``: ``fits(estimate)`` before each case."""

    def __init__(self, seconds: float):
        self.seconds, self.start, self.skipped = seconds, time.perf_counter(), []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, estimate: float, limit: float | None = None) -> bool:
        return self.elapsed() + estimate <= (self.seconds if limit is None else limit)


def inputs(family: str, t: int, dtype, shape) -> tuple:
    """``recurrence_case``'s inputs of ``family``, its activations cast to ``dtype``."""
    _, args = recurrence_case(family, "chunked", t, *shape)
    cast = ACTIVATIONS[FAMILIES[family][0]]
    return tuple(x.astype(dtype) if i in cast else x for i, x in enumerate(args))


def measure_kernels(
    lengths, dtypes, families, repeats: int, budget: Budget, limit: float, shape=None,
    peer_specs=None, moe_width: int = MOE_WIDTH,
) -> tuple[list[dict], list[str]]:  # fmt: skip
    """One row per (dtype, length, family, method), bfloat16 first, printed as measured;
    a case is skipped when the budget's ``limit`` would not hold it (its estimate: the last
    case of the same method's compile time, and its run time scaled by the length)."""
    shape = shape or (BATCH, HEADS, DIM)
    cases, notes = methods(families, jax.default_backend() == "gpu", peer_specs)
    rows, cost = [], {}  # (family, method) -> (t, compile s, run s) of its last case
    for dtype in dtypes:
        for t in lengths:
            reference = {}  # family -> the output of its first method (ours, XLA)
            for family, method, fn in cases:
                last_t, compile_s, run_s = cost.get((family, method), (t, 0.0, 0.0))
                if not budget.fits(compile_s + run_s * t / last_t, limit):
                    budget.skipped.append(f"{family} {method} {dtype} t={t}")
                    continue
                start = time.perf_counter()
                row = dict(family=family, method=method, dtype=dtype, t=t, tokens=shape[0] * t)
                if FAMILIES[family][0] == "moe":  # fn is moe_case's make
                    timed_fn, args = fn(t, DTYPES[dtype], shape[0], moe_width)
                    row["width"] = moe_width
                else:
                    timed_fn, args = fn, inputs(family, t, DTYPES[dtype], shape)
                other_maths = method == DENSE  # no reference to compare with
                measured, out = kernel_case(
                    timed_fn, args, repeats, None if other_maths else reference.get(family)
                )
                row |= measured
                if not other_maths:
                    reference.setdefault(family, out)
                run_s = (1 + repeats) * (row.get("fwd_ms", 0) + row.get("fwd_bwd_ms", 0)) / 1e3
                cost[(family, method)] = (t, time.perf_counter() - start - run_s, run_s)
                rows.append(row)
                print(json.dumps(row | dict(elapsed_s=round(budget.elapsed(), 1))), flush=True)
    return rows, notes


def moe_notes(rows: list[dict]) -> list[str]:
    """Per dtype and length with both rows: the MoE's default dispatch over the dense SwiGLU,
    forward and forward+backward."""
    by = {(r["dtype"], r["t"], r["method"]): r for r in rows if r["family"] == "moe"}
    notes = []
    for (dtype, t, method), row in by.items():
        dense = by.get((dtype, t, DENSE))
        if method != "ours, method='auto'" or dense is None or "error" in row or "error" in dense:
            continue
        fwd, both = (row[key] / dense[key] for key in ("fwd_ms", "fwd_bwd_ms"))
        notes.append(
            f"moe ({EXPERTS} experts of hidden d, top-{TOP_K}, the b*t tokens of width "
            f"d={row['width']}) over the {DENSE} (hidden {TOP_K}d), {dtype}, t={t}: "
            f"forward {fwd:.2f}x, forward+backward {both:.2f}x"
        )
    return notes


def model_config(params: float, smallest: bool) -> dict:
    """The normalised Qwen3.5 config of the timed model."""
    raw = SMALLEST_MODEL if smallest else hf_load.config_for(params)
    return hf.qwen3_5.FORMAT.normalize_config(raw)


def measure_model(
    config: dict, prefill: int, steps: int, batch: int, repeats: int, budget: Budget
) -> list[dict]:
    """Prefill (one forward of ``batch x prefill`` tokens) and greedy decoding (``generate``
    of ``steps`` tokens after a ``PROMPT``-token prompt, the prompt's prefill included) of a
    bfloat16 ``LanguageModel`` of ``config`` with random weights."""
    fmt = hf.format_of(config)
    model = LanguageModel(**fmt.model_options(config, jnp.bfloat16), rngs=nnx.Rngs(0))
    fmt.finish(model, config)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    name = f"Qwen3.5-shaped, {params / 1e9:.3g} B, {config['num_hidden_layers']} layers"
    rows = []
    if prefill and not budget.fits(0.0):
        budget.skipped.append("the model's prefill")
    elif prefill:
        graphdef, state = nnx.split(model)
        forward = lambda state, tokens: nnx.merge(graphdef, state)(tokens)
        tokens = jnp.ones((batch, prefill), jnp.int32)
        row = dict(family=name, method="prefill", dtype="bfloat16", t=prefill)
        row["tokens"] = batch * prefill
        row["fwd_compile_s"], row["fwd_ms"], _ = timed(forward, (state, tokens), repeats)
        rows.append(row)
        print(json.dumps(row | dict(elapsed_s=round(budget.elapsed(), 1))), flush=True)
    if steps and not budget.fits(2 * rows[-1]["fwd_compile_s"] if rows else 0.0):
        budget.skipped.append("the model's decoding")
    elif steps:
        prompt = jnp.ones((batch, PROMPT), jnp.int32)
        decode = lambda prompt: model.generate(prompt, steps, temperature=0.0)
        start = time.perf_counter()
        jax.block_until_ready(decode(prompt))  # compiles
        first = time.perf_counter() - start
        ms = time_ms(decode, (prompt,), repeats, warmup=0)[0]
        row = dict(family=name, method=f"greedy decode, {steps} steps", dtype="bfloat16")
        row |= dict(t=PROMPT + steps, tokens=batch * steps, fwd_ms=ms)
        row["fwd_compile_s"] = first - ms / 1e3
        rows.append(row)
        print(json.dumps(row | dict(elapsed_s=round(budget.elapsed(), 1))), flush=True)
    return rows


def table(rows: list[dict], header: str, notes: list[str]) -> str:
    """The rows as one markdown table under ``header``, the notes after it."""
    lines = [
        header,
        "",
        "| form | method | dtype | t | fwd ms | tokens/s (fwd) | fwd+bwd ms | compile s fwd / "
        "fwd+bwd | fwd vs XLA (normwise) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            cells = [f"failed: {r['error']}", "", "", "", ""]
        else:
            both = "fwd_bwd_ms" in r
            cells = [
                f"{r['fwd_ms']:.2f}",
                f"{r['tokens'] / (r['fwd_ms'] / 1e3):,.0f}",
                f"{r['fwd_bwd_ms']:.2f}" if both else "",
                f"{r['fwd_compile_s']:.1f}" + (f" / {r['fwd_bwd_compile_s']:.1f}" if both else ""),
                f"{r['rel_err']:.1e}" if "rel_err" in r else "",
            ]
        lines.append("| " + " | ".join([r["family"], r["method"], r["dtype"], str(r["t"]), *cells]))
        lines[-1] += " |"
    return "\n".join(lines + [""] + [f"* {n}" for n in notes]) + "\n"


def run(args: argparse.Namespace, command: str) -> None:
    """Measures, prints the table and writes ``device.md`` and ``device.json`` to ``--out``."""
    small = SMALLEST if args.smallest else {}
    ints = lambda s: [int(x) for x in s.split(",") if x]
    lengths = ints(small.get("lengths", args.lengths))
    dtypes = small.get("dtypes", args.dtypes).split(",")
    families = [f for f in args.families.split(",") if f] or list(FAMILIES)
    for name, given, known in (("--dtypes", dtypes, DTYPES), ("--families", families, FAMILIES)):
        if unknown := [x for x in given if x not in known]:
            raise ValueError(f"{name} must name some of {sorted(known)}, got {unknown}")
    peer_specs = parse_peers(args.peers)
    if missing := sorted(set(peer_specs) - set(families)):
        raise ValueError(f"--peers names {missing}, not among --families {families}")
    repeats = small.get("repeats", args.repeats)
    shape = (small["batch"], small["heads"], small["dim"]) if small else None
    budget = Budget(args.budget_s)
    with_model = bool(args.prefill or args.decode_steps)
    limit = args.budget_s * (KERNEL_SHARE if with_model else 1.0)
    rows, notes = measure_kernels(
        lengths, dtypes, families, repeats, budget, limit, shape, peer_specs,
        small.get("dim", MOE_WIDTH),
    )  # fmt: skip
    notes += moe_notes(rows)
    if with_model:
        config = model_config(args.params, args.smallest)
        prefill = min(args.prefill, 64) if args.smallest else args.prefill
        steps = min(args.decode_steps, 4) if args.smallest else args.decode_steps
        rows += measure_model(config, prefill, steps, args.decode_batch, repeats, budget)
    device = jax.devices()[0]
    header = (
        f"`{command}`: {device.platform} ({device.device_kind}), jax {jax.__version__}; "
        f"b={shape[0] if shape else BATCH}, h={shape[1] if shape else HEADS}, "
        f"d=dv={shape[2] if shape else DIM}; median of {repeats} after a warm-up"
    )
    if budget.skipped:
        notes.append(
            f"over the {args.budget_s:.0f} s budget, skipped: " + "; ".join(budget.skipped)
        )
    notes.append(f"elapsed {budget.elapsed():.0f} s")
    text = table(rows, header, notes)
    out = Path(args.out)
    write_table(out, "device.md", text)
    summary = dict(command=command, header=header, rows=rows, notes=notes)
    (out / "device.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
