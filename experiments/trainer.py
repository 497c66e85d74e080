"""The training loop: model and optimiser from a config, data parallelism over
every device, orbax checkpoints with exact resumption, metrics (``metrics.jsonl``
and TensorBoard event files), plots, results, and ``load`` to get a trained model back.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import logging as logging_std
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from experiments import data
from linattn_jax import attention, feature_maps, layers, models

RANDOM_OR_LEARNED = ("favor_plus", "random_fourier", "hedgehog", "cosformer")
DTYPES = ("float32", "bfloat16", "float16")

# What a workdir holds besides config.json; --config.resume=false removes these.
RUN_FILES = (
    "checkpoints",
    "checkpoints_unreadable",
    "metrics.jsonl",
    "final.json",
    "final.md",
    "curves.png",
)
EVENTS_GLOB = "events.out.tfevents.*"  # TensorBoard (tensorboardX) event files


# ----------------------------------------------------------------------------
# Tasks: what each one needs from the config, without loading its data.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """How a task shapes the model and reads its results.

    Attributes:
      kind: ``"lm"`` (causal language model) or ``"classify"`` (sequence classifier).
      vocab_size: the config -> the number of input tokens.
      num_classes: classes of a classifier (0 for a language model).
      metric: the headline eval metric: ``"accuracy"`` or ``"bits_per_byte"``.
      chance: the config -> the metric of a uniform guess.
    """

    kind: str
    vocab_size: Callable[[ConfigDict], int]
    num_classes: int
    metric: str
    chance: Callable[[ConfigDict], float]


TASKS = {
    # MQAR's answers are values, the upper half of the vocabulary.
    "mqar": TaskSpec(
        "lm",
        lambda c: c.mqar.vocab_size,
        0,
        "accuracy",
        lambda c: 1 / (c.mqar.vocab_size - c.mqar.vocab_size // 2),
    ),
    "listops": TaskSpec("classify", lambda c: data.LISTOPS_VOCAB, 10, "accuracy", lambda c: 0.1),
    "text_lm": TaskSpec("lm", lambda c: 256, 0, "bits_per_byte", lambda c: 8.0),
}


# ----------------------------------------------------------------------------
# Configs.
# ----------------------------------------------------------------------------


def load_config(spec: str) -> ConfigDict:
    """``"configs/mqar.py:small"`` -> that file's ``get_config("small")``."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None or not Path(path).is_file():
        raise ValueError(f"config file not found: {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def flatten(config: ConfigDict | dict, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"width": 64}}`` -> ``{"model.width": 64}``."""
    out = {}
    for key, value in config.items():
        if isinstance(value, ConfigDict | dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _unknown_field(config: ConfigDict, name: str) -> ValueError:
    close = difflib.get_close_matches(name, flatten(config), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"unknown config field {name!r}{hint}")


def override(config: ConfigDict, assignment: str) -> None:
    """Applies ``"optim.lr=3e-4"`` to a locked config.

    Raises:
      ValueError: no ``=``, an unknown field (naming the closest one), or a value
        that is not of the field's type.
    """
    name, sep, text = assignment.partition("=")
    if not sep:
        raise ValueError(f"an override must look like field=value, got {assignment!r}")
    *parents, leaf = name.split(".")
    node = config
    for part in parents:
        if not isinstance(node, ConfigDict) or part not in node:
            raise _unknown_field(config, name)
        node = node[part]
    if not isinstance(node, ConfigDict) or leaf not in node or isinstance(node[leaf], ConfigDict):
        raise _unknown_field(config, name)
    old = node[leaf]
    try:
        if isinstance(old, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError
            value = text.lower() == "true"
        elif isinstance(old, int):
            value = int(text)
        elif isinstance(old, float):
            value = float(text)
        else:
            value = text
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}[type(old)]
        raise ValueError(f"{name} must be {kind}, got {text!r}") from None
    node[leaf] = value


# -- validation: one row per field, then the rules that tie fields together. --


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


_BOOL = (lambda v: isinstance(v, bool)), "true or false"

# The model fields each attention kind reads (the others are not checked for it).
# A new kind in layers.ATTENTION_KINDS gets a row here and its kwargs in build_model
# (tests check that the kinds match).
ATTENTION_FIELDS = {
    "linear": (
        "feature_map",
        "method",
        "chunk_size",
        "decay",
        "gate",
        "normalize",
        "num_features",
        "feature_dim",
    ),
    "softmax": (),
    "gla": ("method", "chunk_size"),
    "deltanet": ("chunk_size",),
    "gated_deltanet": ("chunk_size",),
    "kda": ("chunk_size",),
}
KIND_FIELDS = {field for fields in ATTENTION_FIELDS.values() for field in fields}
# The kinds whose layers split one sequence over devices (--config.mesh.sequence=N).
SEQUENCE_PARALLEL = ("linear", "gla", "deltanet", "gated_deltanet", "kda")

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
    "mesh.sequence": _integer(1),
    "model.attention": _one_of(ATTENTION_FIELDS),
    "model.method": _one_of(attention.METHODS),
    "model.chunk_size": _integer(1),
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
    "optim.lr": _number(0, lo_open=True),
    "optim.warmup_steps": _integer(0),
    "optim.weight_decay": _number(0),
    "optim.grad_clip": _number(0, lo_open=True),
    "optim.b1": _number(0, 1),
    "optim.b2": _number(0, 1),
    "mqar.num_pairs": _integer(1),
    "mqar.vocab_size": _integer(4),
    "mqar.spread": _BOOL,
    "mqar.train_mix": (lambda v: _mix_ok(v), "'' or 'seq_len:num_pairs,...' (e.g. '64:4,128:8')"),
    "mqar.test_mix": (lambda v: _mix_ok(v), "'' or 'seq_len:num_pairs,...' (e.g. '256:16')"),
    "listops.max_depth": _integer(1),
    "listops.max_args": _integer(1),
    "text.num_files": _integer(1),
    "text.val_fraction": _number(0, 1, lo_open=True),
    "text.sample_length": _integer(0),
    "text.sample_prompt": ((lambda v: isinstance(v, str) and v != ""), "a non-empty string"),
}


def _feature_map_names() -> tuple[str, ...]:
    return tuple(feature_maps.names()) + RANDOM_OR_LEARNED


def _requires_normalize(feature_map: str) -> bool:
    fn = layers.RANDOM_FEATURES.get(feature_map)
    if fn is None and feature_map in feature_maps.names():
        fn = feature_maps.get(feature_map)
    return bool(getattr(fn, "requires_normalize", False))


def _mesh_rule(config: ConfigDict) -> str | None:
    seq_devices = config.mesh.sequence
    if jax.device_count() % seq_devices:
        return f"mesh.sequence={seq_devices} must divide the {jax.device_count()} devices"
    data_devices = jax.device_count() // seq_devices
    if config.batch_size % data_devices:
        return (
            f"batch_size={config.batch_size} must be divisible by the {data_devices} devices "
            f"of the data axis"
        )
    if seq_devices > 1:
        if TASKS[config.task].kind != "lm" or config.model.attention not in SEQUENCE_PARALLEL:
            return (
                "mesh.sequence > 1 (sequence parallelism) needs a causal language model with "
                f"attention in {SEQUENCE_PARALLEL}"
            )
        if config.seq_len % seq_devices:
            return f"seq_len={config.seq_len} must be divisible by mesh.sequence={seq_devices}"
    return None


def parse_mix(text: str) -> list[tuple[int, int]]:
    """``"64:4,128:8"`` -> ``[(64, 4), (128, 8)]``: MQAR's (seq_len, num_pairs) splits.

    Raises:
      ValueError: not of that form, or a number < 1.
    """
    shapes = []
    for item in text.split(",") if text else ():
        length, sep, pairs = item.strip().partition(":")
        if not (sep and length.isdigit() and pairs.isdigit() and int(length) and int(pairs)):
            raise ValueError(f"not 'seq_len:num_pairs,...': {text!r}")
        shapes.append((int(length), int(pairs)))
    return shapes


def _mix_ok(value) -> bool:
    try:
        return isinstance(value, str) and (parse_mix(value) or not value.strip())
    except ValueError:
        return False


def mqar_shapes(config: ConfigDict, split: str) -> list[tuple[int, int]]:
    """The (seq_len, num_pairs) of MQAR's train or eval batches: ``mqar.train_mix``
    (``test_mix``), or ``(seq_len, mqar.num_pairs)`` when that is empty."""
    mix = config.mqar.get("train_mix" if split == "train" else "test_mix", "")
    return parse_mix(mix) or [(config.seq_len, config.mqar.num_pairs)]


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


# Rules over several fields: config -> a message, or None when it holds.
RULES: list[Callable[[ConfigDict], str | None]] = [
    lambda c: (
        f"model.num_heads={c.model.num_heads} must divide model.width={c.model.width}"
        if c.model.width % c.model.num_heads
        else None
    ),
    lambda c: (
        f"model.feature_map={c.model.feature_map!r} needs model.normalize=true (its per-query "
        f"stabilising shift cancels only when normalised), got model.normalize=false"
        if c.model.attention == "linear"
        and not c.model.normalize
        and _requires_normalize(c.model.feature_map)
        else None
    ),
    _mesh_rule,
    lambda c: _mqar_rule(c) if c.task == "mqar" else None,
    lambda c: (
        f"seq_len={c.seq_len} is too short for ListOps (needs >= 8)"
        if c.task == "listops" and c.seq_len < 8
        else None
    ),
]


def validate(config: ConfigDict) -> None:
    """Fails before any compute, and before the workdir is touched, on a config
    that cannot run.

    Raises:
      ValueError: naming the first bad field, what it must be and what it is.
    """
    if config.get("task") not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {config.get('task')!r}")
    fields = flatten(config)
    used = ATTENTION_FIELDS.get(fields.get("model.attention"), ())
    for name, (ok, expected) in FIELDS.items():
        if name not in fields:
            continue  # another task's section
        short = name.removeprefix("model.")
        if name.startswith("model.") and short in KIND_FIELDS and short not in used:
            continue  # a field this attention kind does not read
        if not ok(fields[name]):
            raise ValueError(f"{name} must be {expected}, got {fields[name]!r}")
    if "feature_map" in used and fields["model.feature_map"] not in _feature_map_names():
        raise ValueError(
            f"model.feature_map must be one of {_feature_map_names()}, "
            f"got {fields['model.feature_map']!r}"
        )
    for rule in RULES:
        message = rule(config)
        if message:
            raise ValueError(message)


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
    "text.sample_prompt",
    "text.sample_length",
)


