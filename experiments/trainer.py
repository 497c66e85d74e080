"""Training: a config's model and optimiser (built by ``builders``), the jitted train and
eval steps, data, FSDP, tensor and sequence parallelism over every device, and ``train``, the
loop that resumes exactly from a workdir's latest checkpoint, logs, evaluates and saves at
the config's cadence, and stops with one line on a non-finite loss.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from ml_collections import ConfigDict

from experiments import data, distributed, reporting
from experiments.builders import BATCH_AXES, build_model, build_optimizer, learning_rate
from experiments.checkpoints import (
    Checkpointer,
    WriteError,
    orbax_logs_held,
    prepare_workdir,
    restore_latest,
    write_error,
)
from experiments.tasks import Task, build_task
from experiments.validation import validate
from linattn_jax import sharding
from linattn_jax.layers import moe

# ----------------------------------------------------------------------------
# Steps and devices.
# ----------------------------------------------------------------------------


def loss_and_metrics(model, inputs, labels, key_mask, kind: str):
    """Mean cross-entropy over the positions (or sequences) that have labels."""
    count = label_count(labels, kind)
    _, (loss, correct, _) = _weighted_loss(model, inputs, labels, key_mask, kind, count)
    return loss, {"loss": loss, "accuracy": correct}


def label_count(labels, kind: str) -> jax.Array:
    """How many targets ``labels`` holds (at least 1): the loss's denominator."""
    valid = labels != data.IGNORE if kind == "lm" else jnp.ones(labels.shape, bool)
    return jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)


def _weighted_loss(model, inputs, labels, key_mask, kind: str, count, router=(0.0, 0.0), share=1.0):
    """``(objective, (loss, correct, router_losses))``: the summed cross-entropy and correct
    predictions of the batch, each over ``count`` (a micro-batch's share of its whole
    batch's mean when ``count`` is the whole batch's); the MoE layers' mean losses
    (``layers.moe.collect_losses``: load balancing, router z) times ``share`` (a
    micro-batch's, ``1 / accumulate``); the objective, the loss plus ``router``'s weights
    times those."""
    if kind == "lm":
        logits = model(inputs)
        valid = labels != data.IGNORE
    else:
        logits = model(inputs, key_mask=key_mask)
        valid = jnp.ones(labels.shape, bool)
    safe = jnp.where(valid, labels, 0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    loss = jnp.sum(jnp.where(valid, nll, 0.0)) / count
    correct = jnp.where(valid, jnp.argmax(logits, -1) == safe, False)
    router_losses = moe.collect_losses(model) * share  # read in the trace that recorded them
    objective = loss + router[0] * router_losses[0] + router[1] * router_losses[1]
    return objective, (loss, jnp.sum(correct).astype(jnp.float32) / count, router_losses)


@nnx.jit(static_argnames=("kind", "accumulate", "router"))
def train_step(
    model, optimizer, inputs, labels, key_mask, kind, accumulate: int = 1, router=(0.0, 0.0)
):
    """One AdamW step on the batch; returns its loss, accuracy and gradient norm (and with
    MoE layers their mean ``load_balancing_loss`` and ``router_z_loss``).

    ``accumulate``: the gradient is summed over that many micro-batches in turn (a
    ``lax.scan``: one micro-batch's activations in memory), each weighted by its share
    of the batch's targets, so that the step is the one of the whole batch (the MoE
    losses: their mean over the micro-batches). ``router``: the weights of the MoE losses
    in the objective (``optim.load_balancing_loss``, ``optim.router_z_loss``).
    """
    count = label_count(labels, kind)
    losses = functools.partial(_grads, kind=kind, count=count, router=router, share=1 / accumulate)
    if accumulate == 1:
        (loss, correct, router_losses), grads = losses(model, inputs, labels, key_mask)
    else:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        # The parameters ride in the carry, unchanged: NNX merges only values of the scan's
        # own trace level.
        def micro_step(carry, micro_batch):
            sums, params, rest = carry
            micro_model = nnx.merge(graphdef, params, rest)
            values, grads = losses(micro_model, *micro_batch)
            rest = nnx.split(micro_model, nnx.Param, ...)[2]  # e.g. a dropout's RNG, moved on
            return (jax.tree.map(jnp.add, sums, (*values, grads)), params, rest), None

        zeros = (jnp.zeros(()), jnp.zeros(()), jnp.zeros(2), jax.tree.map(jnp.zeros_like, params))
        micro_batches = [_micro_batches(x, accumulate) for x in (inputs, labels, key_mask)]
        carry, _ = jax.lax.scan(micro_step, (zeros, params, rest), micro_batches)
        (loss, correct, router_losses, grads), _, rest = carry
        nnx.update(model, rest)
    optimizer.update(model, grads)
    metrics = {"loss": loss, "accuracy": correct, "grad_norm": _global_norm(grads)}
    if jax.tree.leaves(nnx.state(model, moe.RouterLosses)):  # a model with MoE layers
        metrics |= dict(zip(_ROUTER_METRICS, router_losses, strict=True))
    return metrics


_ROUTER_METRICS = tuple(f"{name}_loss" for name in moe.LOSSES)


def _grads(model, inputs, labels, key_mask, *, kind: str, count, router, share):
    """``_weighted_loss``'s values (the loss, accuracy and MoE losses), and the gradient of
    its objective with respect to the parameters."""
    grad_fn = nnx.value_and_grad(_weighted_loss, has_aux=True)
    (_, values), grads = grad_fn(model, inputs, labels, key_mask, kind, count, router, share)
    return values, grads


def _micro_batches(x: jax.Array, k: int) -> jax.Array:
    """``[b, ...]`` -> ``[k, b / k, ...]``, micro-batch ``i`` the rows ``i, i + k, ...``: each
    device's rows (a contiguous block of the ``data`` axis) split evenly among them."""
    return jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0)


