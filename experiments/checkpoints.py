"""A run's workdir and its orbax checkpoints: ``prepare_workdir`` checks a workdir
against the config (and empties it on ``resume=false``), ``restore_latest`` falls
back past unreadable checkpoints, ``Checkpointer`` saves and turns a failed save into
one line naming the step, the workdir and its free space (``write_error``), and
``load`` gives back a trained model and its config. Unless ``verbose``, orbax's own
reports of a failed save or restore (a traceback per writer thread) are held back:
the one line says what happened.
"""

from __future__ import annotations

import contextlib
import json
import logging as logging_std
import os
import re
import shutil
import sys
from pathlib import Path

import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from ml_collections import ConfigDict

from experiments.builders import build_model, build_optimizer
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


# -- one-line failures, and orbax's logs of them -------------------------------


class WriteError(OSError):
    """A write to the workdir failed; its message is the one line to report."""


def _size(n: float) -> str:
    """``3145728`` -> ``"3.0 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def free_space(path: Path) -> str:
    """The free space on the disk of ``path`` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        return _size(shutil.disk_usage(path).free)
    except OSError:
        return "an unknown amount of space"


def write_error(what: str, workdir: Path, error: BaseException, hint: str = "") -> WriteError:
    """``could not write <what>: <reason> (<free> free on the disk of <workdir>)[; <hint>]``."""
    return WriteError(
        f"could not write {what}: {_reason(error)} ({free_space(workdir)} free on the disk "
        f"of {workdir})" + (f"; {hint}" if hint else "")
    )


def _from_orbax(record: logging_std.LogRecord) -> bool:
    return f"{os.sep}orbax{os.sep}" in record.pathname


class _HoldOrbaxLogs(logging_std.Filter):
    """Holds orbax's records on the absl logger (a failed save or restore logs a
    traceback from each of its threads, which the trainer reports in one line); the
    trainer's own records pass. Holders nest: the newest holds, and ``release`` hands
    its records to the one below it (or, outermost, emits them); ``drop`` discards them
    and stops holding."""

    stack: list[_HoldOrbaxLogs] = []  # the holders installed, oldest first
    releasing = False  # while the outermost emits: every holder lets records through

    def __init__(self):
        super().__init__()
        self.logger, self.records = logging_std.getLogger("absl"), []
        self.stack.append(self)
        self.logger.addFilter(self)

    def filter(self, record) -> bool:
        if _HoldOrbaxLogs.releasing or not _from_orbax(record) or self.stack[-1] is not self:
            return True
        self.records.append(record)
        return False

    def release(self) -> None:
        """Lets out the records held so far (and keeps holding)."""
        records, self.records = self.records, []
        index = self.stack.index(self) if self in self.stack else 0
        if index:
            self.stack[index - 1].records.extend(records)
            return
        _HoldOrbaxLogs.releasing = True
        try:
            for record in records:
                self.logger.handle(record)
        finally:
            _HoldOrbaxLogs.releasing = False

    def drop(self) -> None:
        """Discards the records held and stops holding."""
        self.records = []
        self.logger.removeFilter(self)
        if self in self.stack:
            self.stack.remove(self)


@contextlib.contextmanager
def orbax_logs_held(verbose: bool = False):
    """Holds orbax's logs inside the block: let out when it ends, dropped when it raises
    (the error says what failed). ``verbose``: holds nothing."""
    if verbose:
        yield
        return
    hush_closed_event_loops()
    held = _HoldOrbaxLogs()
    try:
        yield
    except BaseException:
        held.drop()
        raise
    held.release()
    held.drop()


