"""Model types that ``transformers`` has and the loader refuses by name, saying which of
their blocks has no counterpart here (rather than "unknown model_type"): none at present
(Qwen4-Exp, the last, loads: ``hf.qwen4_exp``). A type added here is refused by ``check``,
which the loader runs on every config before its model type's steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MODEL_TYPES: tuple[str, ...] = ()


def check(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the model type where the config's ``model_type`` is
    one of ``MODEL_TYPES`` (none at present)."""
    model_type = config.get("model_type")
    if model_type in MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported")