def config_changes(stored: dict, config: ConfigDict) -> list[str]:
    """The fields outside ``RESUMABLE`` where ``config`` differs from ``stored``."""
    old, new = flatten(stored), flatten(config)
    changes = []
    for name in sorted(old.keys() | new.keys()):
        if any(name == p or name.startswith(p + ".") for p in RESUMABLE):
            continue
        before, now = old.get(name, "<absent>"), new.get(name, "<absent>")
        if before != now:
            changes.append(f"{name}={before!r} there, {now!r} now")
    return changes


# ----------------------------------------------------------------------------
# Task, model and optimiser.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
    kind: str  # "lm" or "classify"
    vocab_size: int
    num_classes: int
    batch: Callable[[int, str], data.Batch]  # (step, split) -> global batch
    text: np.ndarray | None = None  # text_lm: validation bytes for sampling
    # Named eval sets, (name, i -> the i-th eval batch), each reported apart (empty:
    # the eval batches are batch(i, "eval")).
    evals: tuple[tuple[str, Callable[[int], data.Batch]], ...] = ()


def build_task(config: ConfigDict) -> Task:
    b, t, seed = config.batch_size, config.seq_len, config.seed
    spec = TASKS[config.task]
    shape = (spec.kind, spec.vocab_size(config), spec.num_classes)
    if config.task == "mqar":
        c, spread = config.mqar, config.mqar.get("spread", False)
        train_shapes = mqar_shapes(config, "train")  # one split per step, in turn
        longest = max(length for length, _ in train_shapes)

        def mqar(step: int, split: str, shape: tuple[int, int]) -> data.Batch:
            # batch_size counts sequences of the longest training split; a shorter
            # split's batch holds as many tokens (and as many queries).
            length, pairs = shape
            rows = max(1, b * longest // length)
            return data.mqar_batch(
                seed, step, rows, length, pairs, c.vocab_size, split, spread=spread
            )

        evals = tuple(
            (f"{length}x{pairs}", functools.partial(mqar, split="eval", shape=(length, pairs)))
            for length, pairs in (mqar_shapes(config, "eval") if c.get("test_mix") else ())
        )
        return Task(
            *shape,
            lambda step, split: mqar(
                step,
                split,
                train_shapes[step % len(train_shapes)] if split == "train" else (t, c.num_pairs),
            ),
            evals=evals,
        )
    if config.task == "listops":
        c = config.listops
        return Task(
            *shape,
            lambda step, split: data.listops_batch(
                seed, step, b, t, c.max_depth, c.max_args, split
            ),
        )
    train, val = data.stdlib_text(config.text.num_files, config.text.val_fraction)
    return Task(
        *shape,
        lambda step, split: data.text_batch(
            train if split == "train" else val, seed, step, b, t, split
        ),
        text=val,
    )


def build_model(config: ConfigDict, mesh: Mesh | None = None) -> nnx.Module:
    """The config's model (its task's kind and vocabulary); ``mesh`` for sequence parallelism."""
    m, spec = config.model, TASKS[config.task]
    kwargs = dict(
        attention=m.attention,
        mlp_ratio=m.mlp_ratio,
        rngs=nnx.Rngs(config.seed),
        dtype=jnp.dtype(m.dtype),
    )
    if m.attention == "linear":
        decay = None if m.decay == "" else (m.decay if m.decay == "retnet" else float(m.decay))
        kwargs.update(
            feature_map=m.feature_map,
            method=m.method,
            chunk_size=m.chunk_size,
            decay=decay,
            gate=m.gate,
            normalize=m.normalize,
            num_features=m.num_features or None,
            feature_dim=m.get("feature_dim", 0) or None,
            max_length=max(config.seq_len, 1),
        )
    elif m.attention == "gla":
        kwargs.update(method=m.method, chunk_size=m.chunk_size)
    elif m.attention in ("deltanet", "gated_deltanet", "kda"):
        kwargs.update(chunk_size=m.chunk_size)
    else:
        kwargs.update(max_length=config.seq_len)
    if config.mesh.sequence > 1:
        kwargs.update(sequence_axis="sequence", batch_axis="data", mesh=mesh)
    if spec.kind == "lm":
        return models.LanguageModel(
            spec.vocab_size(config),
            m.width,
            m.depth,
            m.num_heads,
            short_conv=m.short_conv,
            **kwargs,
        )
    return models.SequenceClassifier(
        spec.vocab_size(config), spec.num_classes, m.width, m.depth, m.num_heads, **kwargs
    )


def learning_rate(config: ConfigDict) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay to 0 at ``steps``."""
    o = config.optim
    return optax.warmup_cosine_decay_schedule(
        0.0, o.lr, min(o.warmup_steps, config.steps), max(config.steps, o.warmup_steps + 1)
    )


def build_optimizer(config: ConfigDict) -> optax.GradientTransformation:
    """AdamW on the ``learning_rate`` schedule after clipping the gradient norm.

    Equal settings give the same (stateless) object, so that the jitted steps of a
    second run in one process find their compiled code (``nnx.Optimizer`` holds it
    as static data).
    """
    o = config.optim
    return _optimizer(config.steps, o.lr, o.warmup_steps, o.grad_clip, o.b1, o.b2, o.weight_decay)


@functools.lru_cache(maxsize=32)
def _optimizer(steps, lr, warmup_steps, grad_clip, b1, b2, weight_decay):
    config = ConfigDict({"steps": steps, "optim": {"lr": lr, "warmup_steps": warmup_steps}})
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(learning_rate(config), b1=b1, b2=b2, weight_decay=weight_decay),
    )


# ----------------------------------------------------------------------------
# Steps.
# ----------------------------------------------------------------------------


def loss_and_metrics(model, inputs, labels, key_mask, kind: str):
    """Mean cross-entropy over the positions (or sequences) that have labels."""
    if kind == "lm":
        logits = model(inputs)
        valid = labels != data.IGNORE
    else:
        logits = model(inputs, key_mask=key_mask)
        valid = jnp.ones(labels.shape, bool)
    safe = jnp.where(valid, labels, 0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    count = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    loss = jnp.sum(jnp.where(valid, nll, 0.0)) / count
    correct = jnp.where(valid, jnp.argmax(logits, -1) == safe, False)
    return loss, {"loss": loss, "accuracy": jnp.sum(correct).astype(jnp.float32) / count}


@nnx.jit(static_argnames="kind")
def train_step(model, optimizer, inputs, labels, key_mask, kind):
    grad_fn = nnx.value_and_grad(loss_and_metrics, has_aux=True)
    (_, metrics), grads = grad_fn(model, inputs, labels, key_mask, kind)
    optimizer.update(model, grads)
    return metrics | {"grad_norm": _global_norm(grads)}


def _global_norm(tree) -> jax.Array:
    """The l2 norm of all of ``tree``'s leaves together (``optax.tree.norm``, which
    optax 0.1.5, the oldest supported, lacks)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


