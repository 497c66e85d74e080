"""Bamba checkpoints in Hugging Face format (``BambaForCausalLM``, ``model_type`` ``bamba``)
<-> ``LanguageModel``: the config's fields as the model's options, and the one table of
weights.

Bamba is a hybrid of Mamba-2 mixers (``"linear_attention"`` layers, our ``"mamba2"``) and
softmax attention (the layers in ``attn_layer_indices``, our ``"softmax"``), every layer
followed by a SwiGLU MLP. Its conventions, each mapped to an option of ours:

* the mixer is Mamba-2's (``hf.mamba2``'s rows under ``mamba.``; its options
  ``mamba_n_heads``, ``mamba_d_head``, ``mamba_d_state``, ``mamba_n_groups``,
  ``mamba_d_conv``, ``mamba_conv_bias``, ``mamba_proj_bias``, ``time_step_limit``);
* attention is Llama's: GQA, no biases, RoPE (``rotate_half``) on the first half of each
  head (``partial_rotary_factor`` 0.5, which ``transformers`` fixes), ``head_dim = hidden_size
  / num_attention_heads``;
* every RMSNorm's epsilon (the blocks', the final one and the mixers' gated norms) is
  ``rms_norm_eps``; ``nn.Linear`` weights are ``[out, in]``, our kernels ``[in, out]``.

The tensors live under ``model.`` (``lm_head.weight`` apart, untied only).

Bamba is the base of the Mamba-2 hybrids (``granitemoehybrid``, ``falcon_h1``): their
mixers' fields (``HYBRID_DEFAULTS``, ``HYBRID_STEPS``, ``HYBRID_CHECKS``), rows
(``hybrid_mixer_rules``) and options (``hybrid_mixer_options``) are read here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, mamba2, tables
from linattn_jax.hf.tables import COPY, Rule

MODEL_TYPES = ("bamba",)
LAYER_KINDS = {"linear_attention": "mamba2", "full_attention": "softmax"}
PARTIAL_ROTARY_FACTOR = 0.5  # transformers' BambaConfig fixes it

MODEL_RULES = tables.rules(
    ("embed_tokens.weight", "embed.embedding", COPY),
    ("final_layernorm.weight", "norm.scale", COPY),
)
BLOCK_RULES = tables.rules(
    ("input_layernorm.weight", "attention_norm.scale", COPY),
    ("pre_ff_layernorm.weight", "mlp_norm.scale", COPY),
) + tables.under(tables.SWIGLU_RULES, "feed_forward.", "mlp.")
ATTENTION_RULES = tables.ATTENTION_RULES


def hybrid_mixer_rules(config: Mapping[str, Any]) -> tuple[Rule, ...]:
    """A hybrid's mixer rows (``mamba2.mixer_rules`` under ``mamba.``) for its biases."""
    bias = config["mamba_proj_bias"]
    return mamba2.mixer_rules("mamba.", conv_bias=config["mamba_conv_bias"], bias=bias)


def layer_rules(config: Mapping[str, Any], i: int) -> tuple[Rule, ...]:
    """Layer ``i``'s rows: its norms and MLP, and its mixer or attention."""
    mixer = layer_types(config)[i] == "linear_attention"
    return BLOCK_RULES + (hybrid_mixer_rules(config) if mixer else ATTENTION_RULES)


# -------------------------------------------------------- the hybrids' mixers' config

# transformers' defaults of the mixer's fields, alike in Bamba's, Granite-4.0-H's and
# Falcon-H1's configs (``"auto"``: ``auto_head_dim``, or Falcon-H1's own).
HYBRID_DEFAULTS = dict(
    mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256,
    mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False,
    time_step_limit=[0.0, math.inf],
)  # fmt: skip


def hybrid_defaults(config: common.Config) -> None:
    """What ``transformers`` derives alike for a hybrid's config: ``num_key_value_heads``
    (``num_attention_heads`` when absent), ``time_step_limit`` decoded, ``rope_parameters``'
    ``rope_type`` (``"default"``) and ``rope_theta`` (the top-level one, else 10000)."""
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config.get("num_attention_heads")
    mamba2.decode_time_step_limit(config)
    config["rope_parameters"] = common.rope_parameters(config, 10000.0)


def auto_head_dim(config: common.Config) -> None:
    """A ``mamba_d_head`` of ``"auto"`` as Bamba and Granite-4.0-H derive it:
    ``mamba_expand * hidden_size // mamba_n_heads`` (left for the checks where
    ``hidden_size`` is not an int)."""
    if config["mamba_d_head"] == "auto" and common.is_int(config.get("hidden_size")):
        heads = config["mamba_n_heads"]
        config["mamba_d_head"] = config["mamba_expand"] * config["hidden_size"] // heads