def _global_norm(tree) -> jax.Array:
    """The l2 norm of all of ``tree``'s leaves together (``optax.tree.norm``, which
    optax 0.1.5, the oldest supported, lacks)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


@nnx.jit(static_argnames="kind")
def eval_step(model, inputs, labels, key_mask, kind):
    """The batch's loss and accuracy."""
    return loss_and_metrics(model, inputs, labels, key_mask, kind)[1]


class Sharder:
    """A ``data x fsdp x expert x sequence x tensor`` mesh over every device, the data axis
    taking what the others leave: batches split over ``data``, ``fsdp`` and ``expert``
    (their length over ``sequence``); parameters and optimizer state placed by their
    layers' logical axes (``linattn_jax.sharding.RULES``: split over ``fsdp`` and
    ``tensor``, a mixture's experts over ``expert``, replicated over ``data`` and
    ``sequence``)."""

    AXES = ("data", "fsdp", sharding.EXPERT_AXIS, "sequence", "tensor")
    BATCH = BATCH_AXES  # the axes that split a batch

    def __init__(self, sequence: int = 1, *, fsdp: int = 1, tensor: int = 1, expert: int = 1):
        devices = np.array(jax.devices()).reshape(-1, fsdp, expert, sequence, tensor)
        self.mesh = Mesh(devices, self.AXES)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

    @classmethod
    def of(cls, config: ConfigDict) -> Sharder:
        """The mesh of ``config.mesh`` (fields missing from an older config: 1)."""
        m = config.mesh
        return cls(
            m.sequence, fsdp=m.get("fsdp", 1), tensor=m.get("tensor", 1), expert=m.get("expert", 1)
        )

    def put_batch(self, batch: data.Batch):
        """The global batch (every process makes the same one) as sharded arrays."""

        def put(x):
            spec = PartitionSpec(*(self.BATCH, "sequence")[: x.ndim])
            sharding = NamedSharding(self.mesh, spec)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        return put(batch.inputs), put(batch.labels), put(batch.key_mask)

    def create(self, make):
        """``make()``'s modules (a tuple of them), created under jit straight into their
        shardings (``linattn_jax.sharding.place``): no parameter or moment is ever whole
        on one device."""

        @nnx.jit
        def create():
            modules = make()
            state = nnx.state(modules)
            placed = sharding.place(state, self.mesh)
            nnx.update(modules, jax.lax.with_sharding_constraint(state, placed))
            return modules

        return create()

    def place(self, *modules) -> tuple:
        """The modules, their state moved into its shardings (``linattn_jax.sharding.place``);
        for modules that cannot be created under jit."""
        state = nnx.state(modules)
        nnx.update(modules, jax.device_put(state, sharding.place(state, self.mesh)))
        return modules

    def replicate(self, *modules) -> None:
        """Puts the modules' state on every device."""
        state = nnx.state(modules)
        nnx.update(modules, jax.device_put(state, self.replicated))