class _DropMentions(logging_std.Filter):
    """Drops the records that mention ``text`` (a failed save's folder: its writer
    threads keep logging tracebacks after the trainer reported it in one line)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def _closed_loop(unraisable) -> bool:
    return isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
        unraisable.exc_value
    )


def hush_closed_event_loops() -> None:
    """Stops ``sys.unraisablehook`` printing ``RuntimeError: Event loop is closed``: after
    a failed save or restore, tensorstore's pending writes call back into the event loop
    that orbax has closed, one traceback each. Other unraisable errors print as before;
    installed once per process."""
    if getattr(sys.unraisablehook, "hushes_closed_event_loops", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _closed_loop(unraisable):
            previous(unraisable)

    hook.hushes_closed_event_loops = True
    sys.unraisablehook = hook


# -- the workdir ----------------------------------------------------------------


def _has_checkpoints(workdir: Path) -> bool:
    folder = workdir / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def prepare_workdir(config: ConfigDict, workdir: Path, *, write: bool = True) -> None:
    """Checks ``workdir`` against ``config`` and writes ``config.json`` there.

    A workdir with checkpoints of a different model, task or data is refused
    (``validation.RESUMABLE`` lists the fields that may change); ``resume=false``
    empties it. ``write=False`` only checks (the processes of a run but its first).

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
    if not write:
        return
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
    manager: ocp.CheckpointManager,
    target: dict,
    workdir: Path,
    move_unreadable: bool = True,
    *,
    verbose: bool = False,
) -> tuple[int, dict | None]:
    """Restores the newest readable checkpoint. Newer unreadable ones (a file
    truncated by a kill) are skipped with a warning and, with ``move_unreadable``,
    moved to ``workdir/checkpoints_unreadable``. Orbax's own logs of an unreadable
    one are dropped unless ``verbose`` (the warning, or the error, says it).

    Returns:
      (its step, the restored state), or (0, None) when there is no checkpoint.

    Raises:
      ValueError: there are checkpoints but none is readable (nothing is moved).
    """
    steps = sorted(manager.all_steps(), reverse=True)
    unreadable = []
    for step in steps:
        try:
            with orbax_logs_held(verbose):
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
    """Saves through orbax, in the background, and turns a failed save into one line.

    The first save is waited for, so that an unwritable folder or a disk already full
    stops the run there; each later save first waits for the one before, so a disk
    that fills later stops the run at the next save (or at ``wait``), naming the step
    whose save failed, the workdir and the free space left on its disk. Unless
    ``verbose``, orbax's logs (a traceback per writer thread of a failed save) are held
    while a save is in flight: let out once it succeeded, dropped once it failed.

    Args:
      manager: the orbax manager of ``workdir/checkpoints``.
      workdir: the run's folder (named in the errors).
      verbose: let orbax's logs and tracebacks through (and chain the error to its cause).
    """

    def __init__(self, manager: ocp.CheckpointManager, workdir: Path, *, verbose: bool = False):
        self.manager, self.workdir, self.verbose = manager, Path(workdir), verbose
        self.pending: int | None = None  # the step of the save in flight
        self.saved = self.closed = False
        self.held = None if verbose else _HoldOrbaxLogs()
        if not verbose:
            hush_closed_event_loops()

    def _kept(self, failed: int) -> str:
        folder = Path(self.manager.directory)
        steps = (
            [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
        )
        steps = [s for s in steps if s != failed]
        if not steps:
            return "no checkpoint was kept (free some space, then rerun)"
        return (
            f"the last checkpoint kept is step {max(steps)} (free some space, then rerun to "
            f"resume from it)"
        )

    def _fail(self, step: int, error: Exception):
        """Waits out the failed save's threads and drops their logs; raises the one line
        (chained to orbax's error when ``verbose``)."""
        self.pending = None
        self.abandon()
        # Its writer threads may log after this: about its folder, never again.
        logging_std.getLogger("absl").addFilter(_DropMentions(str(self.manager.directory)))
        what = f"checkpoint step {step} to {self.manager.directory}"
        failure = write_error(what, self.workdir, error, self._kept(step))
        raise failure from (error if self.verbose else None)

    def _wait_for_pending(self) -> None:
        if self.pending is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._fail(self.pending, e)
        self.pending = None
        if self.held is not None:
            self.held.release()

    def save(self, step: int, model, optimizer) -> None:
        """Saves the model and optimizer state as checkpoint ``step`` (the first save
        waited for, the others in the background).

        Raises:
          WriteError: this save, or the one before it, failed (in one line).
        """
        self._wait_for_pending()
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        try:
            self.manager.save(step, args=ocp.args.StandardSave(state))
        except Exception as e:
            self._fail(step, e)
        self.pending = step
        if not self.saved:
            self._wait_for_pending()
        self.saved = True

    def wait(self) -> None:
        """Waits for the save in flight.

        Raises:
          WriteError: it failed (in one line, naming its step).
        """
        self._wait_for_pending()

    def abandon(self) -> None:
        """Waits out the saves in flight (each of a failed save's threads fails in turn)
        and closes the manager, ignoring their errors; drops the logs held. For a run
        that stops on an error: a failing save must not replace that error."""
        if self.closed:
            return
        self.closed = True
        for _ in range(100):
            try:
                self.manager.wait_until_finished()
                self.manager.close()
                break
            except Exception:
                continue
        if self.held is not None:
            self.held.drop()

    def close(self) -> None:
        """Waits for the save in flight (raising as ``wait``), closes the manager and lets
        out the logs held."""
        self._wait_for_pending()
        self.manager.close()
        self.closed = True
        if self.held is not None:
            self.held.release()
            self.held.drop()


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
