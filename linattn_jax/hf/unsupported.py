"""Model types (or forms of one) that ``transformers`` has and the loader refuses by name,
saying which of their blocks has no counterpart here (rather than "unknown model_type").

* ``qwen4_exp`` and ``qwen4_exp_text`` (Qwen4-Exp, ``hf.qwen4_exp``) load without the
  QSA indexer, which has no counterpart here, and are refused with it
  (``indexer_n_heads``: its attention layers choose ``indexer_budget`` keys per query
  over compressed blocks; ``transformers`` gives every Qwen4-Exp attention layer one, so
  a config with attention layers in ``layer_types`` has it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QWEN4_EXP = ("qwen4_exp", "qwen4_exp_text")
MODEL_TYPES = QWEN4_EXP


def attention_layers(text: Mapping[str, Any]) -> int:
    """How many layers of a Qwen4-Exp text config are attention (not
    ``"linear_attention"``) layers, as ``transformers`` lays them out (every
    ``full_attention_interval``-th of ``num_hidden_layers`` when ``layer_types`` is
    absent); 0 where the fields are not ints (the format's checks name them)."""
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list):
        return sum(t != "linear_attention" for t in layer_types)
    depth, interval = text.get("num_hidden_layers", 40), text.get("full_attention_interval", 4)
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (depth, interval))
    return depth // interval if ok else 0


def qwen4_exp_blocks(config: Mapping[str, Any]) -> list[str]:
    """The blocks of a Qwen4-Exp ``config`` (its ``text_config`` where it has one) that
    have no counterpart here."""
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else config
    blocks = []
    attention = attention_layers(text)
    if text.get("indexer_n_heads") is not None or attention:
        blocks.append(
            f"the QSA indexer (indexer_n_heads={text.get('indexer_n_heads')}, "
            f"{attention} attention layers)"
        )
    return blocks


def check(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the model type and its missing blocks where the
    config's ``model_type`` is one of ``MODEL_TYPES`` and has any."""
    model_type = config.get("model_type")
    blocks = qwen4_exp_blocks(config) if model_type in QWEN4_EXP else []
    if blocks:
        raise ValueError(
            f"config.json: model_type {model_type!r} (Qwen4-Exp) is not supported with "
            f"{' or '.join(blocks)}: no block here matches it"
        )