@nnx.jit(static_argnames="kind")
def eval_step(model, inputs, labels, key_mask, kind):
    return loss_and_metrics(model, inputs, labels, key_mask, kind)[1]


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


class Sharder:
    """A ``data x sequence`` mesh over every device: batches split over ``data`` (and
    their length over ``sequence``), parameters replicated."""

    def __init__(self, sequence: int = 1):
        devices = np.array(jax.devices()).reshape(-1, sequence)
        self.mesh = Mesh(devices, ("data", "sequence"))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

    def put_batch(self, batch: data.Batch):
        """The global batch (every process makes the same one) as sharded arrays."""

        def put(x):
            sharding = NamedSharding(self.mesh, PartitionSpec(*("data", "sequence")[: x.ndim]))
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        return put(batch.inputs), put(batch.labels), put(batch.key_mask)

    def replicate(self, *modules) -> None:
        state = nnx.state(modules)
        nnx.update(modules, jax.device_put(state, self.replicated))


def evaluate(model, task: Task, config: ConfigDict, sharder: Sharder) -> dict:
    """Mean loss and accuracy over ``eval_batches`` batches; with named eval sets,
    also ``loss@name`` and ``accuracy@name`` for each, and their mean as the headline."""
    evals = task.evals or (("", lambda i: task.batch(i, "eval")),)
    out = {}
    for name, batch in evals:
        totals = {"loss": 0.0, "accuracy": 0.0}
        for i in range(config.eval_batches):
            metrics = eval_step(model, *sharder.put_batch(batch(i)), task.kind)
            for k in totals:
                totals[k] += float(metrics[k]) / config.eval_batches
        out |= {f"{k}@{name}": v for k, v in totals.items()} if name else totals
    if task.evals:
        for k in ("loss", "accuracy"):
            out[k] = sum(out[f"{k}@{name}"] for name, _ in task.evals) / len(task.evals)
    if config.task == "text_lm":
        out["bits_per_byte"] = out["loss"] / math.log(2)
    return out