def create_state(config: ConfigDict, sharder: Sharder) -> tuple[nnx.Module, nnx.Optimizer]:
    """The config's model and its optimiser, split over ``sharder``'s mesh."""

    def make():
        model = build_model(config, sharder.mesh)
        return model, nnx.Optimizer(model, build_optimizer(config), wrt=nnx.Param)

    if config.get("init_from"):  # weights read from disk: built whole, then split
        return sharder.place(*make())
    return sharder.create(make)


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


# ----------------------------------------------------------------------------
# Training.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """What the training loop works on.

    Attributes:
      config: the run's config (validated).
      task: its task.
      model: the model, split over the mesh.
      optimizer: its optimiser.
      sharder: the mesh that batches are split over.
      manager: the orbax manager of ``workdir/checkpoints``.
      workdir: the run's folder.
      start: the step of the restored checkpoint (0 without one).
      end: the last step to run (``stop_at`` or ``steps``).
    """

    config: ConfigDict
    task: Task
    model: nnx.Module
    optimizer: nnx.Optimizer
    sharder: Sharder
    manager: ocp.CheckpointManager
    workdir: Path
    start: int
    end: int


def _on_the_mesh(train):
    """``train`` under its config's mesh (``jax.set_mesh``), where the models pin their
    activations' batch and length (``linattn_jax.sharding.constrain``), and under the
    logical axis rules (``nnx.logical_axis_rules``: Flax's own transforms, such as
    ``nnx.eval_shape``, then read the layers' names as mesh axes)."""

    @functools.wraps(train)
    def on_the_mesh(config: ConfigDict, *args, **kwargs):
        distributed.initialize(config)  # before any device is used (train's call: a no-op)
        validate(config)  # before the mesh is made of its fields
        with jax.set_mesh(Sharder.of(config).mesh), nnx.logical_axis_rules(sharding.RULES):
            return train(config, *args, **kwargs)

    return on_the_mesh


@_on_the_mesh
def train(
    config: ConfigDict, workdir: str | Path, *, verbose: bool = False, lines: bool = True
) -> dict:
    """Trains (resuming from ``workdir``'s latest checkpoint) and returns the final
    evaluation, also written to ``workdir/final.json`` and ``final.md``.

    ``verbose``: let orbax's logs of a failed save or restore through (a traceback per
    writer thread), and chain each error to its cause; by default each failure is one line.
    ``lines``: off a terminal, print a line per logged step, resume and save (sweeps and
    grids print one line per run instead).

    Raises:
      ValueError: a config that cannot run, or a workdir holding a run of another
        config (before any compute, and before the workdir is touched).
      OSError: the workdir, a checkpoint or a metrics file cannot be written (at once,
        at the first save, or, for a disk that fills later, at the next save), in one
        line naming the step, the workdir and the free space on its disk.
      FloatingPointError: the loss became non-finite; every checkpoint kept gives a
        finite loss at its next step.
    """
    distributed.initialize(config)
    validate(config)
    workdir = Path(workdir).absolute()
    _prepare_workdir(config, workdir)
    task = build_task(config)
    sharder = Sharder.of(config)
    model, optimizer = create_state(config, sharder)

    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True)
    manager = checkpoints = None
    try:
        # Orbax logs each unreadable checkpoint it lists: held, and dropped if none is
        # readable (restore_latest's error says so).
        with orbax_logs_held(verbose):
            manager = ocp.CheckpointManager(workdir / "checkpoints", options=options)
            target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
            start, restored = restore_latest(manager, target, workdir, verbose=verbose)
        if restored is not None:
            nnx.update(model, restored["model"])
            nnx.update(optimizer, restored["optimizer"])
            logging.info("resuming %s from step %d", workdir, start)
        end = config.steps if config.stop_at <= 0 else min(config.stop_at, config.steps)
        checkpoints = Checkpointer(manager, workdir, verbose=verbose)
        run = Run(config, task, model, optimizer, sharder, manager, workdir, start, end)
        _loop(run, checkpoints, lines)
        checkpoints.close()
    except BaseException:
        # A save in flight may fail as well: its error must not replace this one.
        if checkpoints is None and manager is not None:
            checkpoints = Checkpointer(manager, workdir, verbose=verbose)
        if checkpoints is not None:
            checkpoints.abandon()
        raise
    if end < config.steps:
        return {"stopped_at": end}
    final = evaluate(model, task, config, sharder) | {"step": config.steps}
    if config.task == "text_lm":
        final["sample"] = sample_text(model, config)
    if distributed.is_primary():
        _write_final(config, final, workdir, verbose)
    return final


