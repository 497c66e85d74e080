"""Hugging Face's safetensors files, one tensor at a time: a reader over ``model.safetensors``
or a sharded ``model.safetensors.index.json``, and a writer that shards by size.

Neither side ever holds more than one tensor (the reader) or one shard (the writer) beyond
what the caller keeps, so loading a model costs about one copy of its weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


class Checkpoint(contextlib.AbstractContextManager):
    """The tensors of a Hugging Face directory, read lazily (a context manager).

    Args:
      path: a directory holding ``model.safetensors`` or ``model.safetensors.index.json``
        (whose ``weight_map`` names each tensor's file); with both, ``model.safetensors``,
        as ``transformers`` reads it.

    Raises:
      ValueError: neither file, an index that is not JSON or has no ``weight_map`` (tensor
        name -> file name), a file it names that is missing, or a safetensors file whose
        header is unreadable or that is shorter than its header says (truncated): each
        naming the file. Every file's header is read here, no tensor's data.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
        if os.path.exists(single):
            self.files = None
        elif os.path.exists(index):
            try:
                with open(index) as f:
                    contents = json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{index} is not readable JSON: {e}") from None
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise ValueError(f"{index} has no weight_map (tensor name -> file name)")
            self.files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        else:
            raise ValueError(f"{path} holds neither {SINGLE} nor {INDEX}")
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}
        if self.files is None:
            names = self._handle(single).keys()
            self.files = dict.fromkeys(names, single)
        for file in sorted(set(self.files.values())):
            if not os.path.exists(file):
                raise ValueError(f"{INDEX} names {os.path.basename(file)}, missing from {path}")
            self._handle(file)  # its header checked now, before any tensor is read

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = self._stack.enter_context(_open(file))
        return self._open[file]

    def names(self) -> list[str]:
        """Every tensor's name, sorted."""
        return sorted(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, read from its file's header (no data)."""
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """One tensor, in its stored dtype (``ml_dtypes.bfloat16`` for bfloat16), copied out
        of the file.

        Each read maps the file anew and unmaps it after: pages of a mapping that stays
        open count in the process's resident memory, so reading every tensor through one
        long-lived mapping would end holding the whole file twice (mapped and copied).
        """
        with _open(self.files[name]) as f:
            try:
                return f.get_tensor(name)
            except Exception as e:  # safetensors' own error names no file
                raise ValueError(f"{self.files[name]}: tensor {name!r} unreadable: {e}") from None

    def __exit__(self, *exc):
        self._stack.close()
        self._open.clear()
        return None


@contextlib.contextmanager
def _open(file: str):
    """``safe_open`` with its errors (a truncated file, a bad header) as a ``ValueError``
    naming the file."""
    try:
        handle = safe_open(file, framework="numpy")
    except Exception as e:  # SafetensorError, OSError: neither names the file
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
    with handle as f:
        yield f


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"``, ``"500MB"``, ``"50KB"`` (powers of
    1000, as in ``transformers``' ``max_shard_size``)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    if isinstance(size, str):
        text = size.strip().upper()
        for unit, factor in units.items():
            if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
                value = int(float(text[: -len(unit)]) * factor)
                if value > 0:
                    return value
    raise ValueError(f"max_shard_size must be bytes > 0 or a size like '5GB', got {size!r}")


def write(
    path: str | os.PathLike,
    shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    make: Callable[[str], np.ndarray],
    max_shard_size: int | str | None = None,
) -> list[str]:
    """Writes the tensors named by ``shapes`` (name -> (shape, dtype)) to ``path``, calling
    ``make(name)`` for each when its shard is written; returns the files written.

    One ``model.safetensors`` when everything fits in ``max_shard_size`` (or it is None),
    else ``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json``
    (``transformers``' names); a tensor larger than a shard gets a shard of its own. Files
    of an earlier save in ``path`` that this one does not write (shards of another count, a
    single file or an index) are removed.
    """
    os.makedirs(path, exist_ok=True)
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    nbytes = {
        n: int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for n, (s, d) in shapes.items()
    }
    shards: list[list[str]] = [[]]
    size = 0
    for name in shapes:
        if limit is not None and shards[-1] and size + nbytes[name] > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    if len(shards) == 1:
        files = [SINGLE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, names in zip(files, shards, strict=True):
        tensors = {name: np.ascontiguousarray(make(name)) for name in names}
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        del tensors
    index_file, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
    for old in os.listdir(path):  # an earlier save's shards would be a second copy
        if SHARD.fullmatch(old) and old not in files:
            os.remove(os.path.join(path, old))
    if len(files) > 1:
        pairs = zip(files, shards, strict=True)
        weight_map = {name: file for file, names in pairs for name in names}
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        with open(index_file, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        if os.path.exists(single):
            os.remove(single)  # an old single file would shadow the shards (read first)
    elif os.path.exists(index_file):
        os.remove(index_file)  # a single file now: no index to mislead another reader
    return files
