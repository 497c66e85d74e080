"""Model types that ``transformers`` has and the loader refuses by name, saying which of
their blocks has no counterpart here (rather than "unknown model_type").

* ``qwen4_exp`` and ``qwen4_exp_text`` (Qwen4-Exp): Gated DeltaNet and softmax layers
  (Qwen3.5-MoE's) whose residual stream is ``hc_count`` streams, mixed before and
  re-injected after every mixer and MLP (hyper-connections: ``attn_hyper_connection``,
  ``mlp_hyper_connection``, a final ``hyper_connection_mixer``); with ``indexer_n_heads``
  its full layers choose ``indexer_budget`` keys per query over compressed blocks (QSA),
  and with ``ple_layer_ids`` those layers add hashed n-gram embeddings (PLE). None of
  the three is a block here, and ``transformers`` has no form without hyper-connections
  (``hc_count`` must be > 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QWEN4_EXP = ("qwen4_exp", "qwen4_exp_text")
MODEL_TYPES = QWEN4_EXP


def qwen4_exp_blocks(config: Mapping[str, Any]) -> list[str]:
    """The blocks of a Qwen4-Exp ``config`` (its ``text_config`` where it has one) that
    have no counterpart here."""
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else config
    blocks = [f"hyper-connections (hc_count={text.get('hc_count', 4)} residual streams)"]
    if text.get("indexer_n_heads") is not None:
        blocks.append(f"the QSA indexer (indexer_n_heads={text['indexer_n_heads']})")
    if text.get("ple_layer_ids"):
        blocks.append(f"per-layer n-gram embeddings (ple_layer_ids={text['ple_layer_ids']})")
    return blocks


def check(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the model type and its missing blocks where the
    config's ``model_type`` is one of ``MODEL_TYPES``."""
    model_type = config.get("model_type")
    if model_type in QWEN4_EXP:
        raise ValueError(
            f"config.json: model_type {model_type!r} (Qwen4-Exp) is not supported: no block "
            f"here matches its {', '.join(qwen4_exp_blocks(config))}"
        )
