"""A run's workdir and its orbax checkpoints: ``prepare_workdir`` checks a workdir
against the config (and empties it on ``resume=false``), ``restore_latest`` falls
back past unreadable checkpoints, ``Checkpointer`` saves and turns a failed save into
one line (holding back orbax's logged tracebacks), and ``load`` gives back a trained
model and its config.
"""

from __future__ import annotations

import json
import logging as logging_std
import os
import re
import shutil
from pathlib import Path

import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from ml_collections import ConfigDict

from experiments.tasks import TASKS
from experiments.validation import config_changes

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


# -- orbax's logs of a failed save ----------------------------------------------


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


# -- the workdir ----------------------------------------------------------------


def _has_checkpoints(workdir: Path) -> bool:
    folder = workdir / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def prepare_workdir(config: ConfigDict, workdir: Path) -> None:
    """Checks ``workdir`` against ``config`` and writes ``config.json`` there.

    A workdir with checkpoints of a different model, task or data is refused
    (``validation.RESUMABLE`` lists the fields that may change); ``resume=false``
    empties it.

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


# -- checkpoints ----------------------------------------------------------------


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


class Checkpointer:
    """Saves through orbax; the first save is waited for, so a full disk or an
    unwritable folder stops the run there, with one line."""

    def __init__(self, manager: ocp.CheckpointManager):
        self.manager, self.saved = manager, False

    def _fail(self, step: int, error: Exception):
        return OSError(
            f"could not write checkpoint step {step} to {self.manager.directory}: {_reason(error)}"
        )

    def save(self, step: int, model, optimizer) -> None:
        """Saves the model and optimizer state as checkpoint ``step``.

        Raises:
          OSError: the save failed (in one line).
        """
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
        """Waits for the saves in flight.

        Raises:
          OSError: one failed (in one line, naming ``step``).
        """
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._fail(step, e) from None


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
    from experiments.trainer import build_model, build_optimizer  # the trainer imports us

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