def _reason(error: BaseException) -> str:
    """A one-line reason for an I/O failure: the operating system's (``No space
    left on device``) when it can be found, else the first line, shortened."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        code = re.search(r"os_error_code='?(\d+)", str(seen))  # tensorstore's errors
        if code:
            return os.strerror(int(code.group(1)))
        seen = seen.__cause__ or seen.__context__
    lines = str(error).strip().splitlines()
    return (lines[0][:200] if lines else "") or type(error).__name__


class _HoldLogs(logging_std.Filter):
    """Holds the records of a logger (orbax's tracebacks of a failed save, which
    the trainer reports in one line) and lets them out again on ``release``."""

    def __init__(self, logger: logging_std.Logger):
        super().__init__()
        self.logger, self.records = logger, []
        logger.addFilter(self)

    def filter(self, record) -> bool:
        self.records.append(record)
        return False

    def release(self, emit: bool) -> None:
        self.logger.removeFilter(self)
        for record in self.records if emit else ():
            self.logger.handle(record)


class _DropMentions(logging_std.Filter):
    """Drops the records that mention ``text`` (a failed save's folder: its writer
    threads keep logging tracebacks after the trainer reported it in one line)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def _has_checkpoints(workdir: Path) -> bool:
    folder = workdir / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def prepare_workdir(config: ConfigDict, workdir: Path) -> None:
    """Checks ``workdir`` against ``config`` and writes ``config.json`` there.

    A workdir with checkpoints of a different model, task or data is refused
    (``RESUMABLE`` lists the fields that may change); ``resume=false`` empties it.

    Raises:
      ValueError: the workdir holds a run of another config.
      OSError: the workdir cannot be written.
    """
    stored_path = workdir / "config.json"
    if config.resume and _has_checkpoints(workdir) and stored_path.is_file():
        try:
            stored = json.loads(stored_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{stored_path} is unreadable ({_reason(e)}); rerun with --config.resume=false "
                f"to start over in {workdir}, or use a new --workdir"
            ) from None
        changes = config_changes(stored, config)
        if changes:
            raise ValueError(
                f"{workdir} holds a run of another config ({'; '.join(changes)}): rerun with "
                f"that config to resume it, --config.resume=false to start over there, "
                f"or use a new --workdir"
            )
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        if not config.resume:
            for name in RUN_FILES:
                path = workdir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            for path in workdir.glob(EVENTS_GLOB):
                path.unlink()
        stored_path.write_text(config.to_json(indent=2))
    except OSError as e:
        raise OSError(f"cannot write to the workdir {workdir}: {_reason(e)}") from None


