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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from linattn_jax.hf import common, mamba2
from linattn_jax.hf.common import Rule

MODEL_TYPES = ("bamba",)
PREFIX = "model."
IGNORED_PREFIXES = ()
LAYER_KINDS = {"linear_attention": "mamba2", "full_attention": "softmax"}
PARTIAL_ROTARY_FACTOR = 0.5  # transformers' BambaConfig fixes it


MODEL_RULES = common.rules(
    ("embed_tokens.weight", "embed.embedding", "copy"),
    ("final_layernorm.weight", "norm.scale", "copy"),
)
HEAD_RULE = mamba2.HEAD_RULE
BLOCK_RULES = common.rules(
    ("input_layernorm.weight", "attention_norm.scale", "copy"),
    ("pre_ff_layernorm.weight", "mlp_norm.scale", "copy"),
    ("feed_forward.gate_proj.weight", "mlp.gate_proj.kernel", "linear"),
    ("feed_forward.up_proj.weight", "mlp.up_proj.kernel", "linear"),
    ("feed_forward.down_proj.weight", "mlp.down_proj.kernel", "linear"),
)
ATTENTION_RULES = common.ATTENTION_RULES


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, Rule]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s): ``(its full
    Hugging Face name, the Rule with our full paths)``, in the model's order."""
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    mixer = mamba2.hybrid_mixer_rules(config)
    for i, layer_type in enumerate(layer_types(config)):
        own = mixer if layer_type == "linear_attention" else ATTENTION_RULES
        rows += common.prefixed(BLOCK_RULES + own, f"{prefix}layers.{i}.", f"blocks.{i}.")
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


# ---------------------------------------------------------------------------- the config

