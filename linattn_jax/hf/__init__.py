"""Pretrained checkpoints in Hugging Face format into a ``LanguageModel`` and back, and
text generation from a prompt.

``from_pretrained(path, dtype=None) -> (model, config)`` reads a local directory
(``config.json``, ``model.safetensors`` or a sharded index; nothing is downloaded) of any
model type in ``MODEL_TYPES``; the model carries its config (``model.hf_config``), and
``save_pretrained(model, path)`` writes a directory that ``transformers`` loads.

The layout: one module per model type over a shared loader.

* ``pretrained``: the loader, the same for every model type (``read_config`` dispatching
  on ``model_type``, ``check_pretrained``, ``from_pretrained``, ``FORMATS``): reading,
  checking, converting, casting and placing one tensor at a time; ``saving``: the way back
  (``save_pretrained``), the config written the one the model carries, or a given one
  checked to build it.
* ``common``: ``ModelFormat`` (a model type: its ``steps`` reading ``config.json``, its
  ``options`` for ``LanguageModel``, its weight ``table``) and the steps as values
  (``defaults``, ``ints``, ``choice``, ...); ``tables``: a weight table's rows (``Rule``),
  the conversions as values (``COPY``, ``LINEAR``, ``SPLIT``, ``CONV``, ``grouped(n)``,
  ...), and the rows several model types share; ``rope``: RoPE's config fields and
  scalings (``rope_parameters``, the legacy ``rope_scaling``); ``experts``: the softmax
  types' mixtures of experts (which layers, their rows per expert or fused).
* one module per model type, its ``FORMAT``. A derived model type is its base's
  ``FORMAT.derive(...)``, stating only what differs (docs/development.md: "Adding a model
  type")::

      qwen3_5 (Gated DeltaNet + gated softmax)
      └── qwen3_5_moe (every MLP a mixture)
          ├── qwen3_next (fused DeltaNet projections, dense and MoE layers)
          ├── lara_mini (sliding and full softmax layers, plain norms, fused in_proj)
          └── qwen4_exp (hyper-connections: n residual streams)
      mamba2 (Mamba-2 mixers)
      ├── bamba (Mamba-2 + Llama attention + SwiGLU: the hybrids' base)
      │   ├── granitemoehybrid (experts + shared MLP, muP multipliers)
      │   └── falcon_h1 (attention and Mamba-2 side by side)
      ├── nemotron_h (mixer, attention and squared-ReLU MLP layers)
      └── zamba2 (mixers plus shared transformer blocks with per-use adapters)
      mamba (Mamba-1 mixers: the selective scan)
      ├── falcon_mamba (weightless norms on dt, B and C)
      ├── zamba (Mamba-1 mixers plus one shared attention block)
      └── jamba (+ attention without RoPE, mixtures every other layer)
      kimi_linear (KDA + MLA + DeepSeek's mixture)
      └── bailing_hybrid (full-rank, bounded KDA gates; MLA with RoPE and a head gate)
      minimax (lightning + softmax attention, normed residuals, a mixture)
      olmo_hybrid (Gated DeltaNet + post-normed softmax)
      xlstm (mLSTM)
      rwkv (RWKV-4: time mix + channel mix, LayerNorms)
      recurrent_gemma (Griffin's RG-LRU blocks + local multi-query attention)
      llama (softmax attention + SwiGLU: the softmax model types' base)
      ├── mistral (every layer a sliding window)
      │   ├── phi3 (fused qkv and gate_up projections, partial RoPE)
      │   └── mixtral (every MLP a mixture: hf.experts)
      ├── qwen2 (q/k/v biases, sliding-window layers: "local_softmax")
      │   └── qwen3 (QK-norm)
      │       └── qwen3_moe (mixtures on decoder_sparse_step's layers)
      ├── gemma2 ((1 + w) sandwich norms, GeGLU, soft caps, alternating windows)
      │   └── gemma3 (gemma3_text: QK-norm, 5 local : 1 global, RoPE per layer type)
      └── deepseek_v3 (MLA, DeepSeek's mixture after the first dense layers)
      lfm2 (gated short convolutions + QK-normed softmax attention)
      ├── lfm2_moe (mixtures after the first dense layers)
      └── lfm3 (sliding layers, gated Qwen3 attention, RoPE per type, sandwich norms)

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
    bailing_hybrid,
    bamba,
    common,
    deepseek_v3,
    experts,
    falcon_h1,
    falcon_mamba,
    gemma2,
    gemma3,
    granitemoehybrid,
    jamba,
    kimi_linear,
    lara_mini,
    lfm2,
    lfm2_moe,
    lfm3,
    llama,
    mamba,
    mamba2,
    minimax,
    mistral,
    mixtral,
    nemotron_h,
    olmo_hybrid,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    qwen4_exp,
    rope,
    rwkv,
    safetensors_io,
    tables,
    text,
    unsupported,
    xlstm,
    zamba,
    zamba2,
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
)
from linattn_jax.hf.saving import save_pretrained  # noqa: E402
from linattn_jax.hf.text import eos_ids, generate_text, load_tokenizer  # noqa: E402

__all__ = [
    "FORMATS",
    "MODEL_TYPES",
    "abstract_model",
    "bailing_hybrid",
    "bamba",
    "check_pretrained",
    "common",
    "deepseek_v3",
    "eos_ids",
    "experts",
    "expected_tensors",
    "falcon_h1",
    "format_of",
    "gemma2",
    "gemma3",
    "from_pretrained",
    "generate_text",
    "kimi_linear",
    "lara_mini",
    "granitemoehybrid",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "llama",
    "load_tokenizer",
    "mamba2",
    "minimax",
    "mamba",
    "falcon_mamba",
    "mistral",
    "mixtral",
    "nemotron_h",
    "olmo_hybrid",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe",
    "qwen3_next",
    "read_config",
    "rope",
    "safetensors_io",
    "save_pretrained",
    "tables",
    "text",
    "unsupported",
    "xlstm",
    "rwkv",
    "zamba2",
    "recurrent_gemma",
    "zamba",
    "jamba",
    "qwen4_exp",
]