def restore_latest(
    manager: ocp.CheckpointManager, target: dict, workdir: Path, move_unreadable: bool = True
) -> tuple[int, dict | None]:
    """Restores the newest readable checkpoint. Newer unreadable ones (a file
    truncated by a kill) are skipped with a warning and, with ``move_unreadable``,
    moved to ``workdir/checkpoints_unreadable``.

    Returns:
      (its step, the restored state), or (0, None) when there is no checkpoint.

    Raises:
      ValueError: there are checkpoints but none is readable (nothing is moved).
    """
    steps = sorted(manager.all_steps(), reverse=True)
    unreadable = []
    for step in steps:
        try:
            restored = manager.restore(step, args=ocp.args.StandardRestore(target))
        except Exception as e:  # orbax and tensorstore raise many kinds
            unreadable.append((step, _reason(e)))
            continue
        for bad, reason in unreadable:
            where = ""
            if move_unreadable:
                aside = workdir / "checkpoints_unreadable" / str(bad)
                aside.parent.mkdir(exist_ok=True)
                shutil.rmtree(aside, ignore_errors=True)
                shutil.move(workdir / "checkpoints" / str(bad), aside)
                where = f" (moved to {aside})"
            logging.warning(
                "checkpoint step %d in %s is unreadable%s: %s; falling back to step %d",
                bad,
                workdir / "checkpoints",
                where,
                reason,
                step,
            )
        if unreadable and move_unreadable:
            manager.reload()
        return step, restored
    if unreadable:
        step, reason = unreadable[0]
        raise ValueError(
            f"no checkpoint in {workdir / 'checkpoints'} is readable (step {step}: {reason}); "
            f"rerun with --config.resume=false to start over there, or use a new --workdir"
        )
    return 0, None


