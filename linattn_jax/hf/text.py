"""Text in, text out: a directory's ``tokenizer.json`` (the ``tokenizers`` library) around
``LanguageModel.generate``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from linattn_jax.hf import common


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a directory's ``tokenizer.json``.

    Raises:
      ValueError: no such directory, or it has no ``tokenizer.json``, or one ``tokenizers``
        cannot read (named).
    """
    common.check_directory(path)
    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.exists(file):
        raise ValueError(f"{os.fspath(path)} has no tokenizer.json (text needs one)")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises its own Exception, naming no file
        raise ValueError(f"{file} is not a readable tokenizer: {e}") from None


def eos_ids(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The config's ``eos_token_id`` as a tuple: one id, several (a list: a row ends at any
    of them, as in ``transformers``' ``generate``) or none.

    Raises:
      ValueError: an ``eos_token_id`` that is neither an int, a list of ints nor null.
    """
    eos = config.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"config.json: eos_token_id must be an int or a list of ints, got {eos!r}")
    return tuple(ids)


def generate_text(
    model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[str],
    steps: int,
    rng: jax.Array | None = None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | Sequence[int] | None = None,
) -> str | list[str]:
    """The text ``model`` writes after ``prompt`` (greedy by default).

    Several prompts run as one left-padded batch (``prompt_mask``): each row's text is
    the one it gets alone.

    Args:
      model: a ``LanguageModel`` (``from_pretrained``'s).
      tokenizer: its tokenizer (``load_tokenizer``).
      prompt: a string, or a list of them.
      steps: the most new tokens per prompt.
      rng: a PRNG key, needed when sampling (``temperature > 0``).
      temperature: as in ``LanguageModel.generate``; ``0`` (the default) is greedy.
      top_k: as in ``LanguageModel.generate``.
      top_p: as in ``LanguageModel.generate``.
      eos_id: a row's text ends before this token, or, given several, before whichever
        it samples first (``eos_ids(config)`` gives the config's); it is not part of the
        text. The decoding loop stops early at the first id listed only; the tokens past
        another are dropped.

    Returns:
      The new text (a string, or a list of them for a list of prompts), the prompt left out.

    Raises:
      ValueError: an empty prompt (no tokens), an ``eos_id`` outside the vocabulary, or
        ``generate``'s errors.
    """
    stops = () if eos_id is None else tuple(np.atleast_1d(eos_id).tolist())
    if not all(isinstance(i, int) and 0 <= i < model.vocab_size for i in stops):
        raise ValueError(
            f"eos_id must be None or ids in [0, {model.vocab_size}) (one or a list), got {eos_id!r}"
        )
    single = isinstance(prompt, str)
    prompts = [prompt] if single else list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
    ids = [tokenizer.encode(p).ids for p in prompts]
    empty = [p for p, i in zip(prompts, ids, strict=True) if not i]
    if empty:
        raise ValueError(f"prompt {empty[0]!r} has no tokens (generate needs one at least)")
    t = max(len(i) for i in ids)
    tokens = np.zeros((len(ids), t), np.int32)
    mask = np.zeros((len(ids), t), bool)
    for row, i in enumerate(ids):  # left padding: the real tokens end every row
        tokens[row, t - len(i) :], mask[row, t - len(i) :] = i, True
    out = model.generate(
        jnp.asarray(tokens),
        steps,
        rng,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=stops[0] if stops else None,
        prompt_mask=None if mask.all() else jnp.asarray(mask),
    )
    texts = []
    for row in np.asarray(out[:, t:]).tolist():
        end = next((i for i, token in enumerate(row) if token in stops), len(row))
        texts.append(tokenizer.decode(row[:end]))
    return texts[0] if single else texts
