"""Whether a config can run, decided before any compute: one row per field of what
its value must be (``FIELDS``, every field checked whatever the attention kind), rules
that tie fields together (``RULES``), the fields each attention kind reads, and which
fields a workdir's run may resume under new values of (``RESUMABLE``, plus the fields
its kind does not read).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import jax
from ml_collections import ConfigDict

import linattn_jax as la
from experiments.configuration import flatten
from experiments.tasks import TASKS, mqar_shapes, parse_mix
from linattn_jax import feature_maps, hf, layers
from linattn_jax.layers import moe, registry

# ============================================================================
# Per attention kind: read from the library's one registry (linattn_jax.layers.registry).
# ============================================================================

# The model fields each attention kind reads (a change of another does not block a resume).
ATTENTION_FIELDS = {kind: spec.options for kind, spec in registry.KINDS.items()}
KIND_FIELDS = {field for fields in ATTENTION_FIELDS.values() for field in fields}
# The kinds whose layers split one sequence over devices (--config.mesh.sequence=N).
SEQUENCE_PARALLEL = tuple(kind for kind, spec in registry.KINDS.items() if spec.sequence_parallel)


def _kinds(config: ConfigDict) -> tuple[str, ...]:
    """The kinds of the config's layers (``model.attention``: a kind or a layout), or ()."""
    return _kinds_of(config.model.attention)


def _kinds_of(attention: Any) -> tuple[str, ...]:
    try:
        return tuple(dict.fromkeys(registry.parse_layout(attention, None)))
    except (ValueError, TypeError):
        return ()


def _layout_ok(value: Any) -> bool:
    try:
        return isinstance(value, str) and bool(registry.parse_layout(value))
    except ValueError:
        return False


# Linear attention's feature maps besides feature_maps.names(): random or learned ones.
RANDOM_OR_LEARNED = feature_maps.NEEDS_CONSTRUCTION


def feature_map_names() -> tuple[str, ...]:
    """The values ``model.feature_map`` takes: the registered maps and those a layer builds."""
    return tuple(feature_maps.names()) + RANDOM_OR_LEARNED


def _requires_normalize(feature_map: str) -> bool:
    fn = layers.RANDOM_FEATURES.get(feature_map)
    if fn is None and feature_map in feature_maps.names():
        fn = feature_maps.get(feature_map)
    return bool(getattr(fn, "requires_normalize", False))


# ============================================================================
# Fields: (value -> ok, what it must be).
# ============================================================================

DTYPES = ("float32", "bfloat16", "float16")


def _integer(lo: int) -> tuple[Callable[[Any], bool], str]:
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo
    return ok, f"an integer >= {lo}"


def _number(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = True):
    def ok(v):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    text = f"a number > {lo}" if lo_open else f"a number >= {lo}"
    return ok, text if hi == math.inf else f"a number in {left}{lo}, {hi}{right}"


def _one_of(choices) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in tuple(choices)), f"one of {tuple(choices)}"


def _decay_ok(value: Any) -> bool:
    if value in ("", "retnet"):
        return True
    try:
        return 0 < float(value) <= 1
    except (TypeError, ValueError):
        return False


def _mix_ok(value) -> bool:
    try:
        return isinstance(value, str) and (parse_mix(value) or not value.strip())
    except ValueError:
        return False


_BOOL = (lambda v: isinstance(v, bool)), "true or false"

FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": _integer(0),
    "steps": _integer(1),
    "batch_size": _integer(1),
    "seq_len": _integer(1),
    "log_every": _integer(1),
    "eval_every": _integer(1),
    "eval_batches": _integer(1),
    "checkpoint_every": _integer(1),
    "keep_checkpoints": _integer(1),
    "stop_at": (_integer(0)[0], "an integer >= 0 (0: run to `steps`)"),
    "progress": _BOOL,
    "resume": _BOOL,
    "mesh.fsdp": _integer(1),
    "mesh.tensor": _integer(1),
    "init_from": ((lambda v: isinstance(v, str)), "a directory (a string; '': none)"),
    "mesh.sequence": _integer(1),
    "mesh.expert": _integer(1),
    "distributed.num_processes": (_integer(0)[0], "an integer >= 0 (0: detected by JAX)"),
    "distributed.process_id": (_integer(-1)[0], "an integer >= -1 (-1: detected by JAX)"),
    "distributed.coordinator_address": (
        lambda v: v == "" or (isinstance(v, str) and bool(re.fullmatch(r"\S+:\d+", v))),
        "'' (detected by JAX) or 'host:port' of process 0, e.g. '10.0.0.1:1234'",
    ),
    "distributed.cpu_collectives": _one_of(("gloo", "mpi")),
    "distributed.initialization_timeout": _integer(1),
    "distributed.heartbeat_timeout": _integer(1),
    "model.attention": (
        _layout_ok,
        f"one of {tuple(ATTENTION_FIELDS)} or a layout such as '3 gated_deltanet : 1 softmax'",
    ),
    "model.method": _one_of(la.METHODS),
    "model.chunk_size": (_integer(0)[0], "an integer >= 0 (0: the family's default)"),
    "model.decay": (_decay_ok, "'', 'retnet' or a number in (0, 1]"),
    "model.gate": _BOOL,
    "model.normalize": _BOOL,
    "model.num_features": (_integer(0)[0], "an integer >= 0 (0: 2 * head_dim)"),
    "model.feature_dim": (_integer(0)[0], "an integer >= 0 (0: q and k keep head_dim)"),
    "model.width": _integer(1),
    "model.depth": _integer(1),
    "model.num_heads": _integer(1),
    "model.mlp_ratio": _integer(1),
    "model.short_conv": _integer(0),
    "model.dtype": _one_of(DTYPES),
    "model.mlp": _one_of(layers.MLPS),
    "model.mlp_hidden": (_integer(0)[0], "an integer >= 0 (0: mlp_ratio * width)"),
    "model.zero_centred_norm": _BOOL,
    "model.scan_layers": _BOOL,
    "model.remat": _one_of(("none", "full", "dots_saveable")),
    **{
        f"model.softmax.{n}": (_integer(0)[0], "an integer >= 0 (0: the default)")
        for n in ("num_heads", "num_kv_heads", "head_dim", "sliding_window")
    },
    "model.softmax.rope": _BOOL,
    "model.softmax.rope_theta": _number(0, lo_open=True),
    "model.softmax.partial_rotary_factor": _number(0, 1, lo_open=True, hi_open=False),
    "model.softmax.qk_norm": _BOOL,
    "model.softmax.zero_centred_qk_norm": _BOOL,
    "model.softmax.output_gate": _BOOL,
    **{
        f"model.delta.{n}": (_integer(0)[0], "an integer >= 0 (0: the default)")
        for n in ("num_heads", "num_v_heads", "head_dim", "value_head_dim", "conv_size")
    },
    **{
        f"model.mamba2.{n}": (_integer(0)[0], "an integer >= 0 (0: the default)")
        for n in ("num_heads", "head_dim", "expand", "state_dim", "n_groups")
    },
    "model.mamba2.conv_size": _integer(1),
    "optim.lr": _number(0, lo_open=True),
    "optim.warmup_steps": _integer(0),
    "optim.weight_decay": _number(0),
    "optim.grad_clip": _number(0, lo_open=True),
    "optim.b1": _number(0, 1),
    "optim.b2": _number(0, 1),
    "optim.accumulate": _integer(1),
    "optim.load_balancing_loss": _number(0),
    "optim.router_z_loss": _number(0),
    **{
        f"model.moe.{n}": _integer(1)
        for n in ("num_experts", "top_k", "num_groups", "top_k_groups")
    },
    **{
        f"model.moe.{n}": (_integer(0)[0], "an integer >= 0 (0: the default or none)")
        for n in ("hidden", "shared_hidden", "first_dense")
    },
    "model.moe.score": _one_of(moe.SCORES),
    "model.moe.normalize": _BOOL,
    "model.moe.scaling": _number(0, lo_open=True),
    "model.moe.score_bias": _BOOL,
    "model.moe.shared_gate": _BOOL,
    "mqar.num_pairs": _integer(1),
    "mqar.vocab_size": _integer(4),
    "mqar.spread": _BOOL,
    "mqar.train_mix": (_mix_ok, "'' or 'seq_len:num_pairs,...' (e.g. '64:4,128:8')"),
    "mqar.test_mix": (_mix_ok, "'' or 'seq_len:num_pairs,...' (e.g. '256:16')"),
    "listops.max_depth": _integer(1),
    "listops.max_args": _integer(1),
    "text.num_files": _integer(1),
    "text.val_fraction": _number(0, 1, lo_open=True),
    "text.sample_length": _integer(0),
    "text.sample_prompt": ((lambda v: isinstance(v, str) and v != ""), "a non-empty string"),
}