def train(config: ConfigDict, workdir: str | Path) -> dict:
    """Trains (resuming from ``workdir``'s latest checkpoint) and returns the final
    evaluation, also written to ``workdir/final.json`` and ``final.md``.

    Raises:
      ValueError: a config that cannot run, or a workdir holding a run of another
        config (before any compute, and before the workdir is touched).
      OSError: the workdir or a checkpoint cannot be written (at once, or at the
        first save).
      FloatingPointError: the loss became non-finite; every checkpoint kept gives a
        finite loss at its next step.
    """
    validate(config)
    workdir = Path(workdir).absolute()
    prepare_workdir(config, workdir)
    task = build_task(config)
    sharder = Sharder(config.mesh.sequence)
    model = build_model(config, sharder.mesh)
    optimizer = nnx.Optimizer(model, build_optimizer(config), wrt=nnx.Param)
    sharder.replicate(model, optimizer)

    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True)
    with ocp.CheckpointManager(workdir / "checkpoints", options=options) as manager:
        target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        start, restored = restore_latest(manager, target, workdir)
        if restored is not None:
            nnx.update(model, restored["model"])
            nnx.update(optimizer, restored["optimizer"])
            logging.info("resuming %s from step %d", workdir, start)
        end = config.steps if config.stop_at <= 0 else min(config.stop_at, config.steps)
        _loop(config, task, model, optimizer, sharder, manager, workdir, start, end)
    if end < config.steps:
        return {"stopped_at": end}
    final = evaluate(model, task, config, sharder) | {"step": config.steps}
    if config.task == "text_lm":
        final["sample"] = sample_text(model, config)
    (workdir / "final.json").write_text(json.dumps(final, indent=2))
    (workdir / "final.md").write_text(results_row(config, final) + "\n")
    plot_metrics(workdir)
    return final


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; a torn line (a kill mid-write) is skipped."""
    rows = []
    if not path.is_file():
        return rows
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            logging.warning("%s:%d is torn (a kill mid-write?); skipping it", path, number)
            continue
        if isinstance(row, dict) and "step" in row and "split" in row:
            rows.append(row)
    return rows


def _truncate_metrics(path: Path, step: int) -> None:
    """Keeps the rows up to ``step`` (the restored checkpoint): a resumed run
    rewrites the steps after it."""
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


class _Checkpointer:
    """Saves through orbax; the first save is waited for, so a full disk or an
    unwritable folder stops the run there, with one line."""

    def __init__(self, manager: ocp.CheckpointManager):
        self.manager, self.saved = manager, False

    def _fail(self, step: int, error: Exception):
        return OSError(
            f"could not write checkpoint step {step} to {self.manager.directory}: {_reason(error)}"
        )

    def save(self, step: int, model, optimizer) -> None:
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        held = None if self.saved else _HoldLogs(logging_std.getLogger("absl"))
        try:
            self.manager.save(step, args=ocp.args.StandardSave(state))
            if held is not None:
                self.manager.wait_until_finished()
        except Exception as e:
            tmp = f"{self.manager.directory / str(step)}.orbax-checkpoint-tmp"
            logging_std.getLogger("absl").addFilter(_DropMentions(tmp))
            if held is not None:
                self._settle()
                held.release(emit=False)
            raise self._fail(step, e) from None
        if held is not None:
            held.release(emit=True)
        self.saved = True

    def _settle(self) -> None:
        """Waits out the failed save's other threads (each fails in turn)."""
        for _ in range(100):
            try:
                self.manager.wait_until_finished()
                self.manager.close()
                return
            except Exception:
                continue

    def wait(self, step: int) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._fail(step, e) from None


