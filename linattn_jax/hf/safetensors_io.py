"""Hugging Face's safetensors files, one tensor at a time: a reader over ``model.safetensors``
or a sharded ``model.safetensors.index.json``, and a writer that shards by size.

Neither side ever holds more than one tensor (the reader) or one shard (the writer) beyond
what the caller keeps, so loading a model costs about one copy of its weights.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Checkpoint(contextlib.AbstractContextManager):
    """The tensors of a Hugging Face directory, read lazily (a context manager).

    Args:
      path: a directory holding ``model.safetensors`` or ``model.safetensors.index.json``
        (whose ``weight_map`` names each tensor's file).

    Raises:
      ValueError: neither file, an index without a ``weight_map``, or a file it names that
        is missing.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map (tensor name -> file)")
            self.files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        elif os.path.exists(os.path.join(path, SINGLE)):
            self.files = None
            single = os.path.join(path, SINGLE)
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

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, framework="numpy"))
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
        with safe_open(self.files[name], framework="numpy") as f:
            return f.get_tensor(name)

    def __exit__(self, *exc):
        self._stack.close()
        self._open.clear()
        return None


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
    (``transformers``' names); a tensor larger than a shard gets a shard of its own.
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
    stale = os.path.join(path, INDEX)
    if len(files) > 1:
        pairs = zip(files, shards, strict=True)
        weight_map = {name: file for file, names in pairs for name in names}
        index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
        with open(stale, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    elif os.path.exists(stale):
        os.remove(stale)  # a single file now: an old index would shadow it
    return files