# ============================================================================
# Rules over several fields: config -> a message, or None when it holds.
# ============================================================================


def _mesh_rule(config: ConfigDict) -> str | None:
    seq_devices, fsdp, tensor = config.mesh.sequence, config.mesh.fsdp, config.mesh.tensor
    expert = config.mesh.get("expert", 1)
    model_devices = seq_devices * fsdp * tensor * expert
    if jax.device_count() % model_devices:
        sizes = {"fsdp": fsdp, "expert": expert, "tensor": tensor, "sequence": seq_devices}
        named = " x ".join(f"mesh.{k}={v}" for k, v in sizes.items() if v > 1)
        product = f" = {model_devices}" if " x " in named else ""
        return (
            f"{named}{product} must divide the {jax.device_count()} devices (the data axis "
            f"takes the rest)"
        )
    batch_devices = jax.device_count() // (seq_devices * tensor)  # data x fsdp x expert
    named = [name for name, n in (("fsdp", fsdp), ("expert", expert)) if n > 1]
    axes = " and ".join(["data", *named]) + (" axes" if named else " axis")
    if config.batch_size % batch_devices:
        return (
            f"batch_size={config.batch_size} must be divisible by the {batch_devices} devices "
            f"of the {axes}"
        )
    if tensor > 1 and seq_devices > 1:
        return (
            f"mesh.tensor={tensor} with mesh.sequence={seq_devices}: the sequence-parallel "
            f"layers do not split heads yet; use one of them"
        )
    accumulate = config.optim.accumulate
    if config.batch_size % (accumulate * batch_devices):
        return (
            f"batch_size={config.batch_size} must be divisible by optim.accumulate={accumulate} "
            f"x the {batch_devices} devices of the {axes} (each micro-batch split over them)"
        )
    if seq_devices > 1:
        # A layout may mix in softmax layers: they run on the sharded sequence under jit.
        if TASKS[config.task].kind != "lm" or not set(_kinds(config)) & set(SEQUENCE_PARALLEL):
            return (
                "mesh.sequence > 1 (sequence parallelism) needs a causal language model with "
                f"attention in {SEQUENCE_PARALLEL} (or a layout with one of them)"
            )
        if config.seq_len % seq_devices:
            return f"seq_len={config.seq_len} must be divisible by mesh.sequence={seq_devices}"
    return None


def _distributed_rule(config: ConfigDict) -> str | None:
    d = config.distributed
    if d.num_processes == 1:
        for name, unset in (("process_id", -1), ("coordinator_address", "")):
            if d[name] != unset:
                return (
                    f"distributed.{name}={d[name]!r} needs distributed.num_processes > 1 (or 0: "
                    f"detected by JAX), got distributed.num_processes=1"
                )
    elif d.num_processes and d.process_id >= d.num_processes:
        return (
            f"distributed.process_id={d.process_id} must be below "
            f"distributed.num_processes={d.num_processes}"
        )
    return None


def validate_distributed(config: ConfigDict) -> None:
    """Checks the ``distributed`` fields alone (before JAX's runtime, and so any device,
    has started).

    Raises:
      ValueError: naming the first bad field, what it must be and what it is.
    """
    _check_fields(config, "distributed.")
    message = _distributed_rule(config)
    if message:
        raise ValueError(message)