def _summary_writer(workdir: Path, start: int):
    """TensorBoard events in the workdir; those after ``start`` (a resumed run
    rewrites them) are purged. Only process 0 writes."""
    if jax.process_index():
        return None
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(workdir), purge_step=start + 1, flush_secs=30)


def _loop(config, task, model, optimizer, sharder, manager, workdir, start, end) -> None:
    from tqdm.auto import tqdm

    schedule = learning_rate(config)
    checkpoints = _Checkpointer(manager)
    bar = tqdm(
        range(start, end),
        initial=start,
        total=end,
        disable=True if not config.progress else None,  # None: only on a terminal
        desc=f"{config.task}/{config.model.attention}/{config.model.feature_map}",
    )

    def kept() -> str:
        last = manager.latest_step()
        if not last:
            return "no checkpoint had been saved yet"
        return (
            f"the last good checkpoint is step {last} in {workdir / 'checkpoints'} (rerun to "
            f"resume from it, e.g. with a lower --config.optim.lr)"
        )

    metrics_path = workdir / "metrics.jsonl"
    _truncate_metrics(metrics_path, start)
    writer = _summary_writer(workdir, start)
    last = time.perf_counter()
    try:
        with open(metrics_path, "a") as log:

            def write(row: dict) -> None:
                log.write(json.dumps(row) + "\n")
                log.flush()
                if writer is not None:
                    for key, value in row.items():
                        if key not in ("step", "split"):
                            writer.add_scalar(f"{row['split']}/{key}", value, row["step"])

            tokens = 0  # since the last log line
            for step in bar:
                batch = task.batch(step, "train")
                tokens += batch.inputs.size
                metrics = train_step(model, optimizer, *sharder.put_batch(batch), task.kind)
                loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    what = (
                        f"gradient norm became {grad_norm}"
                        if math.isfinite(loss)
                        else f"loss became {loss}"
                    )
                    raise FloatingPointError(f"{what} at step {step + 1}; stopping: {kept()}")
                done = step + 1
                if done % config.log_every == 0 or done == end:
                    now = time.perf_counter()
                    rate, tokens, last = tokens / (now - last), 0, now
                    write(
                        {
                            "step": done,
                            "split": "train",
                            "loss": loss,
                            "accuracy": float(metrics["accuracy"]),
                            "learning_rate": float(schedule(step)),
                            "grad_norm": grad_norm,
                            "tokens_per_s": rate,
                        }
                    )
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
                if done % config.eval_every == 0 or done == config.steps:
                    write({"step": done, "split": "eval"} | evaluate(model, task, config, sharder))
                if done % config.checkpoint_every == 0 or done == end:
                    # Parameters that overflow only show at the next step's forward: check
                    # it now, so that a checkpoint kept is one that resumes.
                    probe = eval_step(
                        model, *sharder.put_batch(task.batch(done, "train")), task.kind
                    )
                    if not math.isfinite(float(probe["loss"])):
                        raise FloatingPointError(
                            f"loss becomes {float(probe['loss'])} at step {done + 1} with the "
                            f"parameters after step {done}, which are not saved; stopping: "
                            f"{kept()}"
                        )
                    checkpoints.save(done, model, optimizer)
            checkpoints.wait(end)
    finally:
        bar.close()
        if writer is not None:
            writer.close()


