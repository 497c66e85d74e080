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

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from ml_collections import ConfigDict

from experiments import checkpoints, data, reporting, trainer
from experiments.configuration import flatten
from experiments.linearize import export, report, stages, student
from linattn_jax import hf
from linattn_jax.models import LanguageModel
from linattn_jax.models.options import thaw

STAGES = ("transfer", "finetune", "scratch")
# Fields a rerun may change without starting over.
FREE_FIELDS = ("progress", "resume")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The token ids of the corpus's two splits and how they were made."""

    train: np.ndarray
    val: np.ndarray
    source: str


def corpus(config: ConfigDict, vocab_size: int) -> Corpus:
    """The text corpus (``teacher.text``) as token ids: tokenised by ``teacher_dir``'s
    ``tokenizer.json`` where there is one, else its bytes.

    Raises:
      ValueError: bytes as ids for a vocabulary of fewer than 256, or ids beyond it.
    """
    train, val = data.stdlib_text(config.teacher.text.num_files, config.teacher.text.val_fraction)
    tokenizer = Path(config.teacher_dir or ".", "tokenizer.json")
    if config.teacher_dir and tokenizer.is_file():
        encode = hf.load_tokenizer(config.teacher_dir).encode
        ids = lambda b: np.asarray(encode(bytes(b).decode("utf-8", "replace")).ids, np.int32)
        train, val, source = ids(train), ids(val), f"tokenised by {tokenizer}"
    else:
        source = "bytes as token ids"
    if int(max(train.max(), val.max())) >= vocab_size:
        raise ValueError(
            f"the corpus ({source}) has ids up to {int(max(train.max(), val.max()))}, the "
            f"teacher's vocabulary {vocab_size}: give teacher_dir a tokenizer.json"
        )
    return Corpus(train.astype(np.int32), val.astype(np.int32), source)


def check_config(config: ConfigDict) -> None:
    """Raises ``ValueError`` naming a field that cannot run."""
    if config.student.kind not in student.STUDENT_KINDS:
        raise ValueError(
            f"student.kind must be one of {tuple(student.STUDENT_KINDS)}, got "
            f"{config.student.kind!r}"
        )
    counts = {
        "transfer.steps": config.transfer.steps, "finetune.steps": config.finetune.steps,
        "finetune.lora_rank": config.finetune.lora_rank, "student.window": config.student.window,
        "student.conv_size": config.student.conv_size, "eval_batches": config.eval_batches - 1,
        "batch_size": config.batch_size - 1, "seq_len": config.seq_len - 2,
        "recall.length": config.recall.length - 2, "recall.batches": config.recall.batches,
        "log_every": config.log_every - 1, "eval_every": config.eval_every - 1,
        "checkpoint_every": config.checkpoint_every - 1,
    }  # fmt: skip
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} is too small, got {flatten(config)[name]}")
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


def batch(corpus_: Corpus, config: ConfigDict, step: int) -> data.Batch:
    """Training batch ``step`` of the student's stages (stage 2 continues stage 1's steps,
    the scratch baseline reads the same ones)."""
    return data.text_batch(
        corpus_.train, config.seed, step, config.batch_size, config.seq_len, "train"
    )


def held_out(model, corpus_: Corpus, config: ConfigDict) -> dict:
    """Mean held-out cross-entropy (nats per token), perplexity and accuracy."""
    loss = accuracy = 0.0
    for i in range(config.eval_batches):
        b = data.text_batch(corpus_.val, config.seed, i, config.batch_size, config.seq_len, "eval")
        values = stages.eval_loss(model, b.inputs, b.labels)
        loss, accuracy = loss + float(values[0]), accuracy + float(values[1])
    loss, accuracy = loss / config.eval_batches, accuracy / config.eval_batches
    return {"loss": loss, "perplexity": float(np.exp(loss)), "accuracy": accuracy}


def copy_accuracy(model, corpus_: Corpus, config: ConfigDict) -> float:
    """The recall probe: held-out windows of ``recall.length`` tokens each followed by
    themselves; the accuracy of predicting the copy's tokens from the copy so far (its
    first token aside)."""
    n, hits = config.recall.length, []
    for i in range(config.recall.batches):
        b = data.text_batch(corpus_.val, config.seed + 1, i, config.batch_size, n, "eval")
        tokens = jnp.concatenate([b.inputs, b.inputs], axis=1)
        logits = stages.logits(model, tokens[:, :-1])
        hits.append(np.asarray(jnp.argmax(logits[:, n:], -1) == tokens[:, n + 1 :]))
    return float(np.mean(hits))


def run_stage(
    name: str,
    config: ConfigDict,
    workdir: Path,
    model,
    optimizer,
    steps: int,
    step: Callable[[int], dict],
    evaluate: Callable[[], dict],
) -> None:
    """Steps ``1..steps`` of a stage in ``workdir/name``, resumed from its latest checkpoint:
    ``step(i)`` runs step ``i`` (its metrics), ``evaluate()`` the held-out metrics logged
    every ``eval_every`` steps and at the end."""
    folder = workdir / name
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
                metrics = step(i)
                progress.step()
                done = i + 1
                if done % config.log_every == 0 or done == steps:
                    now = time.perf_counter()
                    row = {"step": done, "split": "train", "tokens": done * tokens}
                    row |= _floats(metrics) | {"tokens_per_s": tokens / max(now - last, 1e-9)}
                    last = now
                    log.write(row)
                    progress.row({"learning_rate": float(metrics["learning_rate"])} | row)
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