def _write_final(config: ConfigDict, final: dict, workdir: Path, verbose: bool) -> None:
    """``final.json``, ``final.md`` and ``curves.png`` in the workdir."""
    try:
        (workdir / "final.json").write_text(json.dumps(final, indent=2))
        (workdir / "final.md").write_text(reporting.results_row(config, final) + "\n")
        reporting.plot_metrics(workdir)
    except OSError as e:
        what = f"the final evaluation (step {config.steps}) to {workdir}"
        raise write_error(what, workdir, e) from (e if verbose else None)


def _prepare_workdir(config: ConfigDict, workdir: Path) -> None:
    """``prepare_workdir`` on a run's processes: each checks (all fail alike) before the
    first writes, and the others go on once it has."""
    if jax.process_count() > 1:
        prepare_workdir(config, workdir, write=False)
        distributed.barrier("workdir checked")
    if distributed.is_primary():
        prepare_workdir(config, workdir)
    distributed.barrier("workdir prepared")


def _kept(run: Run) -> str:
    """Where a stopped run resumes from, in words."""
    last = run.manager.latest_step()
    if not last:
        return "no checkpoint had been saved yet"
    return (
        f"the last good checkpoint is step {last} in {run.workdir / 'checkpoints'} (rerun to "
        f"resume from it, e.g. with a lower --config.optim.lr)"
    )