HYBRID_STEPS = (hybrid_defaults, auto_head_dim)
HYBRID_CHECKS = (
    mamba2.inner_width("mamba_expand", "mamba_n_heads", "mamba_d_head"),
    common.divides("mamba_n_groups", "mamba_n_heads"),
    common.divides("num_key_value_heads", "num_attention_heads"),
    common.divides("num_attention_heads", "hidden_size"),
)


def hybrid_mixer_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """A hybrid's ``Mamba2Mixer`` options, its norms' epsilon ``rms_norm_eps``."""
    return dict(
        num_heads=config["mamba_n_heads"],
        **mamba2.mixer_options(
            head_dim=config["mamba_d_head"],
            state_dim=config["mamba_d_state"],
            n_groups=config["mamba_n_groups"],
            conv_size=config["mamba_d_conv"],
            use_conv_bias=config["mamba_conv_bias"],
            use_bias=config["mamba_proj_bias"],
            time_step_limit=config["time_step_limit"],
            norm_eps=config["rms_norm_eps"],
        ),
    )


def llama_attention(config: Mapping[str, Any], **more: Any) -> dict[str, Any]:
    """The hybrids' softmax attention: Llama's (GQA, ``hidden_size / num_attention_heads``
    wide heads), with ``more`` options."""
    heads = config["num_attention_heads"]
    return dict(
        num_heads=heads,
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["hidden_size"] // heads,
        **more,
    )


# ---------------------------------------------------------------------- Bamba's config

# transformers' BambaConfig defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-5, attn_layer_indices=None,
    attention_bias=False, mlp_bias=False, **HYBRID_DEFAULTS,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "mamba_n_heads", "mamba_d_head",
    "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
)  # fmt: skip


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's type, ``"full_attention"`` at ``attn_layer_indices``, else
    ``"linear_attention"`` (transformers' ``layers_block_type``)."""
    indices = config["attn_layer_indices"] or []
    return [
        "full_attention" if i in indices else "linear_attention"
        for i in range(config["num_hidden_layers"])
    ]


def bamba_layout(config: common.Config) -> None:
    """RoPE on half of each head (``transformers`` fixes it); ``layer_types`` derived from
    ``attn_layer_indices`` (a stored one dropped)."""
    config["rope_parameters"].setdefault("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
    config.pop("layer_types", None)


def check_indices(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless ``attn_layer_indices`` is null or lists layers."""
    indices, n = config["attn_layer_indices"], config["num_hidden_layers"]
    if indices is not None and (
        not isinstance(indices, list) or not all(common.is_int(i) and 0 <= i < n for i in indices)
    ):
        raise ValueError(
            f"config.json: attn_layer_indices must list layer indices below num_hidden_layers="
            f"{n}, got {indices!r}"
        )


def check_rope(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless the RoPE is plain, on half of each head."""
    rope = config["rope_parameters"]
    if rope["rope_type"] != "default" or rope["partial_rotary_factor"] != PARTIAL_ROTARY_FACTOR:
        raise ValueError(
            f"config.json: rope_parameters must have rope_type 'default' and "
            f"partial_rotary_factor {PARTIAL_ROTARY_FACTOR}, got {rope!r}"
        )


def check_default_rope(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless the RoPE is plain (Granite-4.0-H's, Falcon-H1's)."""
    if config["rope_parameters"]["rope_type"] != "default":
        raise ValueError(
            f"config.json: rope_parameters must have rope_type 'default', got "
            f"{config['rope_parameters']!r}"
        )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Mamba-2 and Llama's attention by ``layer_types``, each with a SwiGLU MLP."""
    rope = dict(rope=True, rope_theta=float(config["rope_parameters"]["rope_theta"]))
    return dict(
        num_heads=config["num_attention_heads"],
        attention=[LAYER_KINDS[t] for t in layer_types(config)],
        kind_options={
            "mamba2": hybrid_mixer_options(config),
            "softmax": llama_attention(config, **rope, partial_rotary_factor=PARTIAL_ROTARY_FACTOR),
        },
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
    )


FORMAT = common.ModelFormat(
    name="Bamba",
    model_types=MODEL_TYPES,
    architecture="BambaForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        *HYBRID_STEPS,
        bamba_layout,
        common.ints(INT_FIELDS),
        *HYBRID_CHECKS,
        check_indices,
        common.choice("hidden_act", ("silu",)),
        common.false(("attention_bias", "mlp_bias")),
        common.bools(("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings")),
        mamba2.epsilon_and_limit("rms_norm_eps"),
        check_rope,
    ),
    options=options,
    table=tables.layered(MODEL_RULES, layer_rules),
    finish=common.rms_norm_eps("rms_norm_eps"),
)
