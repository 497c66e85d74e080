"""Pretrained checkpoints in Hugging Face format: Qwen3.5's dense text models (Gated
DeltaNet hybrids) into a ``LanguageModel`` and back, and text generation from a prompt.

``from_pretrained(path, dtype=None) -> (model, config)`` reads a local directory
(``config.json``, ``model.safetensors`` or a sharded index; nothing is downloaded),
``save_pretrained(model, path)`` writes one that ``transformers`` loads. ``qwen3_5`` holds
the config's mapping and the one weight table; ``safetensors_io`` the streaming reads and
writes; ``text`` the tokenizer and ``generate_text``.
"""

from linattn_jax.hf import qwen3_5, safetensors_io, text
from linattn_jax.hf.pretrained import (
    abstract_model,
    expected_tensors,
    from_pretrained,
    save_pretrained,
)
from linattn_jax.hf.qwen3_5 import MODEL_TYPES
from linattn_jax.hf.text import eos_id, generate_text, load_tokenizer

__all__ = [
    "MODEL_TYPES",
    "abstract_model",
    "eos_id",
    "expected_tensors",
    "from_pretrained",
    "generate_text",
    "load_tokenizer",
    "qwen3_5",
    "safetensors_io",
    "save_pretrained",
    "text",
]