def _check_step(run: Run, step: int, loss: float, grad_norm: float) -> None:
    """Raises FloatingPointError when step ``step + 1`` gave a non-finite loss or gradient."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        what = f"gradient norm became {grad_norm}" if math.isfinite(loss) else f"loss became {loss}"
        raise FloatingPointError(f"{what} at step {step + 1}; stopping: {_kept(run)}")


def _check_next_step(run: Run, done: int) -> None:
    """Raises FloatingPointError when the parameters after step ``done`` give a
    non-finite loss at the next step (parameters that overflow show only there), so
    that a checkpoint kept is one that resumes."""
    batch = run.sharder.put_batch(run.task.batch(done, "train"))
    probe = eval_step(run.model, *batch, run.task.kind)
    if not math.isfinite(float(probe["loss"])):
        raise FloatingPointError(
            f"loss becomes {float(probe['loss'])} at step {done + 1} with the "
            f"parameters after step {done}, which are not saved; stopping: {_kept(run)}"
        )


def _loop(run: Run, checkpoints: Checkpointer, lines: bool = True) -> None:
    """Steps ``run.start + 1`` to ``run.end``, logging, evaluating and saving (through
    ``checkpoints``) at the config's cadence (``lines``: as ``train``'s). The steps'
    metrics stay on the devices until a row is due, an evaluation or a save (one transfer
    for all of them): each step's loss and gradient norm are checked then, before anything
    is saved.

    Raises:
      OSError: a write to the workdir failed, in one line naming the step.
    """
    config, task = run.config, run.task
    schedule = learning_rate(config)
    done = run.start
    desc = f"{config.task}/{config.model.attention}/{config.model.feature_map}"
    progress = reporting.Progress(run.start, run.end, desc, config.progress, lines)
    if run.start:
        progress.note(f"resuming from step {run.start} of {run.workdir}")
    router = (config.optim.get("load_balancing_loss", 0.0), config.optim.get("router_z_loss", 0.0))
    step_fn = functools.partial(
        train_step, run.model, run.optimizer, kind=task.kind,
        accumulate=config.optim.accumulate, router=tuple(map(float, router)),
    )  # fmt: skip
    try:
        with reporting.MetricsLog(run.workdir, run.start) as log:
            tokens, last = 0, time.perf_counter()  # tokens since the last log line
            pending = []  # the metrics (on the devices) of the steps since the last fetch
            for step in range(run.start, run.end):
                batch = task.batch(step, "train")
                tokens += batch.inputs.size
                pending.append(step_fn(*run.sharder.put_batch(batch)))
                progress.step()
                done = step + 1
                logs = done % config.log_every == 0 or done == run.end
                evaluates = done % config.eval_every == 0 or done == config.steps
                saves = done % config.checkpoint_every == 0 or done == run.end
                if not (logs or evaluates or saves):
                    continue
                metrics = _fetch_checked(run, done, pending)
                pending = []
                if logs:
                    now = time.perf_counter()
                    rate, tokens, last = tokens / (now - last), 0, now
                    row = _train_row(done, metrics, float(schedule(step)), rate)
                    log.write(row)
                    progress.row(row)
                if evaluates:
                    evaluation = evaluate(run.model, task, config, run.sharder)
                    log.write({"step": done, "split": "eval"} | evaluation)
                if saves:
                    _check_next_step(run, done)
                    _save(checkpoints, done, run, progress)
            _save(checkpoints, None, run, progress)
    except WriteError:
        raise
    except OSError as e:  # metrics.jsonl or TensorBoard's events, on a full disk
        name = Path(e.filename).name if getattr(e, "filename", None) else "the metrics"
        what = f"{name} to {run.workdir} at step {done}"
        raise write_error(what, run.workdir, e) from (e if checkpoints.verbose else None)
    finally:
        progress.close()


def _fetch_checked(run: Run, done: int, pending: list[dict]) -> dict:
    """The last step's metrics, from one transfer of the ``pending`` steps' (the steps up
    to ``done``); raises FloatingPointError at the first of them that was not finite."""
    fetched = jax.device_get(pending)
    for step, metrics in enumerate(fetched, done - len(fetched)):
        _check_step(run, step, float(metrics["loss"]), float(metrics["grad_norm"]))
    return fetched[-1]


def _train_row(done: int, metrics: dict, lr: float, rate: float) -> dict:
    """The ``metrics.jsonl`` row of step ``done``."""
    return {
        "step": done,
        "split": "train",
        "loss": float(metrics["loss"]),
        "accuracy": float(metrics["accuracy"]),
        "learning_rate": lr,
        "grad_norm": float(metrics["grad_norm"]),
        "tokens_per_s": rate,
    } | {name: float(metrics[name]) for name in _ROUTER_METRICS if name in metrics}


def _save(checkpoints: Checkpointer, step: int | None, run: Run, progress) -> None:
    """Saves checkpoint ``step`` (None: waits for the save in flight), noting each save
    known to be finished (the first at once, each later one when the next starts)."""
    before = checkpoints.pending
    if step is None:
        checkpoints.wait()
    else:
        checkpoints.save(step, run.model, run.optimizer)
    for saved in (before, step):
        if saved is not None and saved != checkpoints.pending:
            progress.note(f"saved checkpoint {saved} in {run.workdir / 'checkpoints'}")


def sample_text(model, config: ConfigDict, prompt: str | None = None, length: int | None = None):
    """A sample of a byte-level language model after ``prompt`` (the config's by default)."""
    prompt = config.text.sample_prompt if prompt is None else prompt
    length = config.text.sample_length if length is None else length
    tokens = np.frombuffer(prompt.encode(), np.uint8).astype(np.int32)
    out = model.generate(
        jnp.asarray(tokens)[None], length, jax.random.PRNGKey(config.seed), temperature=0.8
    )
    return bytes(np.asarray(out[0]).astype(np.uint8).tolist()).decode("utf-8", "replace")
