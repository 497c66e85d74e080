"""The experiments' tasks: what each one needs from a config without loading its data
(``TASKS``), MQAR's train and test mixes of (seq_len, num_pairs), and ``build_task``,
a config's batches as a pure function of (step, split).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
from ml_collections import ConfigDict

from experiments import data


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """How a task shapes the model and reads its results.

    Attributes:
      kind: ``"lm"`` (causal language model) or ``"classify"`` (sequence classifier).
      vocab_size: the config -> the number of input tokens.
      num_classes: classes of a classifier (0 for a language model).
      metric: the headline eval metric: ``"accuracy"`` or ``"bits_per_byte"``.
      chance: the config -> the metric of a uniform guess.
    """

    kind: str
    vocab_size: Callable[[ConfigDict], int]
    num_classes: int
    metric: str
    chance: Callable[[ConfigDict], float]


TASKS = {
    # MQAR's answers are values, the upper half of the vocabulary.
    "mqar": TaskSpec(
        "lm",
        lambda c: c.mqar.vocab_size,
        0,
        "accuracy",
        lambda c: 1 / (c.mqar.vocab_size - c.mqar.vocab_size // 2),
    ),
    "listops": TaskSpec("classify", lambda c: data.LISTOPS_VOCAB, 10, "accuracy", lambda c: 0.1),
    "text_lm": TaskSpec("lm", lambda c: 256, 0, "bits_per_byte", lambda c: 8.0),
}


def parse_mix(text: str) -> list[tuple[int, int]]:
    """``"64:4,128:8"`` -> ``[(64, 4), (128, 8)]``: MQAR's (seq_len, num_pairs) splits.

    Raises:
      ValueError: not of that form, or a number < 1.
    """
    shapes = []
    for item in text.split(",") if text else ():
        length, sep, pairs = item.strip().partition(":")
        if not (sep and length.isdigit() and pairs.isdigit() and int(length) and int(pairs)):
            raise ValueError(f"not 'seq_len:num_pairs,...': {text!r}")
        shapes.append((int(length), int(pairs)))
    return shapes


def mqar_shapes(config: ConfigDict, split: str) -> list[tuple[int, int]]:
    """The (seq_len, num_pairs) of MQAR's train or eval batches: ``mqar.train_mix``
    (``test_mix``), or ``(seq_len, mqar.num_pairs)`` when that is empty."""
    mix = config.mqar.get("train_mix" if split == "train" else "test_mix", "")
    return parse_mix(mix) or [(config.seq_len, config.mqar.num_pairs)]


@dataclasses.dataclass(frozen=True)
class Task:
    """A config's task with its data.

    Attributes:
      kind: ``"lm"`` or ``"classify"``.
      vocab_size: the number of input tokens.
      num_classes: classes of a classifier (0 for a language model).
      batch: (step, split) -> the global batch.
      text: text_lm's validation bytes, for sampling (None otherwise).
      evals: named eval sets, (name, i -> the i-th eval batch), each reported apart
        (empty: the eval batches are ``batch(i, "eval")``).
    """

    kind: str
    vocab_size: int
    num_classes: int
    batch: Callable[[int, str], data.Batch]
    text: np.ndarray | None = None
    evals: tuple[tuple[str, Callable[[int], data.Batch]], ...] = ()


def build_task(config: ConfigDict) -> Task:
    """The config's task: its shapes from ``TASKS`` and its batches from ``data``."""
    b, t, seed = config.batch_size, config.seq_len, config.seed
    spec = TASKS[config.task]
    shape = (spec.kind, spec.vocab_size(config), spec.num_classes)
    if config.task == "mqar":
        c, spread = config.mqar, config.mqar.get("spread", False)
        train_shapes = mqar_shapes(config, "train")  # one split per step, in turn
        longest = max(length for length, _ in train_shapes)

        def mqar(step: int, split: str, shape: tuple[int, int]) -> data.Batch:
            # batch_size counts sequences of the longest training split; a shorter
            # split's batch holds as many tokens (and as many queries).
            length, pairs = shape
            rows = max(1, b * longest // length)
            return data.mqar_batch(
                seed, step, rows, length, pairs, c.vocab_size, split, spread=spread
            )

        evals = tuple(
            (f"{length}x{pairs}", functools.partial(mqar, split="eval", shape=(length, pairs)))
            for length, pairs in (mqar_shapes(config, "eval") if c.get("test_mix") else ())
        )
        return Task(
            *shape,
            lambda step, split: mqar(
                step,
                split,
                train_shapes[step % len(train_shapes)] if split == "train" else (t, c.num_pairs),
            ),
            evals=evals,
        )
    if config.task == "listops":
        c = config.listops
        return Task(
            *shape,
            lambda step, split: data.listops_batch(
                seed, step, b, t, c.max_depth, c.max_args, split
            ),
        )
    train, val = data.stdlib_text(config.text.num_files, config.text.val_fraction)
    return Task(
        *shape,
        lambda step, split: data.text_batch(
            train if split == "train" else val, seed, step, b, t, split
        ),
        text=val,
    )
