"""Tasks whose data is generated or read locally: nothing is downloaded.

Every batch is a pure function of ``(seed, step)``, so a run resumed from a
checkpoint sees exactly the batches an uninterrupted run would have seen.

* ``mqar``: multi-query associative recall (Arora et al. 2023, "Zoology").
* ``listops``: nested MIN/MAX/MED/SUM_MOD expressions (Long Range Arena, Tay et al. 2021).
* ``text_lm``: byte-level language modelling on a fixed list of the Python standard
  library's own modules (see ``TEXT_FILES``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np

IGNORE = -1  # label of positions that carry no loss


@dataclasses.dataclass(frozen=True)
class Batch:
    """``inputs [b, t]`` int32, ``labels`` (``[b, t]`` for LMs, ``[b]`` for classifiers,
    ``IGNORE`` where there is no target) and ``key_mask [b, t]`` (True = real token)."""

    inputs: np.ndarray
    labels: np.ndarray
    key_mask: np.ndarray


def _rng(seed: int, step: int, split: str) -> np.random.Generator:
    return np.random.default_rng([seed, step, {"train": 0, "eval": 1}[split]])


# ----------------------------------------------------------------------------
# MQAR: [k1 v1 ... kN vN  q1 a1 ... qN aN], predict each a_i at q_i.
# ----------------------------------------------------------------------------


POWER_A = 0.01  # Zoology's power law of the distance from the context to a query


def mqar_batch(
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    num_pairs: int,
    vocab_size: int,
    split: str = "train",
    *,
    spread: bool = False,
) -> Batch:
    """Keys come from the first half of the vocabulary, values from the second;
    queries ask for every key once, in random order. Token 0 pads.

    With ``spread`` (Zoology's layout), the queries are not packed after the
    key-value pairs but scattered over the rest of the sequence, at distances from
    the context drawn from Zoology's power law (``p(gap) ~ gap^(POWER_A - 1)``,
    mostly near, some far), and every other position holds a random value token
    (noise that is never a key, so no query's answer is ever overwritten).
    """
    if 4 * num_pairs > seq_len:
        raise ValueError(
            f"seq_len={seq_len} is too short for num_pairs={num_pairs} "
            f"(MQAR needs 4 * num_pairs tokens)"
        )
    half = vocab_size // 2
    if num_pairs > half - 1:
        raise ValueError(f"vocab_size={vocab_size} has too few keys for num_pairs={num_pairs}")
    rng = _rng(seed, step, split)
    inputs = np.zeros((batch_size, seq_len), np.int32)
    labels = np.full((batch_size, seq_len), IGNORE, np.int32)
    slots = (seq_len - 2 * num_pairs) // 2  # query slots after the context (spread)
    gap_p = np.arange(1, slots + 1, dtype=np.float64) ** (POWER_A - 1)
    gap_p /= gap_p.sum()
    for row in range(batch_size):
        keys = rng.choice(np.arange(1, half), num_pairs, replace=False)
        values = rng.choice(np.arange(half, vocab_size), num_pairs, replace=True)
        order = rng.permutation(num_pairs)
        context = np.stack([keys, values], 1).reshape(-1)
        if spread:
            inputs[row] = rng.integers(half, vocab_size, seq_len)
            inputs[row, : 2 * num_pairs] = context
            gaps = rng.choice(slots, num_pairs, replace=False, p=gap_p)
            query_positions = 2 * num_pairs + 2 * gaps
            inputs[row, query_positions] = keys[order]
            inputs[row, query_positions + 1] = values[order]
        else:
            queries = np.stack([keys[order], values[order]], 1).reshape(-1)
            inputs[row, : 4 * num_pairs] = np.concatenate([context, queries])
            query_positions = 2 * num_pairs + 2 * np.arange(num_pairs)
        labels[row, query_positions] = values[order]
    return Batch(inputs, labels, np.ones_like(inputs, bool))


# ----------------------------------------------------------------------------
# ListOps: tokens 0 pad, 1-10 digits 0-9, 11-14 operators, 15 ']'.
# ----------------------------------------------------------------------------

LISTOPS_OPS = ("MIN", "MAX", "MED", "SUM_MOD")
LISTOPS_VOCAB = 16


def _listops_tree(rng, depth: int, max_depth: int, max_args: int):
    if depth >= max_depth or (depth > 0 and rng.random() < 0.3):
        digit = int(rng.integers(10))
        return [1 + digit], digit
    op = int(rng.integers(len(LISTOPS_OPS)))
    tokens, values = [11 + op], []
    for _ in range(int(rng.integers(2, max_args + 1))):
        sub_tokens, sub_value = _listops_tree(rng, depth + 1, max_depth, max_args)
        tokens += sub_tokens
        values.append(sub_value)
    tokens.append(15)
    ordered = sorted(values)  # MED is the lower median
    value = [ordered[0], ordered[-1], ordered[(len(ordered) - 1) // 2], sum(values) % 10][op]
    return tokens, value


def listops_value(tokens) -> int:
    """Evaluates a ListOps token sequence (pad 0 ignored): an independent checker."""
    stack: list[list[int]] = [[]]
    ops: list[int] = []
    for tok in (int(x) for x in tokens if x != 0):
        if 1 <= tok <= 10:
            stack[-1].append(tok - 1)
        elif 11 <= tok <= 14:
            ops.append(tok - 11)
            stack.append([])
        else:
            args, op = sorted(stack.pop()), ops.pop()
            med = args[(len(args) - 1) // 2]
            stack[-1].append([args[0], args[-1], med, sum(args) % 10][op])
    return stack[0][0]


def listops_batch(
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    max_depth: int = 6,
    max_args: int = 5,
    split: str = "train",
) -> Batch:
    """Expressions of at most ``seq_len`` tokens, labels their values 0-9."""
    rng = _rng(seed, step, split)
    inputs = np.zeros((batch_size, seq_len), np.int32)
    labels = np.zeros((batch_size,), np.int32)
    for row in range(batch_size):
        while True:
            tokens, value = _listops_tree(rng, 0, max_depth, max_args)
            if len(tokens) <= seq_len:
                break
        inputs[row, : len(tokens)] = tokens
        labels[row] = value
    return Batch(inputs, labels, inputs != 0)


# ----------------------------------------------------------------------------
# Byte-level text: a fixed list of hand-written standard-library modules, fixed split.
# ----------------------------------------------------------------------------

# (module, size in bytes, first 16 hex digits of the SHA-256) as shipped by CPython 3.11.7,
# the interpreter the README's text results used. The order is fixed: ``num_files=n`` takes the
# first n. Only hand-written modules that CPython 3.11, 3.12 and 3.13 all ship as top-level
# files (nothing generated at build time, such as ``_sysconfigdata_*``, whose content differs
# between installs). The first 16 are byte-identical in 3.11.2, 3.11.7, 3.12.1 and 3.13.0; the
# next 19 in 3.11.2, 3.11.7 and 3.12.1; the rest in 3.11.2 and 3.11.7.
TEXT_REFERENCE_PYTHON = "3.11.7"
TEXT_FILES: tuple[tuple[str, int, str], ...] = (
    ("heapq", 23024, "6d43277e5c76fc0f"),
    ("graphlib", 9656, "7bd338c5a475d110"),
    ("weakref", 21513, "56f8d313fb74019e"),
    ("_weakrefset", 5893, "91895a451d06e9f5"),
    ("tracemalloc", 18047, "c2cc84a05b824df7"),
    ("pyclbr", 11396, "e8ca09333701ba41"),
    ("_markupbase", 14653, "cb14dd6f2e2439eb"),
    ("_threading_local", 7220, "e1bf3dae66d0bfa6"),
    ("_py_abc", 6189, "f9c6fe3dd9b51bd7"),
    ("__future__", 5218, "981d4c398849f9eb"),
    ("_sitebuiltins", 3128, "b9388bc1d6d12ed6"),
    ("nturl2path", 2887, "980982ba66cc403d"),
    ("this", 1003, "481d0cb3de511eae"),
    ("antigravity", 500, "8a5ee63e1b79ba27"),
    ("difflib", 83308, "0c6afc23568d55b3"),
    ("optparse", 60369, "07d224301cba312f"),
    ("textwrap", 19718, "62867e40cdea6669"),
    ("queue", 11496, "f6c37fc37cd74409"),
    ("sched", 6351, "edfb309483d7cb05"),
    ("fnmatch", 5999, "6683da36e47af523"),
    ("operator", 10965, "b2af20f67667203c"),
    ("stat", 5485, "052af0327eae6941"),
    ("linecache", 5690, "e814839fc75010db"),
    ("_compat_pickle", 8761, "12c8356a3d40bd0a"),
    ("_osx_support", 21787, "6a99e8c9ff67c891"),
    ("bz2", 11847, "76ab3252924e71e8"),
    ("lzma", 13277, "58fb9d2fdc8a8af7"),
    ("cmd", 14873, "fb82a8c4e44e5b55"),
    ("getpass", 5990, "e74fd445337ff503"),
    ("glob", 8681, "fa579f8a50a66313"),
    ("hmac", 7717, "a4790b3cfd1b5887"),
    ("modulefinder", 23699, "e07ab000c3698a75"),
    ("pickletools", 93486, "bcc8d00ebadd684a"),
    ("rlcompleter", 7827, "fee9ad9c55529be4"),
    ("shelve", 8560, "b978c6f0ffa901b0"),
    ("shlex", 13501, "42ab6060f316e121"),
    ("bisect", 3135, "e5b2ff166f48a06e"),
    ("copy", 8681, "27dcfc53a4b9d4fb"),
    ("copyreg", 7677, "5499e1be7ba52d47"),
    ("getopt", 7489, "efafb88c7c978e96"),
    ("reprlib", 5437, "264433cc232332db"),
    ("numbers", 10348, "6d70991643a109e9"),
    ("_collections_abc", 30193, "ec646ef7e27aae26"),
    ("_strptime", 25277, "065e6597af214f79"),
    ("code", 10622, "266841655656d5b2"),
    ("compileall", 20252, "859a2743805b0570"),
    ("csv", 16030, "6c68a5186e3b85e6"),
    ("filecmp", 10178, "178f19895fdd43d5"),
    ("genericpath", 4975, "9d58ad64056a89f1"),
    ("hashlib", 11765, "e2bffb462e4d43e6"),
    ("netrc", 6929, "6394e8e650d04c26"),
    ("posixpath", 17013, "115bb3d2051318ee"),
    ("pprint", 24489, "0b67dbc8af449d8c"),
    ("runpy", 13159, "f7af4206d8cbb27f"),
    ("symtable", 10368, "ce90d8e945776674"),
    ("tabnanny", 11299, "73bc1829f1063472"),
    ("types", 10067, "0c08fbb650c37535"),
    ("zipapp", 7535, "776078e89fd7dadb"),
    ("zipimport", 30897, "e84b98dd13d3a8ae"),
    ("pstats", 29356, "d62d1e6a626ebd92"),
    ("fractions", 28667, "b11e850e354808b8"),
    ("functools", 38413, "6d80018a3fa9fed4"),
    ("random", 32162, "b931a2d452db89ab"),
    ("statistics", 47705, "889a066f1b8063e7"),
)


class StdlibTextWarning(UserWarning):
    """This interpreter's copies of the text task's files differ from the recorded ones."""


@dataclasses.dataclass(frozen=True)
class TextSplit:
    """What :func:`stdlib_text` read: the files, where they came from and the split's sizes."""

    root: str
    files: tuple[str, ...]
    train_bytes: int
    val_bytes: int
    differing: tuple[str, ...]  # files whose size or digest differ from the recorded ones

    def summary(self) -> str:
        match = (
            f"identical to CPython {TEXT_REFERENCE_PYTHON}'s"
            if not self.differing
            else f"{len(self.differing)} differ from CPython {TEXT_REFERENCE_PYTHON}'s"
        )
        return (
            f"text_lm data: {len(self.files)} files from {self.root} ({match}): "
            f"{self.train_bytes:,} train bytes, {self.val_bytes:,} validation bytes"
        )


def _stdlib_text(
    num_files: int, val_fraction: float, on_mismatch: str, root: str | Path | None
) -> tuple[np.ndarray, np.ndarray, TextSplit]:
    if not 1 <= num_files <= len(TEXT_FILES):
        raise ValueError(f"num_files must be in [1, {len(TEXT_FILES)}]; got {num_files}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    chosen = TEXT_FILES[:num_files]
    paths = [root / f"{name}.py" for name, _, _ in chosen]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"the text task's standard-library files {missing} are missing from {root} "
            f"(Python {sys.version.split()[0]}; the list was made for CPython 3.11-3.13)"
        )
    texts = [p.read_bytes() for p in paths]
    differing = tuple(
        name
        for (name, size, digest), text in zip(chosen, texts, strict=True)
        if len(text) != size or hashlib.sha256(text).hexdigest()[:16] != digest
    )
    data = np.frombuffer(b"\n".join(texts), np.uint8)
    cut = int(len(data) * (1 - val_fraction))
    split = TextSplit(
        str(root), tuple(name for name, _, _ in chosen), cut, len(data) - cut, differing
    )
    if differing and on_mismatch != "ignore":
        message = (
            f"the text task's files differ from CPython {TEXT_REFERENCE_PYTHON}'s: "
            f"{', '.join(differing)} ({len(differing)} of {num_files}, in {root}); the split "
            f"({split.train_bytes:,} train bytes, {split.val_bytes:,} validation bytes) is not "
            f"the one the README's results used, so losses are not comparable with them"
        )
        if on_mismatch == "raise":
            raise ValueError(message)
        warnings.warn(message, StdlibTextWarning, stacklevel=3)
    return data[:cut], data[cut:], split


def stdlib_text_split(
    num_files: int = 64, val_fraction: float = 0.1, *, root: str | Path | None = None
) -> TextSplit:
    """Describes the split :func:`stdlib_text` returns (files, bytes, differing files)."""
    return _stdlib_text(num_files, val_fraction, "ignore", root)[2]


def stdlib_text(
    num_files: int = 64,
    val_fraction: float = 0.1,
    *,
    strict: bool = False,
    report: bool = True,
    root: str | Path | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level text: the first ``num_files`` modules of :data:`TEXT_FILES`, read from this
    Python's standard library, joined by newlines; the last ``val_fraction`` of the bytes is
    the validation split.

    Every file must exist (``FileNotFoundError`` otherwise). A file whose size or SHA-256
    differs from the one recorded for CPython 3.11.7 gives a :class:`StdlibTextWarning`
    naming it (a ``ValueError`` with ``strict=True``): the data is then still Python source,
    but not the bytes the README's results were measured on.

    Args:
        num_files: how many files of :data:`TEXT_FILES`, 1 to 64.
        val_fraction: the validation split's share of the bytes, in (0, 1).
        strict: raise instead of warning when a file differs from the recorded one.
        report: print one line to stderr with the files' origin and the split's bytes.
        root: the directory to read the files from (default: this Python's standard
            library), e.g. a copy of CPython 3.11.7's files to reproduce the README's data.

    Returns:
        ``(train [n_train], validation [n_val])`` uint8 arrays.
    """
    train, val, split = _stdlib_text(num_files, val_fraction, "raise" if strict else "warn", root)
    if report:
        print(split.summary(), file=sys.stderr)
    return train, val


def text_batch(
    data: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int, split: str = "train"
) -> Batch:
    """Random windows of ``seq_len + 1`` bytes: inputs and next-byte labels."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is longer than the text ({len(data)} bytes)")
    rng = _rng(seed, step, split)
    starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
    windows = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)
    return Batch(windows[:, :-1], windows[:, 1:], np.ones((batch_size, seq_len), bool))
