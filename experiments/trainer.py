"""The training loop: model and optimiser from a config, data parallelism over
every device, orbax checkpoints with exact resumption, metrics, plots, results.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from experiments import data
from linattn_jax import feature_maps, layers, models

TASKS = ("mqar", "listops", "text_lm")
RANDOM_OR_LEARNED = ("favor_plus", "random_fourier", "hedgehog", "cosformer")


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


def override(config: ConfigDict, assignment: str) -> None:
    """Applies ``"model.lr=3e-4"`` to a locked config; an unknown field is an error."""
    name, sep, text = assignment.partition("=")
    if not sep:
        raise ValueError(f"an override must look like field=value, got {assignment!r}")
    *parents, leaf = name.split(".")
    node = config
    for part in parents:
        if not isinstance(node, ConfigDict) or part not in node:
            raise ValueError(f"unknown config field {name!r}")
        node = node[part]
    if not isinstance(node, ConfigDict) or leaf not in node:
        raise ValueError(f"unknown config field {name!r}")
    old = node[leaf]
    if isinstance(old, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{name} must be true or false, got {text!r}")
        value = text.lower() == "true"
    elif isinstance(old, int | float):
        value = type(old)(float(text)) if isinstance(old, float) else int(text)
    else:
        value = text
    node[leaf] = value


def validate(config: ConfigDict) -> None:
    """Fails before any compute on a config that cannot run."""
    if config.task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {config.task!r}")
    m = config.model
    if m.attention not in layers.ATTENTION_KINDS:
        raise ValueError(
            f"model.attention must be one of {layers.ATTENTION_KINDS}, got {m.attention!r}"
        )
    if m.attention == "linear" and m.feature_map not in RANDOM_OR_LEARNED:
        feature_maps.get(m.feature_map)  # raises on an unknown name
    if config.optim.lr <= 0:
        raise ValueError(f"optim.lr must be positive, got {config.optim.lr}")
    for field in (
        "steps",
        "batch_size",
        "seq_len",
        "eval_batches",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
    ):
        if config[field] < 1:
            raise ValueError(f"{field} must be >= 1, got {config[field]}")
    if m.width % m.num_heads:
        raise ValueError(f"model.num_heads={m.num_heads} must divide model.width={m.width}")
    seq_devices = config.mesh.sequence
    if seq_devices < 1 or jax.device_count() % seq_devices:
        raise ValueError(
            f"mesh.sequence={seq_devices} must divide the {jax.device_count()} devices"
        )
    data_devices = jax.device_count() // seq_devices
    if config.batch_size % data_devices:
        raise ValueError(
            f"batch_size={config.batch_size} must be divisible by the {data_devices} devices "
            f"of the data axis"
        )
    if seq_devices > 1:
        if config.task == "listops" or m.attention != "linear":
            raise ValueError(
                "mesh.sequence > 1 (sequence parallelism) needs a causal linear-attention "
                "language model"
            )
        if config.seq_len % seq_devices:
            raise ValueError(
                f"seq_len={config.seq_len} must be divisible by mesh.sequence={seq_devices}"
            )
    if config.task == "mqar" and 4 * config.mqar.num_pairs > config.seq_len:
        raise ValueError(
            f"seq_len={config.seq_len} is too short for MQAR with "
            f"mqar.num_pairs={config.mqar.num_pairs} (needs 4 * num_pairs)"
        )
    if config.task == "listops" and config.seq_len < 8:
        raise ValueError(f"seq_len={config.seq_len} is too short for ListOps")


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


def build_task(config: ConfigDict) -> Task:
    b, t, seed = config.batch_size, config.seq_len, config.seed
    if config.task == "mqar":
        c = config.mqar
        return Task(
            "lm",
            c.vocab_size,
            0,
            lambda step, split: data.mqar_batch(seed, step, b, t, c.num_pairs, c.vocab_size, split),
        )
    if config.task == "listops":
        c = config.listops
        return Task(
            "classify",
            data.LISTOPS_VOCAB,
            10,
            lambda step, split: data.listops_batch(
                seed, step, b, t, c.max_depth, c.max_args, split
            ),
        )
    train, val = data.stdlib_text(config.text.num_files, config.text.val_fraction)
    return Task(
        "lm",
        256,
        0,
        lambda step, split: data.text_batch(
            train if split == "train" else val, seed, step, b, t, split
        ),
        text=val,
    )


def build_model(config: ConfigDict, task: Task, mesh: Mesh | None = None) -> nnx.Module:
    m = config.model
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
            max_length=max(config.seq_len, 1),
        )
        if config.mesh.sequence > 1:
            kwargs.update(sequence_axis="sequence", batch_axis="data", mesh=mesh)
    else:
        kwargs.update(max_length=config.seq_len)
    if task.kind == "lm":
        return models.LanguageModel(
            task.vocab_size, m.width, m.depth, m.num_heads, short_conv=m.short_conv, **kwargs
        )
    return models.SequenceClassifier(
        task.vocab_size, task.num_classes, m.width, m.depth, m.num_heads, **kwargs
    )


def build_optimizer(config: ConfigDict) -> optax.GradientTransformation:
    o = config.optim
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, o.lr, min(o.warmup_steps, config.steps), max(config.steps, o.warmup_steps + 1)
    )
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay),
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
    return metrics


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
    totals = {"loss": 0.0, "accuracy": 0.0}
    for i in range(config.eval_batches):
        out = eval_step(model, *sharder.put_batch(task.batch(i, "eval")), task.kind)
        for k in totals:
            totals[k] += float(out[k]) / config.eval_batches
    if config.task == "text_lm":
        totals["bits_per_byte"] = totals["loss"] / math.log(2)
    return totals


def train(config: ConfigDict, workdir: str | Path) -> dict:
    """Trains (resuming from ``workdir``'s latest checkpoint) and returns the final
    evaluation, also written to ``workdir/final.json`` and ``final.md``.

    Raises:
      ValueError: a config that cannot run (before any compute).
      FloatingPointError: the loss became non-finite (the last good checkpoint stays).
    """
    validate(config)
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json(indent=2))
    task = build_task(config)
    sharder = Sharder(config.mesh.sequence)
    model = build_model(config, task, sharder.mesh)
    optimizer = nnx.Optimizer(model, build_optimizer(config), wrt=nnx.Param)
    sharder.replicate(model, optimizer)

    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True)
    with ocp.CheckpointManager(workdir / "checkpoints", options=options) as manager:
        start = manager.latest_step() or 0
        if start:
            target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
            restored = manager.restore(start, args=ocp.args.StandardRestore(target))
            nnx.update(model, restored["model"])
            nnx.update(optimizer, restored["optimizer"])
        end = config.steps if config.stop_at <= 0 else min(config.stop_at, config.steps)
        _loop(config, task, model, optimizer, sharder, manager, workdir, start, end)
        manager.wait_until_finished()
    if end < config.steps:
        return {"stopped_at": end}
    final = evaluate(model, task, config, sharder) | {"step": config.steps}
    if config.task == "text_lm":
        final["sample"] = sample_text(model, config, task)
    (workdir / "final.json").write_text(json.dumps(final, indent=2))
    (workdir / "final.md").write_text(results_row(config, final) + "\n")
    plot_metrics(workdir)
    return final


def _loop(config, task, model, optimizer, sharder, manager, workdir, start, end) -> None:
    from tqdm.auto import tqdm

    tokens_per_step = config.batch_size * config.seq_len
    bar = tqdm(
        range(start, end),
        initial=start,
        total=end,
        disable=not config.progress,
        desc=f"{config.task}/{config.model.attention}/{config.model.feature_map}",
    )
    last = time.perf_counter()
    with open(workdir / "metrics.jsonl", "a") as log:
        for step in bar:
            metrics = train_step(
                model, optimizer, *sharder.put_batch(task.batch(step, "train")), task.kind
            )
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                last = manager.latest_step()
                kept = (
                    f"the last good checkpoint is step {last} in {workdir / 'checkpoints'}"
                    if last
                    else "no checkpoint had been saved yet"
                )
                raise FloatingPointError(f"loss became {loss} at step {step + 1}; stopping: {kept}")
            done = step + 1
            if done % config.log_every == 0 or done == end:
                now = time.perf_counter()
                rate = tokens_per_step * min(config.log_every, done - start) / (now - last)
                last = now
                row = {
                    "step": done,
                    "split": "train",
                    "loss": loss,
                    "accuracy": float(metrics["accuracy"]),
                    "tokens_per_s": rate,
                }
                log.write(json.dumps(row) + "\n")
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}")
            if done % config.eval_every == 0 or done == config.steps:
                log.write(
                    json.dumps(
                        {"step": done, "split": "eval"} | evaluate(model, task, config, sharder)
                    )
                    + "\n"
                )
            log.flush()
            if done % config.checkpoint_every == 0 or done == end:
                state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
                manager.save(done, args=ocp.args.StandardSave(state))


def sample_text(model, config: ConfigDict, task: Task) -> str:
    prompt = np.frombuffer(config.text.sample_prompt.encode(), np.uint8).astype(np.int32)
    out = model.generate(
        jnp.asarray(prompt)[None],
        config.text.sample_length,
        jax.random.PRNGKey(config.seed),
        temperature=0.8,
    )
    return bytes(np.asarray(out[0]).astype(np.uint8).tolist()).decode("utf-8", "replace")


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


def plot_metrics(workdir: Path) -> None:
    """``workdir/curves.png``: train loss and eval accuracy against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    for split, style in [("train", "-"), ("eval", "o-")]:
        pts = [(r["step"], r["loss"], r["accuracy"]) for r in rows if r["split"] == split]
        if pts:
            steps, loss, acc = zip(*pts, strict=True)
            ax_loss.plot(steps, loss, style, label=split)
            ax_acc.plot(steps, acc, style, label=split)
    ax_loss.set(xlabel="step", ylabel="loss", yscale="log")
    ax_acc.set(xlabel="step", ylabel="accuracy")
    ax_loss.legend()
    fig.tight_layout()
    fig.savefig(workdir / "curves.png", dpi=100)
    plt.close(fig)
