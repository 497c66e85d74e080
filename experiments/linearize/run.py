"""The whole linearisation, resumable stage by stage: the teacher (a Hugging Face directory,
or a small softmax model trained here first), stage 1 (attention transfer), stage 2
(fine-tuning), the scratch baseline, the evaluations, the export and the report.

A workdir holds ``config.json``, ``teacher/`` (a trained teacher's ``train`` workdir),
``transfer/``, ``finetune/`` and ``scratch/`` (each with ``checkpoints/``,
``metrics.jsonl`` and TensorBoard events: a rerun resumes each stage from its latest
checkpoint and skips a finished one), ``student/`` (the export) and the report,
``results.md``, ``results.json`` and ``results.png``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from ml_collections import ConfigDict

from experiments import checkpoints, data, reporting, trainer
from experiments.configuration import flatten
from experiments.linearize import evaluation, export, report, stages, student
from linattn_jax import hf, sharding
from linattn_jax.models import LanguageModel
from linattn_jax.models.options import thaw

STAGES = ("transfer", "finetune", "scratch")
# Fields a rerun may change without starting over.
FREE_FIELDS = ("progress", "resume")


def check_config(config: ConfigDict) -> None:
    """Raises ``ValueError`` naming a field that cannot run."""
    if config.student.kind not in student.STUDENT_KINDS:
        raise ValueError(
            f"student.kind must be one of {tuple(student.STUDENT_KINDS)}, got "
            f"{config.student.kind!r}"
        )
    minimum = {
        "transfer.steps": 0, "finetune.steps": 0, "finetune.lora_rank": 0, "student.window": 0,
        "student.conv_size": 0, "eval_batches": 1, "batch_size": 1, "seq_len": 4,
        "copy_batches": 1, "log_every": 1, "eval_every": 1, "checkpoint_every": 1,
    }  # fmt: skip
    fields = flatten(config)
    for name, low in minimum.items():
        value = fields[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if config.teacher.mesh.sequence != 1:
        raise ValueError(
            f"teacher.mesh.sequence must be 1 (the stages split batches and parameters, not "
            f"sequences), got {config.teacher.mesh.sequence}"
        )
    if config.transfer.ce_weight and config.student.kind == "gated_deltanet":
        raise ValueError("transfer.ce_weight needs a linearised softmax, not gated_deltanet")


def prepare(config: ConfigDict, workdir: Path) -> None:
    """Writes ``config.json``; a workdir of another config is refused unless
    ``resume=false``, which empties it."""
    stored = workdir / "config.json"
    if not config.resume and workdir.is_dir():
        for name in (*STAGES, "teacher", "student", "config.json"):
            path = workdir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    if stored.is_file():
        old = {k: v for k, v in flatten(json.loads(stored.read_text())).items()}
        new = flatten(config.to_dict())
        changed = [
            f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
            for k in sorted(set(old) | set(new))
            if k not in FREE_FIELDS and old.get(k) != new.get(k)
        ]
        if changed:
            raise ValueError(
                f"{workdir} holds a run of another config ({'; '.join(changed)}): rerun with "
                "that config, --config.resume=false to start over, or a new --workdir"
            )
    workdir.mkdir(parents=True, exist_ok=True)
    stored.write_text(config.to_json(indent=2))


def load_teacher(config: ConfigDict, workdir: Path, verbose: bool) -> tuple[LanguageModel, int]:
    """The teacher and the tokens it was trained on (0: unknown, a Hugging Face one)."""
    if config.teacher_dir:
        return hf.from_pretrained(config.teacher_dir, "float32", param_dtype="float32")[0], 0
    t = config.teacher
    trainer.train(t, workdir / "teacher", verbose=verbose)
    return checkpoints.load(workdir / "teacher")[0], t.steps * t.batch_size * t.seq_len


def optimizer_config(steps: int, section: ConfigDict) -> ConfigDict:
    """What ``trainer.build_optimizer`` reads, for a stage: AdamW on a warmup-cosine schedule
    (no weight decay: most trained parameters start at their teacher's values)."""
    optim = dict(lr=section.lr, warmup_steps=section.warmup_steps, weight_decay=0.0)
    return ConfigDict({"steps": steps, "optim": dict(optim, grad_clip=1.0, b1=0.9, b2=0.98)})


@dataclasses.dataclass(frozen=True)
class Job:
    """What every stage reads: the config, the workdir, the teacher, the corpus and the
    batch the transfer loss is evaluated on."""

    config: ConfigDict
    workdir: Path
    teacher: LanguageModel
    corpus: evaluation.Corpus
    eval_inputs: jax.Array
    sharder: trainer.Sharder

    def student(self, swapped: tuple[int, ...]) -> tuple[LanguageModel, student.NewParams]:
        """The student of the layers ``swapped``, placed on the mesh."""
        s = self.config.student
        model, new = student.make_student(
            self.teacher, swapped, s.kind, window=s.window, conv_size=s.conv_size,
            seed=self.config.seed,
        )  # fmt: skip
        return self.sharder.place(model)[0], new

    def held_out(self, model) -> dict:
        return evaluation.held_out(model, self.corpus, self.config)

    def batch(self, step: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Training batch ``step``'s inputs, labels and mask, split over the mesh's batch
        axes."""
        return self.sharder.put_batch(evaluation.batch(self.corpus, self.config, step))


def run_stage(
    job: Job,
    name: str,
    model,
    wrt,
    steps: int,
    section: ConfigDict,
    step: Callable[[nnx.Optimizer, int], dict],
    evaluate: Callable[[], dict],
) -> None:
    """Steps ``1..steps`` of a stage in ``workdir/name`` (AdamW on ``section``'s ``lr`` and
    ``warmup_steps``, over the parameters ``wrt`` selects), resumed from its latest
    checkpoint: ``step(optimizer, i)`` runs step ``i`` and returns its metrics,
    ``evaluate()`` the held-out ones logged at the start, every ``eval_every`` steps and at
    the end."""
    config, folder = job.config, job.workdir / name
    optim = optimizer_config(steps, section)
    schedule = trainer.learning_rate(optim)
    optimizer = nnx.Optimizer(model, trainer.build_optimizer(optim), wrt=wrt)
    manager = ocp.CheckpointManager(
        (folder / "checkpoints").absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True),
    )
    target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    start, restored = checkpoints.restore_latest(manager, target, folder)
    if restored is not None:
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["optimizer"])
    saver = checkpoints.Checkpointer(manager, folder)
    tokens = config.batch_size * config.seq_len
    progress = reporting.Progress(start, steps, f"linearize/{name}", config.progress)
    if start:
        progress.note(f"{name}: resuming from step {start} of {folder}")
    try:
        with reporting.MetricsLog(folder, start) as log:
            if not start:  # where the stage starts from
                log.write({"step": 0, "split": "eval", "tokens": 0} | evaluate())
            last = time.perf_counter()
            for i in range(start, steps):
                metrics = _floats(step(optimizer, i)) | {"learning_rate": float(schedule(i))}
                progress.step()
                done = i + 1
                if done % config.log_every == 0 or done == steps:
                    now = time.perf_counter()
                    rate = tokens * config.log_every / max(now - last, 1e-9)
                    row = {"step": done, "split": "train", "tokens": done * tokens}
                    row |= metrics | {"tokens_per_s": rate}
                    last = now
                    log.write(row)
                    progress.row(row)
                if done % config.eval_every == 0 or done == steps:
                    log.write({"step": done, "split": "eval", "tokens": done * tokens} | evaluate())
                if done % config.checkpoint_every == 0 or done == steps:
                    saver.save(done, model, optimizer)
        saver.close()
    except BaseException:
        saver.abandon()
        raise
    finally:
        progress.close()


def _floats(metrics: dict) -> dict:
    """Scalars as floats, a per-layer ``[n]`` array as ``name@i`` entries."""
    out = {}
    for key, value in metrics.items():
        value = np.asarray(value)
        if value.ndim:
            out |= {f"{key}@{i}": float(v) for i, v in enumerate(value)}
        else:
            out[key] = float(value)
    return out


def transfer(job: Job) -> tuple[LanguageModel, student.NewParams, dict]:
    """Stage 1 on the layers ``keep_softmax`` leaves (all softmax layers when it ranks),
    then the student of the layers it keeps swapped, holding what they learnt; and stage
    1's results (``layer_losses``: each candidate's final transfer loss)."""
    config, s = job.config, job.config.student
    ranked = s.keep_softmax.strip().startswith("ranked")
    candidates = student.swapped_layers(job.teacher, "" if ranked else s.keep_softmax)
    first, new = job.student(candidates)
    ce = float(config.transfer.ce_weight)

    def step(optimizer, i: int) -> dict:
        inputs = job.batch(i)[0]
        return stages.transfer_step(job.teacher, first, optimizer, inputs, candidates, new, ce)

    def losses() -> np.ndarray:
        return np.asarray(stages.transfer_eval(job.teacher, first, job.eval_inputs, candidates))

    evaluate = lambda: {"loss": float(np.mean(losses()))} | _floats({"mse": losses()})
    run_stage(job, "transfer", first, new, config.transfer.steps, config.transfer, step, evaluate)
    layer_losses = dict(zip(candidates, map(float, losses()), strict=True))
    swapped = student.swapped_layers(job.teacher, s.keep_softmax, layer_losses)
    model, new = job.student(swapped)
    trained = dict(nnx.to_flat_state(nnx.state(first)))
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        if path in new.paths:
            variable.set_value(trained[path].get_value())
    tokens = config.transfer.steps * config.batch_size * config.seq_len
    results = job.held_out(model) | {
        "tokens": tokens, "layer_losses": {str(i): v for i, v in layer_losses.items()},
        "candidates": list(candidates), "swapped": list(swapped),
    }  # fmt: skip
    return model, new, results


def finetune(job: Job, model: LanguageModel, new: student.NewParams, swapped) -> dict:
    """Stage 2 on ``model`` (in place): LoRA on the swapped layers' q/k/v/o and the new
    parameters, merged after (``lora_rank`` 0: every parameter); its results."""
    config = job.config
    rank, kl = config.finetune.lora_rank, float(config.finetune.kl_weight)
    wrt = nnx.Param
    if rank:
        stages.add_lora(model, swapped, rank, config.seed)
        job.sharder.place(model)  # the adapters too
        wrt = nnx.Any(nnx.LoRAParam, new)
    first = config.transfer.steps  # stage 2 reads the batches after stage 1's

    def step(optimizer, i: int) -> dict:
        inputs, labels, _ = job.batch(first + i)
        return stages.finetune_step(job.teacher, model, optimizer, inputs, labels, wrt, kl)

    def evaluate() -> dict:  # on a merged copy: the model the stage ends with, compiled once
        merged = nnx.clone(model)
        stages.merge_lora(merged, swapped)
        return job.held_out(merged)

    steps = config.finetune.steps
    run_stage(job, "finetune", model, wrt, steps, config.finetune, step, evaluate)
    if rank:
        stages.merge_lora(model, swapped)
    return job.held_out(model) | {"tokens": steps * config.batch_size * config.seq_len}


def from_scratch(job: Job, model: LanguageModel) -> tuple[LanguageModel, dict]:
    """The scratch baseline: ``model``'s architecture from a random start, trained on the
    batches both stages read; the model and its results."""
    config = job.config
    scratch = LanguageModel(**thaw(model.options), rngs=nnx.Rngs(config.seed + 1))
    job.sharder.place(scratch)

    def step(optimizer, i: int) -> dict:
        return trainer.train_step(scratch, optimizer, *job.batch(i), "lm")

    steps = config.transfer.steps + config.finetune.steps
    run_stage(job, "scratch", scratch, nnx.Param, steps, config.scratch, step,
              lambda: job.held_out(scratch))  # fmt: skip
    return scratch, job.held_out(scratch) | {"tokens": steps * config.batch_size * config.seq_len}


def linearize(config: ConfigDict, workdir: str | Path, *, verbose: bool = False) -> dict:
    """Runs (or resumes) the whole linearisation in ``workdir``; returns ``results.json``'s
    contents. The stages run on the mesh of ``teacher.mesh`` (``trainer.Sharder``: batches
    split over ``data`` and ``fsdp``, parameters and optimiser state over ``fsdp`` and
    ``tensor``), as a trained teacher does.

    Raises:
      ValueError: a config that cannot run, a workdir of another config, a teacher the
        student cannot be made from, or an export that does not read back the same.
      OSError: the workdir cannot be written.
    """
    check_config(config)
    workdir = Path(workdir).absolute()
    prepare(config, workdir)
    teacher, teacher_tokens = load_teacher(config, workdir, verbose)
    sharder = trainer.Sharder.of(config.teacher)
    with jax.set_mesh(sharder.mesh), nnx.logical_axis_rules(sharding.RULES):
        sharder.place(teacher)
        return _linearize(config, workdir, teacher, teacher_tokens, sharder)


def _linearize(config, workdir: Path, teacher, teacher_tokens: int, sharder) -> dict:
    """``linearize``'s stages, evaluations, export and report, on the mesh."""
    corpus = evaluation.corpus(config, teacher.vocab_size)
    eval_inputs = data.text_batch(
        corpus.val, config.seed, 0, config.batch_size, config.seq_len, "eval"
    ).inputs
    job = Job(config, workdir, teacher, corpus, eval_inputs, sharder)
    results = {"teacher": job.held_out(teacher) | {"tokens": teacher_tokens}}
    model, new, results["transfer"] = transfer(job)
    results["finetune"] = finetune(job, model, new, tuple(results["transfer"]["swapped"]))
    scratch, results["scratch"] = from_scratch(job, model)
    for name, m in (("teacher", teacher), ("finetune", model), ("scratch", scratch)):
        results[name]["copy_accuracy"] = evaluation.copy_accuracy(m, corpus, config)
    results["student_dir"] = str(workdir / "student")
    results["export"] = _export(model, teacher, workdir / "student")
    results |= {"corpus": corpus.source, "kind": config.student.kind}
    results |= {"layout": list(model.layout), "stages": list(STAGES)}
    report.write(workdir, results)
    return results


def _export(model: LanguageModel, teacher: LanguageModel, path: Path) -> str:
    """Saves the student (``export.save_student``) and reads it back; raises unless it is
    the same model, every parameter bit for bit (so the same logits). Returns the format."""
    how = export.save_student(model, path, teacher)
    back = export.load_student(path)
    ours, theirs = (dict(nnx.to_flat_state(nnx.state(m))) for m in (model, back))
    same = back.layout == model.layout and ours.keys() == theirs.keys()
    if not same or not all(
        np.array_equal(ours[p].get_value(), theirs[p].get_value()) for p in ours
    ):
        raise ValueError(f"the student saved to {path} reads back as another model")
    return f"{how}, read back bit-identical"