def _mqar_rule(config: ConfigDict) -> str | None:
    c = config.mqar
    for split, field in (("train", "train_mix"), ("eval", "test_mix")):
        mix = c.get(field, "")
        for length, pairs in mqar_shapes(config, split):
            if mix and length > config.seq_len:
                return (
                    f"mqar.{field} has seq_len {length} > seq_len={config.seq_len} "
                    f"(seq_len is the longest sequence the model sees)"
                )
            split_name = f"mqar.{field}'s {length}:{pairs}" if mix else f"seq_len={length}"
            pairs_name = "num_pairs" if mix else "mqar.num_pairs"
            if 4 * pairs > length:
                return (
                    f"{split_name} is too short for MQAR with {pairs_name}={pairs} "
                    f"(needs 4 * num_pairs)"
                )
            if pairs > c.vocab_size // 2 - 1:
                return (
                    f"mqar.vocab_size={c.vocab_size} has too few keys for {pairs_name}={pairs} "
                    f"(needs vocab_size >= 2 * num_pairs + 2)"
                )
    return None


def _heads_rule(config: ConfigDict) -> str | None:
    """Each kind's heads (its section's ``num_heads`` or the model's) divide the width,
    unless its section gives ``head_dim``."""
    m = config.model
    for kind in _kinds(config):
        section = registry.get(kind).section
        own = m.get(section) if section else None
        heads_field = f"model.{section}.num_heads" if own and own.get("num_heads") else None
        heads = own.get("num_heads") if heads_field else m.num_heads
        if own and own.get("head_dim"):
            continue
        if m.width % heads:
            name = heads_field or "model.num_heads"
            return f"{name}={heads} must divide model.width={m.width} (or set a head_dim)"
    return None


