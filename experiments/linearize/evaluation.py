"""The linearisation's data and measures: the text corpus as the teacher's token ids, the
stages' batches, the held-out loss and perplexity, and the copy probe of recall."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict

from experiments import data
from experiments.linearize import stages
from linattn_jax import hf


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


def batch(corpus: Corpus, config: ConfigDict, step: int) -> data.Batch:
    """Training batch ``step`` of the student's stages (stage 2 continues stage 1's steps,
    the scratch baseline reads the same ones)."""
    return data.text_batch(
        corpus.train, config.seed, step, config.batch_size, config.seq_len, "train"
    )


def held_out(model, corpus: Corpus, config: ConfigDict) -> dict:
    """Mean held-out cross-entropy (nats per token), perplexity and accuracy."""
    loss = accuracy = 0.0
    ones = np.ones((config.batch_size, config.seq_len), np.float32)
    for i in range(config.eval_batches):
        b = data.text_batch(corpus.val, config.seed, i, config.batch_size, config.seq_len, "eval")
        values = stages.eval_loss(model, b.inputs, b.labels, ones)
        loss, accuracy = loss + float(values[0]), accuracy + float(values[1])
    loss, accuracy = loss / config.eval_batches, accuracy / config.eval_batches
    return {"loss": loss, "perplexity": float(np.exp(loss)), "accuracy": accuracy}


def copy_accuracy(model, corpus: Corpus, config: ConfigDict) -> float:
    """The recall probe: held-out windows of ``n = seq_len / 2`` tokens each followed by
    themselves (the evaluation's shape); the accuracy of predicting the copy's tokens
    from the copy so far (its first token aside)."""
    n, t = config.seq_len // 2, config.seq_len
    weights = np.zeros((config.batch_size, t), np.float32)
    weights[:, n : 2 * n - 1] = 1.0  # position i predicts token i + 1 of the copy
    hits = []
    for i in range(config.copy_batches):
        w = data.text_batch(corpus.val, config.seed + 1, i, config.batch_size, n, "eval").inputs
        tokens = np.concatenate([w, w, w[:, : t + 1 - 2 * n]], axis=1)
        hits.append(float(stages.eval_loss(model, tokens[:, :t], tokens[:, 1:], weights)[1]))
    return float(np.mean(hits))