def linearize(config: ConfigDict, workdir: str | Path, *, verbose: bool = False) -> dict:
    """Runs (or resumes) the whole linearisation in ``workdir``; returns ``results.json``'s
    contents.

    Raises:
      ValueError: a config that cannot run, a workdir of another config, a teacher the
        student cannot be made from, or an export that does not read back the same.
      OSError: the workdir cannot be written.
    """
    check_config(config)
    workdir = Path(workdir).absolute()
    prepare(config, workdir)
    teacher, teacher_tokens = load_teacher(config, workdir, verbose)
    corpus_ = corpus(config, teacher.vocab_size)
    s = config.student
    candidates = student.swapped_layers(teacher, "" if s.keep_softmax.startswith("ranked") else
                                        s.keep_softmax)  # fmt: skip
    first, new = student.make_student(
        teacher, candidates, s.kind, window=s.window, conv_size=s.conv_size, seed=config.seed
    )
    results = {"teacher": held_out(teacher, corpus_, config) | {"tokens": teacher_tokens}}
    n1, n2 = config.transfer.steps, config.finetune.steps
    tokens = config.batch_size * config.seq_len

    # Stage 1: attention transfer, the new parameters only.
    opt_config = optimizer_config(n1, config.transfer)
    schedule = trainer.learning_rate(opt_config)
    optimizer = nnx.Optimizer(first, trainer.build_optimizer(opt_config), wrt=new)
    eval_batch = data.text_batch(corpus_.val, config.seed, 0, config.batch_size, config.seq_len,
                                 "eval")  # fmt: skip

    def transfer_eval() -> dict:
        losses = stages.transfer_eval(teacher, first, eval_batch.inputs, candidates)
        return {"loss": float(np.mean(losses))} | _floats({"mse": losses})

    def transfer_step(i: int) -> dict:
        inputs = batch(corpus_, config, i).inputs
        ce = float(config.transfer.ce_weight)
        m = stages.transfer_step(teacher, first, optimizer, inputs, candidates, new, ce)
        return m | {"learning_rate": schedule(i)}

    run_stage("transfer", config, workdir, first, optimizer, n1, transfer_step, transfer_eval)
    layer_losses = dict(zip(candidates, map(float, stages.transfer_eval(
        teacher, first, eval_batch.inputs, candidates)), strict=True))  # fmt: skip
    swapped = student.swapped_layers(teacher, s.keep_softmax, layer_losses)
    model, new = student.make_student(
        teacher, swapped, s.kind, window=s.window, conv_size=s.conv_size, seed=config.seed
    )
    trained = dict(nnx.to_flat_state(nnx.state(first)))
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        if path in new.paths:
            variable.set_value(trained[path].get_value())
    results["transfer"] = held_out(model, corpus_, config) | {
        "tokens": n1 * tokens, "layer_losses": {str(i): v for i, v in layer_losses.items()},
        "candidates": list(candidates), "swapped": list(swapped),
    }  # fmt: skip

    # Stage 2: LoRA on the swapped layers' q/k/v/o and the new parameters (or everything).
    rank = config.finetune.lora_rank
    if rank:
        stages.add_lora(model, swapped, rank, config.seed)
        wrt = nnx.Any(nnx.LoRAParam, new)
    else:
        wrt = nnx.Param
    opt_config = optimizer_config(n2, config.finetune)
    schedule = trainer.learning_rate(opt_config)
    optimizer = nnx.Optimizer(model, trainer.build_optimizer(opt_config), wrt=wrt)

    def finetune_step(i: int) -> dict:
        b = batch(corpus_, config, n1 + i)
        kl = float(config.finetune.kl_weight)
        m = stages.finetune_step(teacher, model, optimizer, b.inputs, b.labels, wrt, kl)
        return m | {"learning_rate": schedule(i)}

    run_stage("finetune", config, workdir, model, optimizer, n2, finetune_step,
              lambda: held_out(model, corpus_, config))  # fmt: skip
    if rank:
        stages.merge_lora(model, swapped)
    results["finetune"] = held_out(model, corpus_, config) | {"tokens": n2 * tokens}

    # The scratch baseline: the student's architecture, random, on the stages' batches.
    scratch = LanguageModel(**thaw(model.options), rngs=nnx.Rngs(config.seed + 1))
    opt_config = optimizer_config(n1 + n2, config.scratch)
    schedule = trainer.learning_rate(opt_config)
    optimizer = nnx.Optimizer(scratch, trainer.build_optimizer(opt_config), wrt=nnx.Param)

    def scratch_step(i: int) -> dict:
        b = batch(corpus_, config, i)
        m = trainer.train_step(scratch, optimizer, b.inputs, b.labels, b.key_mask, "lm")
        return m | {"learning_rate": schedule(i)}

    run_stage("scratch", config, workdir, scratch, optimizer, n1 + n2, scratch_step,
              lambda: held_out(scratch, corpus_, config))  # fmt: skip
    results["scratch"] = held_out(scratch, corpus_, config) | {"tokens": (n1 + n2) * tokens}

    for name, m in (("teacher", teacher), ("finetune", model), ("scratch", scratch)):
        results[name]["copy_accuracy"] = copy_accuracy(m, corpus_, config)
    results["student_dir"] = str(workdir / "student")
    results["export"] = _export(model, workdir / "student", eval_batch.inputs)
    results |= {"corpus": corpus_.source, "kind": s.kind, "layout": list(model.layout)}
    results["stages"] = list(STAGES)
    report.write(workdir, results)
    return results


def _export(model: LanguageModel, path: Path, tokens) -> str:
    """Saves the student and reads it back; raises unless its logits are the same, bit
    for bit."""
    export.save_student(model, path)
    back = export.load_student(path)
    if not np.array_equal(np.asarray(stages.logits(back, tokens)),
                          np.asarray(stages.logits(model, tokens))):  # fmt: skip
        raise ValueError(f"the student saved to {path} reads back with other logits")
    return "library checkpoint (linattn_jax.json + model.safetensors), read back bit-identical"
