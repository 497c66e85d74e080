"""Gemma 3's text checkpoints (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): Gemma 2
(``hf.gemma2``) with an RMSNorm of Gemma's ``(1 + w)`` form over each head's q and k before
RoPE (``qk_norm``, ``zero_centred_qk_norm``), one full layer every
``sliding_window_pattern``-th (6) and the others sliding, and RoPE per layer type:
``rope_parameters`` holds one dict for ``"full_attention"`` (base ``rope_theta``, 1e6,
and its scaling: a legacy ``rope_scaling`` goes there) and one for
``"sliding_attention"`` (base ``rope_local_base_freq``, 1e4), each read as Llama's
(``hf.rope``). The logits are soft-capped with ``final_logit_softcapping`` (none by
default); the scores are not, whatever ``attn_logit_softcapping`` says, as in
``transformers``' Gemma 3, which keeps the field but never passes it to its attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, gemma2, llama, rope, tables

DEFAULTS = dict(
    gemma2.DEFAULTS, vocab_size=262208, max_position_embeddings=131072,
    final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False,
)  # fmt: skip
THETAS = {"full_attention": ("rope_theta", 1e6), "sliding_attention": ("rope_local_base_freq", 1e4)}


def rope_by_layer_type(config: common.Config) -> None:
    """``rope_parameters`` as one checked dict per layer type, from the nested form, a
    legacy ``rope_scaling`` (the full layers'), ``rope_theta`` and ``rope_local_base_freq``."""
    given = config.get("rope_parameters") or {}
    if not isinstance(given, Mapping) or not set(given) <= set(THETAS):
        raise ValueError(
            f"config.json: rope_parameters must be one dict per layer type {list(THETAS)}, got "
            f"{given!r}"
        )
    nested = {name: dict(given.get(name) or {"rope_type": "default"}) for name in THETAS}
    nested["full_attention"].update(config.pop("rope_scaling", None) or {})
    for name, (field, theta) in THETAS.items():
        theta = config.pop(field, theta)
        nested[name] = rope.normalize(nested[name], config, theta, name=name)
    config["rope_parameters"] = nested


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2's, with QK-norm and each layer type's RoPE."""
    more = gemma2.attention_options(config, qk_norm=True, zero_centred_qk_norm=True)
    more.update(logit_soft_cap=None)  # transformers' Gemma 3 never caps the scores
    by_type = config["rope_parameters"]
    softmax = llama.softmax_options(config, by_type["full_attention"], **more)
    local = llama.softmax_options(config, by_type["sliding_attention"], **more)
    local.update(sliding_window=config["sliding_window"])
    layers = llama.windowed_options(config, softmax, local, mlp="geglu")
    return {**layers, **gemma2.model_options(config)}


FORMAT = gemma2.FORMAT.derive(
    name="Gemma 3",
    model_types=("gemma3_text",),
    architecture="Gemma3ForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=gemma2.NULLABLE),
        *llama.SIZE_CHECKS,
        rope_by_layer_type,
        gemma2.layer_types(6, "sliding_window_pattern"),
    ),
    options=options,
    table=tables.layered(
        tables.MODEL_RULES,
        lambda config, i: gemma2.layer_rules(config, *tables.QK_NORM_RULES),
    ),
)
