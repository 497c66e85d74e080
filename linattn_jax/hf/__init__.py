"""Pretrained checkpoints in Hugging Face format into a ``LanguageModel`` and back, and
text generation from a prompt.

``from_pretrained(path, dtype=None) -> (model, config)`` reads a local directory
(``config.json``, ``model.safetensors`` or a sharded index; nothing is downloaded) of any
model type in ``MODEL_TYPES``; ``save_pretrained(model, path, config)`` writes one that
``transformers`` loads.

The layout: one module per model type over a shared loader.

* ``pretrained``: the loader, the same for every model type (``read_config`` dispatching
  on ``model_type``, ``check_pretrained``, ``from_pretrained``, ``save_pretrained``,
  ``FORMATS``): reading, checking, converting, casting and placing one tensor at a time.
* ``common``: what the model types' modules share: ``Rule`` (a weight table's row) and
  ``CONVERSIONS`` (``copy``, ``linear``, ``split``, ``conv``; ``Rule.index`` stacks
  per-expert tensors into one parameter), ``ModelFormat``, and the checks of config fields.
* one module per model type (``qwen3_5``, ``qwen3_5_moe``, ``qwen3_next``, ``mamba2``,
  ``bamba``, ``nemotron_h``, ``granitemoehybrid``, ``falcon_h1``, ``kimi_linear``, ``minimax``,
  ``olmo_hybrid``): its ``FORMAT``, a
  ``common.ModelFormat``, holds
  ``normalize_config`` (``config.json``'s fields checked, an unsupported one refused by
  name, defaults as ``transformers``'), ``model_options`` (``LanguageModel``'s
  arguments), ``weight_table`` (every tensor's name, our parameter path(s) and conversion)
  and ``config_for_save`` (the config of a model, compared with a given one on what the
  model uses). Adding a model type is one such module and one entry in
  ``pretrained._MODULES``.
* ``safetensors_io``: the streaming reads and the sharded writes; ``text``: the tokenizer
  and ``generate_text``.
"""

import importlib.util

# The extra's packages, named where they are missing (an ImportError naming a module of
# safetensors says nothing of how to install it).
_MISSING = [
    name for name in ("safetensors", "tokenizers") if importlib.util.find_spec(name) is None
]
if _MISSING:
    raise ImportError(
        f"linattn_jax.hf needs {' and '.join(_MISSING)}: pip install 'linattn_jax[hf]'"
    )

from linattn_jax.hf import (  # noqa: E402
    bamba,
    common,
    falcon_h1,
    granitemoehybrid,
    kimi_linear,
    mamba2,
    minimax,
    nemotron_h,
    olmo_hybrid,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    safetensors_io,
    text,
    xlstm,
)
from linattn_jax.hf.pretrained import (  # noqa: E402
    FORMATS,
    MODEL_TYPES,
    abstract_model,
    check_pretrained,
    expected_tensors,
    format_of,
    from_pretrained,
    read_config,
    save_pretrained,
)
from linattn_jax.hf.text import eos_ids, generate_text, load_tokenizer  # noqa: E402

__all__ = [
    "FORMATS",
    "MODEL_TYPES",
    "abstract_model",
    "bamba",
    "check_pretrained",
    "common",
    "eos_ids",
    "expected_tensors",
    "falcon_h1",
    "format_of",
    "from_pretrained",
    "generate_text",
    "kimi_linear",
    "granitemoehybrid",
    "load_tokenizer",
    "mamba2",
    "minimax",
    "nemotron_h",
    "olmo_hybrid",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "read_config",
    "safetensors_io",
    "save_pretrained",
    "text",
    "xlstm",
]