def _moe_rule(config: ConfigDict) -> str | None:
    """A mixture's sizes agree (``layers.moe.MoE``'s checks, before any compute), and an
    ``expert`` mesh axis has a mixture whose experts it divides."""
    m, experts = config.model, config.mesh.get("expert", 1)
    if m.mlp != "moe":
        if experts > 1:
            return f"mesh.expert={experts} splits a mixture's experts: set model.mlp='moe'"
        return None
    e = m.moe
    if e.top_k > e.num_experts:
        return f"model.moe.top_k={e.top_k} must be <= model.moe.num_experts={e.num_experts}"
    if e.num_experts % e.num_groups or e.top_k_groups > e.num_groups:
        return (
            f"model.moe.num_groups={e.num_groups} must divide model.moe.num_experts="
            f"{e.num_experts} and be >= model.moe.top_k_groups={e.top_k_groups}"
        )
    if e.top_k > e.top_k_groups * (e.num_experts // e.num_groups):
        return f"model.moe.top_k={e.top_k} exceeds the experts of model.moe.top_k_groups"
    if e.shared_gate and not e.shared_hidden:
        return "model.moe.shared_gate gates the shared expert: set model.moe.shared_hidden > 0"
    if e.first_dense >= m.depth:
        return f"model.moe.first_dense={e.first_dense} must be below model.depth={m.depth}"
    if e.num_experts % experts:
        return f"mesh.expert={experts} must divide model.moe.num_experts={e.num_experts}"
    return None


def _init_from_rule(config: ConfigDict) -> str | None:
    """A checkpoint to start from: a causal LM task whose tokens it knows, no sequence
    parallelism, a dtype it loads in; its directory readable (``hf.check_pretrained``: the
    config, every file's header, every tensor's name and shape)."""
    path = config.get("init_from")
    if not path:
        return None
    if TASKS[config.task].kind != "lm" or config.mesh.sequence > 1:
        return (
            f"init_from needs a language-model task and mesh.sequence=1, got task={config.task!r}"
        )
    if config.model.dtype not in ("float32", "bfloat16"):
        return f"init_from loads float32 or bfloat16, got model.dtype={config.model.dtype!r}"
    try:
        checkpoint = hf.check_pretrained(path)
    except ValueError as e:
        return f"init_from={path!r}: {e}"
    vocab = TASKS[config.task].vocab_size(config)
    if vocab > checkpoint["vocab_size"]:
        return (
            f"init_from={path!r} knows {checkpoint['vocab_size']} tokens, fewer than the task's "
            f"{vocab}"
        )
    return None


RULES: list[Callable[[ConfigDict], str | None]] = [
    _init_from_rule,
    _heads_rule,
    lambda c: (
        f"model.feature_map={c.model.feature_map!r} needs model.normalize=true (its per-query "
        f"stabilising shift cancels only when normalised), got model.normalize=false"
        if "linear" in _kinds(c)
        and not c.model.normalize
        and _requires_normalize(c.model.feature_map)
        else None
    ),
    _distributed_rule,
    _moe_rule,
    _mesh_rule,
    lambda c: _mqar_rule(c) if c.task == "mqar" else None,
    lambda c: (
        f"seq_len={c.seq_len} is too short for ListOps (needs >= 8)"
        if c.task == "listops" and c.seq_len < 8
        else None
    ),
]


def _check_fields(config: ConfigDict, prefix: str = "") -> dict[str, Any]:
    """Checks each field (under ``prefix``) against its row of ``FIELDS``; returns them all."""
    fields = flatten(config)
    for name, (ok, expected) in FIELDS.items():
        if not name.startswith(prefix) or name not in fields:
            continue  # another task's section
        # Every field, whatever the attention kind: a bad value the kind ignores today
        # would break a rerun under another kind, and is as likely a typo.
        if not ok(fields[name]):
            raise ValueError(f"{name} must be {expected}, got {fields[name]!r}")
    return fields


def validate(config: ConfigDict) -> None:
    """Fails before any compute, and before the workdir is touched, on a config
    that cannot run.

    Raises:
      ValueError: naming the first bad field, what it must be and what it is.
    """
    if config.get("task") not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {config.get('task')!r}")
    fields = _check_fields(config)
    if "model.feature_map" in fields and fields["model.feature_map"] not in feature_map_names():
        raise ValueError(
            f"model.feature_map must be one of {feature_map_names()}, "
            f"got {fields['model.feature_map']!r}"
        )
    for rule in RULES:
        message = rule(config)
        if message:
            raise ValueError(message)


# ============================================================================
# Resumption.
# ============================================================================

# Fields that change neither the model, the task nor the data: a workdir's run
# resumes under new values of these (a prefix names a whole section).
RESUMABLE = (
    "recall",  # experiments.recall's grid (each run's own fields are checked)
    "steps",
    "stop_at",
    "optim",
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
    "progress",
    "resume",
    "mesh",
    "distributed",
    "text.sample_prompt",
    "text.sample_length",
)


# Fields newer than some stored configs: absent there, they held this value.
ABSENT_IS = {"init_from": ""} | {
    f"model.moe.{name}": value
    for name, value in dict(
        num_experts=8, top_k=2, hidden=0, score="softmax", normalize=False, scaling=1.0,
        score_bias=False, num_groups=1, top_k_groups=1, shared_hidden=0, shared_gate=False,
        first_dense=0,
    ).items()
}  # fmt: skip


def config_changes(stored: dict, config: ConfigDict) -> list[str]:
    """The fields outside ``RESUMABLE`` where ``config`` differs from ``stored``, but for
    the model fields that neither run's attention kind reads (they change nothing)."""
    old, new = flatten(stored), flatten(config)
    read = set()
    for attention in (old.get("model.attention"), new.get("model.attention")):
        kinds = _kinds_of(attention)
        read |= (
            {field for kind in kinds for field in ATTENTION_FIELDS[kind]} if kinds else KIND_FIELDS
        )
    changes = []
    for name in sorted(old.keys() | new.keys()):
        if any(name == p or name.startswith(p + ".") for p in RESUMABLE):
            continue
        short = name.removeprefix("model.")
        if name.startswith("model.") and short in KIND_FIELDS and short not in read:
            continue  # no kind here reads it
        absent = ABSENT_IS.get(name, "<absent>")
        before, now = old.get(name, absent), new.get(name, absent)
        if before != now:
            changes.append(f"{name}={before!r} there, {now!r} now")
    return changes