DEFAULTS = dict(
    tie_word_embeddings=False,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    attn_layer_indices=None,
    attention_bias=False,
    mlp_bias=False,
    **mamba2.HYBRID_DEFAULTS,
)  # fmt: skip  (transformers' BambaConfig defaults, for fields a config.json leaves out)
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "mamba_n_heads", "mamba_d_head",
    "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
)  # fmt: skip


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in and
    checked (``layer_types`` derives the layers from ``attn_layer_indices``).

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    config = common.with_defaults(raw, MODEL_TYPES, DEFAULTS)
    mamba2.hybrid_defaults(config)
    mamba2.auto_head_dim(config)
    config["rope_parameters"].setdefault("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
    config.pop("layer_types", None)  # transformers derives it from attn_layer_indices
    check_config(config)
    return config


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's type, ``"full_attention"`` at ``attn_layer_indices``, else
    ``"linear_attention"`` (transformers' ``layers_block_type``)."""
    indices = config["attn_layer_indices"] or []
    return [
        "full_attention" if i in indices else "linear_attention"
        for i in range(config["num_hidden_layers"])
    ]


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` that is missing, of the wrong
    type, or that we do not support."""
    common.check_ints(config, INT_FIELDS)
    mamba2.check_inner_width(config, "mamba_expand", "mamba_n_heads", "mamba_d_head")
    common.check_divides(config, "mamba_n_groups", "mamba_n_heads")
    common.check_divides(config, "num_key_value_heads", "num_attention_heads")
    common.check_divides(config, "num_attention_heads", "hidden_size")
    indices = config["attn_layer_indices"]
    n = config["num_hidden_layers"]
    if indices is not None and (
        not isinstance(indices, list) or not all(common.is_int(i) and 0 <= i < n for i in indices)
    ):
        raise ValueError(
            f"config.json: attn_layer_indices must list layer indices below num_hidden_layers="
            f"{n}, got {indices!r}"
        )
    common.check_choice(config, "hidden_act", ("silu",))
    common.check_false(config, ("attention_bias", "mlp_bias"))
    common.check_bools(config, ("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings"))
    mamba2.check_epsilon_and_limit(config["rms_norm_eps"], config["time_step_limit"])
    rope = config["rope_parameters"]
    if rope["rope_type"] != "default" or rope["partial_rotary_factor"] != PARTIAL_ROTARY_FACTOR:
        raise ValueError(
            f"config.json: rope_parameters must have rope_type 'default' and "
            f"partial_rotary_factor {PARTIAL_ROTARY_FACTOR}, got {rope!r}"
        )


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``normalize_config`` config:
    the computation in ``dtype``, the parameters in ``param_dtype`` (None: ``dtype``). The
    blocks' and the final RMSNorm's epsilon is set on the built model (``finish``)."""
    heads = config["num_attention_heads"]
    return common.language_model_options(
        config,
        dtype,
        param_dtype,
        num_heads=heads,
        attention=[LAYER_KINDS[t] for t in layer_types(config)],
        kind_options={
            "mamba2": mamba2.hybrid_mixer_options(config),
            "softmax": dict(
                num_heads=heads,
                num_kv_heads=config["num_key_value_heads"],
                head_dim=config["hidden_size"] // heads,
                rope=True,
                rope_theta=float(config["rope_parameters"]["rope_theta"]),
                partial_rotary_factor=PARTIAL_ROTARY_FACTOR,
            ),
        },
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
    )


def finish(model, config: Mapping[str, Any]) -> None:
    """Sets the blocks' and the final RMSNorm's epsilon to ``rms_norm_eps``."""
    common.set_rms_norm_epsilon(model, config["rms_norm_eps"])


def config_from_model(model) -> dict[str, Any]:
    """The ``bamba`` config of a ``LanguageModel`` in Bamba's form (its dimensions read from
    the layers).

    Raises:
      ValueError: a model not of that form (scanned layers, a kind other than ``mamba2``
        and ``softmax``, an MLP other than SwiGLU, attention other than Llama's, layers of
        one kind with different sizes), naming what differs.
    """
    common.check_unrolled(model)
    fields: dict[str, Any] = {}
    width = model.embed.features
    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where = f"blocks[{i}]"
        if kind not in ("mamba2", "softmax"):
            raise ValueError(f"{where}: Bamba has mamba2 and softmax layers, got {kind!r}")
        if type(block.mlp).__name__ != "SwiGLU" or block.conv is not None:
            raise ValueError(f"{where}: Bamba's blocks have a SwiGLU MLP and no short_conv")
        if block.attention_norm.zero_centred or block.mlp_norm.zero_centred:
            raise ValueError(f"{where}: Bamba's RMSNorms are not zero-centred")
        common.agree(fields, "intermediate_size", block.mlp.gate_proj.out_features, where)
        a = block.attention
        if kind == "mamba2":
            mamba2.agree_hybrid_mixer(fields, a, where)
            continue
        llama = a.rotary_dim is not None and a.rotary_dim * 2 == a.head_dim
        llama = llama and not a.output_gate and a.q_norm is None and a.sliding_window is None
        if not llama or a.head_dim * a.num_heads != width:
            raise ValueError(
                f"{where}: Bamba's attention has RoPE on half of each head of hidden_size / "
                "num_attention_heads channels, no output gate, QK-norm or sliding window"
            )
        common.agree(fields, "num_attention_heads", a.num_heads, where)
        common.agree(fields, "num_key_value_heads", a.num_kv_heads, where)
        common.agree(fields, "rope_theta", a.rope_theta, where)
    theta = fields.pop("rope_theta", 10000.0)
    expand = mamba2.hybrid_expand(fields, width, "Bamba")
    return {
        "architectures": ["BambaForCausalLM"],
        "model_type": "bamba",
        **common.model_fields(model),
        "attn_layer_indices": [i for i, k in enumerate(model.layout) if k == "softmax"],
        "rms_norm_eps": mamba2.one_epsilon(model),
        "mamba_expand": expand,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
        },
        **fields,
    }


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: ``config_from_model``'s fields
    over ``config``'s others (``eos_token_id``, ``max_position_embeddings``, ...).

    Raises:
      ValueError: ``config_from_model``'s, or a field of ``config`` that describes another
        model (named).
    """
    derived = config_from_model(model)
    if config is not None and not any(k == "softmax" for k in model.layout):
        derived.pop("rope_parameters")  # nothing of the model uses RoPE: keep the config's
    merged = common.merge_for_save(derived, config, mamba2.UNCHECKED)
    return normalize_config(merged)


FORMAT = common.ModelFormat(
    name="Bamba",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=(PREFIX,),
    ignored_prefixes=common.tied_head_ignored,
    finish=finish,
)
