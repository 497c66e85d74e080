"""Qwen2 checkpoints (``Qwen2ForCausalLM``, ``model_type`` ``qwen2``): Llama
(``hf.llama``) with biases on q, k and v (not on the output), and sliding-window layers.

With ``use_sliding_window``, the layers from ``max_window_layers`` on (or those
``layer_types`` lists as ``"sliding_attention"``) see their last ``sliding_window`` tokens:
our ``"local_softmax"`` kind beside the ``"softmax"`` of the ``"full_attention"`` layers.
Without it ``transformers`` reads ``sliding_window`` as null, and so do we.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, llama

# transformers' Qwen2Config defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
    num_attention_heads=32, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
)  # fmt: skip


def window(config: Mapping[str, Any]) -> int | None:
    """The sliding layers' window: ``sliding_window`` with ``use_sliding_window``, else None."""
    return config["sliding_window"] if config["use_sliding_window"] else None


def layer_types(config: common.Config) -> None:
    """Fills in ``layer_types`` where absent as ``transformers`` does (sliding from
    ``max_window_layers`` on, when there is a window) and checks it."""
    common.check_bools(config, ("use_sliding_window",))
    if config.get("layer_types") is None:
        common.check_ints(config, ("max_window_layers",), minimum=0)
        sliding = lambda i: window(config) is not None and i >= config["max_window_layers"]
        config["layer_types"] = [
            "sliding_attention" if sliding(i) else "full_attention"
            for i in range(config["num_hidden_layers"])
        ]
    llama.check_windows(config)
    if "sliding_attention" in config["layer_types"] and not config["use_sliding_window"]:
        raise ValueError("config.json: sliding_attention layers need use_sliding_window true")


def windowed_options(config: Mapping[str, Any], **more: Any) -> dict[str, Any]:
    """Each layer of ``layer_types`` softmax attention (``more`` its options), the sliding
    ones with their window, and a SwiGLU MLP."""
    softmax = llama.softmax_options(config, **more)
    return llama.windowed_options(config, softmax, dict(softmax, sliding_window=window(config)))


FORMAT = llama.FORMAT.derive(
    name="Qwen2",
    model_types=("qwen2",),
    architecture="Qwen2ForCausalLM",
    steps=llama.windowed_steps(DEFAULTS, 10000.0, layer_types),
    options=lambda config: windowed_options(config, qkv_bias=True),
    table=llama.table(lambda config: llama.attention_rules(True, False)),
)
