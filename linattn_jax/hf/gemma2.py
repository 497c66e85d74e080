"""Gemma 2 checkpoints (``Gemma2ForCausalLM``, ``model_type`` ``gemma2``): Llama with

* every RMSNorm in Gemma's ``x * (1 + w)`` form (``zero_centred_norm``) and four per
  layer: ``input_layernorm`` and ``post_attention_layernorm`` around the attention,
  ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP
  (``sandwich_norm``); a GeGLU MLP (``gelu_pytorch_tanh``: our ``"geglu"``);
* the embeddings times ``sqrt(hidden_size)`` (``embedding_multiplier``);
* the scores times ``query_pre_attn_scalar ** -0.5`` and soft-capped,
  ``cap * tanh(s / cap)`` with ``attn_logit_softcapping``, the logits with
  ``final_logit_softcapping`` (null: none);
* ``layer_types``' sliding layers (by default every other one from the first) over
  ``sliding_window`` tokens (our ``"local_softmax"``); projection biases with
  ``attention_bias``; ``head_dim`` 256 and tied embeddings unless given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, llama, rope, tables
from linattn_jax.hf.tables import COPY, rules

# transformers' Gemma2Config defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
    tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
    sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    use_bidirectional_attention=None,
)  # fmt: skip
NULLABLE = ("sliding_window", "final_logit_softcapping", "attn_logit_softcapping")
NORM_RULES = rules(
    ("input_layernorm.weight", "attention_norm.scale", COPY),
    ("post_attention_layernorm.weight", "attention_post_norm.scale", COPY),
    ("pre_feedforward_layernorm.weight", "mlp_norm.scale", COPY),
    ("post_feedforward_layernorm.weight", "mlp_post_norm.scale", COPY),
)


def layer_rules(config: Mapping[str, Any], *more: tables.Rule) -> tuple[tables.Rule, ...]:
    """A layer's rows: its four norms, its attention (with ``more`` rows), its MLP."""
    attention = llama.attention_rules(*(config["attention_bias"],) * 2) + more
    return NORM_RULES + attention + tables.MLP_RULES


def layer_types(pattern: int, field: str | None = None) -> common.Step:
    """The step filling in ``layer_types`` where absent (a full layer every ``pattern``-th,
    or ``config[field]``-th where given, the others sliding) and checking Gemma's fields."""

    def step(config: common.Config) -> None:
        if config.get("layer_types") is None:
            if field is not None:
                config.setdefault(field, pattern)
                common.check_ints(config, (field,))
            pattern_ = config[field] if field is not None else pattern
            config["layer_types"] = [
                "full_attention" if (i + 1) % pattern_ == 0 else "sliding_attention"
                for i in range(config["num_hidden_layers"])
            ]
        llama.check_windows(config)
        common.check_choice(config, "hidden_activation", ("gelu_pytorch_tanh",))
        common.check_unsupported(config, {"use_bidirectional_attention": False})
        common.check_bools(config, ("attention_bias",))
        common.check_positive(config, ("query_pre_attn_scalar",))
        caps = [f for f in NULLABLE[1:] if config[f] is not None]
        common.check_positive(config, caps)

    return step


def attention_options(config: Mapping[str, Any], **more: Any) -> dict[str, Any]:
    """Gemma's attention options (beside ``llama.softmax_options``'), with ``more``."""
    bias = config["attention_bias"]
    return dict(
        scale=float(config["query_pre_attn_scalar"]) ** -0.5,
        logit_soft_cap=config["attn_logit_softcapping"],
        qkv_bias=bias,
        out_bias=bias,
        **more,
    )


def model_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma's model options (beside ``llama.windowed_options``')."""
    return dict(
        zero_centred_norm=True,
        sandwich_norm=True,
        embedding_multiplier=config["hidden_size"] ** 0.5,
        logit_soft_cap=config["final_logit_softcapping"],
    )


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The layers of ``layer_types``, Gemma's attention, GeGLU MLPs, Gemma's norms."""
    softmax = llama.softmax_options(config, **attention_options(config))
    local = dict(softmax, sliding_window=config["sliding_window"])
    return {**llama.windowed_options(config, softmax, local, mlp="geglu"), **model_options(config)}


FORMAT = llama.FORMAT.derive(
    name="Gemma 2",
    model_types=("gemma2",),
    architecture="Gemma2ForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=NULLABLE),
        *llama.SIZE_CHECKS,
        rope.parameters(10000.0),
        layer_types(2),
    ),
    options=options,
    table=tables.layered(
        tables.MODEL_RULES,
        lambda config, i: (
            NORM_RULES + llama.attention_rules(*(config["attention_bias"],) * 2) + tables.MLP_RULES
        ),
    ),
)