def sample_text(model, config: ConfigDict, prompt: str | None = None, length: int | None = None):
    """A sample of a byte-level language model after ``prompt`` (the config's by default)."""
    prompt = config.text.sample_prompt if prompt is None else prompt
    length = config.text.sample_length if length is None else length
    tokens = np.frombuffer(prompt.encode(), np.uint8).astype(np.int32)
    out = model.generate(
        jnp.asarray(tokens)[None], length, jax.random.PRNGKey(config.seed), temperature=0.8
    )
    return bytes(np.asarray(out[0]).astype(np.uint8).tolist()).decode("utf-8", "replace")


def load(workdir: str | Path) -> tuple[nnx.Module, ConfigDict]:
    """The trained model of a workdir (its newest readable checkpoint) and its config.

    Args:
      workdir: a ``train`` workdir (``config.json`` and ``checkpoints/``).

    Returns:
      (model, config): the model on the default device (no sequence parallelism),
      and the run's config, locked.

    Raises:
      ValueError: no ``config.json`` or no readable checkpoint there.
    """
    workdir = Path(workdir)
    if not (workdir / "config.json").is_file():
        raise ValueError(f"workdir {workdir} has no config.json: not a training workdir")
    config = ConfigDict(json.loads((workdir / "config.json").read_text()))
    config.mesh.sequence = 1  # the layers' sharding is a training choice
    validate_task = config.get("task")
    if validate_task not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {validate_task!r}")
    model = build_model(config)
    optimizer = nnx.Optimizer(model, build_optimizer(config), wrt=nnx.Param)
    folder = workdir / "checkpoints"
    if not _has_checkpoints(workdir):
        raise ValueError(f"workdir {workdir} has no checkpoint in {folder}")
    options = ocp.CheckpointManagerOptions(create=False)
    with ocp.CheckpointManager(folder.absolute(), options=options) as manager:
        target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        step, restored = restore_latest(manager, target, workdir, move_unreadable=False)
    if restored is None:
        raise ValueError(f"workdir {workdir} has no readable checkpoint in {folder}")
    nnx.update(model, restored["model"])
    config.lock()
    return model, config


def results_row(config: ConfigDict, final: dict) -> str:
    m = config.model
    metric = (
        f"{final['bits_per_byte']:.3f} bits/byte"
        if "bits_per_byte" in final
        else f"{100 * final['accuracy']:.1f}% accuracy"
    )
    return (
        f"| {config.task} | {m.attention} | {m.feature_map if m.attention == 'linear' else '-'}"
        f" | {m.width}x{m.depth} | {config.seq_len} | {config.steps} | {final['loss']:.3f} "
        f"| {metric} |"
    )


def run_title(config: ConfigDict | dict) -> str:
    """``"mqar, linear attention (taylor), width 64"``: what a plot of the run shows."""
    c = ConfigDict(config) if isinstance(config, dict) else config
    m = c.model
    kind = f"{m.attention} attention" + (f" ({m.feature_map})" if m.attention == "linear" else "")
    return f"{c.task}, {kind}, width {m.width}"


def curves_figure(rows: list[dict], config: ConfigDict | dict | None):
    """Train and eval loss (bits per byte for text) and accuracy against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    text = config is not None and config["task"] == "text_lm"
    scale = 1 / math.log(2) if text else 1.0
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    for split, style in [("train", "-"), ("eval", "o-")]:
        pts = [(r["step"], r["loss"] * scale, r["accuracy"]) for r in rows if r["split"] == split]
        if pts:
            steps, loss, acc = zip(*pts, strict=True)
            ax_loss.plot(steps, loss, style, label=split)
            ax_acc.plot(steps, acc, style, label=split)
    ax_loss.set(xlabel="step", ylabel="bits per byte" if text else "loss", yscale="log")
    for set_formatter in (ax_loss.yaxis.set_major_formatter, ax_loss.yaxis.set_minor_formatter):
        set_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False))  # 2.5, not 2.5e0
    ax_acc.set(xlabel="step", ylabel="next-byte accuracy" if text else "accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    if config is not None:
        fig.suptitle(run_title(config))
    fig.tight_layout()
    return fig


def plot_metrics(workdir: Path) -> None:
    """``workdir/curves.png`` from ``metrics.jsonl`` (titled from ``config.json``)."""
    import matplotlib.pyplot as plt

    workdir = Path(workdir)
    stored = workdir / "config.json"
    config = json.loads(stored.read_text()) if stored.is_file() else None
    fig = curves_figure(read_metrics(workdir / "metrics.jsonl"), config)
    fig.savefig(workdir / "curves.png", dpi=100)
    plt.close(fig)
