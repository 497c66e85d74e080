"""Tasks whose data is generated or read locally: nothing is downloaded.

Every batch is a pure function of ``(seed, step)``, so a run resumed from a
checkpoint sees exactly the batches an uninterrupted run would have seen.

* ``mqar``: multi-query associative recall (Arora et al. 2023, "Zoology").
* ``listops``: nested MIN/MAX/MED/SUM_MOD expressions (Long Range Arena, Tay et al. 2021).
* ``text_lm``: byte-level language modelling on the Python standard library's own sources.
"""

from __future__ import annotations

import dataclasses
import sysconfig
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


def mqar_batch(
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    num_pairs: int,
    vocab_size: int,
    split: str = "train",
) -> Batch:
    """Keys come from the first half of the vocabulary, values from the second;
    queries ask for every key once, in random order. Token 0 pads."""
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
    for row in range(batch_size):
        keys = rng.choice(np.arange(1, half), num_pairs, replace=False)
        values = rng.choice(np.arange(half, vocab_size), num_pairs, replace=True)
        order = rng.permutation(num_pairs)
        context = np.stack([keys, values], 1).reshape(-1)
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
# Byte-level text: the standard library's own .py files, sorted, fixed split.
# ----------------------------------------------------------------------------


def stdlib_text(num_files: int = 64, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, validation)`` uint8 byte arrays from the first ``num_files`` sorted
    ``.py`` files of this Python's standard library (present wherever Python is)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:num_files]
    if not files:
        raise ValueError(f"no .py files found in the standard library at {root}")
    data = np.frombuffer(b"\n".join(p.read_bytes() for p in files), np.uint8)
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]


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
