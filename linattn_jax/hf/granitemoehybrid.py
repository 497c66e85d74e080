"""Granite-4.0-H checkpoints in Hugging Face format (``GraniteMoeHybridForCausalLM``,
``model_type`` ``granitemoehybrid``) <-> ``LanguageModel``: the config's fields as the
model's options, and the one table of weights.

Granite-4.0-H is a hybrid of Mamba-2 mixers (``"linear_attention"`` layers, our
``"mamba2"``, Bamba's mixer: ``hf.mamba2``'s rows under ``mamba.``) and softmax attention
(``"full_attention"``, our ``"softmax"``), every layer followed by a mixture of SwiGLU
experts plus a shared SwiGLU MLP (``layers.MoE`` with ``shared_hidden``, ungated), or by the
shared MLP alone when ``num_local_experts`` is 0 (a dense model: our ``"swiglu"``). Its
conventions, each mapped to an option of ours:

* muP-style multipliers: the embeddings times ``embedding_multiplier`` (our
  ``LanguageModel(embedding_multiplier=...)``), each half-block's output times
  ``residual_multiplier`` before the residual add (``TransformerBlock(residual_multiplier=...)``),
  the attention scores times ``attention_multiplier`` in place of ``head_dim ** -0.5``
  (``SoftmaxAttention(scale=...)``), the logits divided by ``logits_scaling``
  (``LanguageModel(logits_scaling=...)``);
* the router is a linear map (``block_sparse_moe.router.layer.weight`` ``[e, width]``) whose
  top ``num_experts_per_tok`` logits are softmaxed: a softmax over all experts with the
  chosen weights renormalised (``MoE(score="softmax", normalize=True)``); the experts are
  stored fused: ``block_sparse_moe.input_linear.weight`` ``[e, 2 * hidden, width]`` (rows
  ``[gate | up]``), ``block_sparse_moe.output_linear.weight`` ``[e, width, hidden]``; the
  shared MLP is ``shared_mlp.input_linear.weight`` ``[2 * shared, width]`` (rows ``[gate |
  up]``) and ``shared_mlp.output_linear.weight``;
* attention is Llama's (GQA, no biases, ``head_dim = hidden_size / num_attention_heads``)
  with RoPE (``rotate_half``, the whole head) when ``position_embedding_type`` is
  ``"rope"``, none when it is null;
* every RMSNorm's epsilon is ``rms_norm_eps``; ``nn.Linear`` weights are ``[out, in]``, our
  kernels ``[in, out]``.

The tensors live under ``model.`` (``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from linattn_jax.hf import (
    bamba,
    common,
    mamba2,
    qwen3_5_moe,  # noqa: F401  (registers the experts' conversions)
)
from linattn_jax.hf.common import Rule
from linattn_jax.layers.moe import MoE, RouterLosses

MODEL_TYPES = ("granitemoehybrid",)
PREFIX = "model."
LAYER_KINDS = {"linear_attention": "mamba2", "full_attention": "softmax"}
# Released Granite-4.0-H configs name the layer types so; transformers renames them on load.
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier")

MODEL_RULES, HEAD_RULE, BLOCK_RULES = common.MODEL_RULES, common.HEAD_RULE, common.NORM_RULES
ATTENTION_RULES = common.ATTENTION_RULES
# "experts_gate_up" and "experts_linear" are hf.qwen3_5_moe's conversions (imported above).
MOE_RULES = common.rules(
    ("block_sparse_moe.router.layer.weight", "mlp.router", "linear"),
    ("block_sparse_moe.input_linear.weight", ("mlp.gate", "mlp.up"), "experts_gate_up"),
    ("block_sparse_moe.output_linear.weight", "mlp.down", "experts_linear"),
    (
        "shared_mlp.input_linear.weight",
        ("mlp.shared.gate_proj.kernel", "mlp.shared.up_proj.kernel"),
        "split",
    ),
    ("shared_mlp.output_linear.weight", "mlp.shared.down_proj.kernel", "linear"),
)
DENSE_RULES = common.rules(  # num_local_experts 0: the shared MLP is the block's SwiGLU
    ("shared_mlp.input_linear.weight", ("mlp.gate_proj.kernel", "mlp.up_proj.kernel"), "split"),
    ("shared_mlp.output_linear.weight", "mlp.down_proj.kernel", "linear"),
)


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, Rule]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s): ``(its full
    Hugging Face name, the Rule with our full paths)``, in the model's order."""
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    mixer = mamba2.hybrid_mixer_rules(config)
    mlp = MOE_RULES if config["num_local_experts"] else DENSE_RULES
    for i, layer_type in enumerate(config["layer_types"]):
        own = mixer if layer_type == "linear_attention" else ATTENTION_RULES
        rows += common.prefixed(BLOCK_RULES + own + mlp, f"{prefix}layers.{i}.", f"blocks.{i}.")
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


# ---------------------------------------------------------------------------- the config

DEFAULTS = dict(
    tie_word_embeddings=False,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    attention_bias=False,
    embedding_multiplier=1.0,
    logits_scaling=1.0,
    residual_multiplier=1.0,
    attention_multiplier=1.0,
    num_local_experts=8,
    num_experts_per_tok=2,
    shared_intermediate_size=1024,
    position_embedding_type=None,
    layer_types=None,
    **mamba2.HYBRID_DEFAULTS,
)  # fmt: skip  (transformers' GraniteMoeHybridConfig defaults, for fields a config.json leaves out)
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "shared_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "mamba_n_heads",
    "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
)  # fmt: skip
UNCHECKED = mamba2.UNCHECKED


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in and checked.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    config = common.with_defaults(
        raw, MODEL_TYPES, DEFAULTS, keep_none=("position_embedding_type",)
    )
    mamba2.hybrid_defaults(config)
    mamba2.auto_head_dim(config)
    if config["layer_types"] is None and "layers_block_type" in config:  # the older name
        config["layer_types"] = config.pop("layers_block_type")
    if isinstance(config["layer_types"], list):  # the Hub's configs: "mamba", "attention"
        config["layer_types"] = [LEGACY_LAYER_TYPES.get(t, t) for t in config["layer_types"]]
    if config["layer_types"] is None and common.is_int(config.get("num_hidden_layers")):
        config["layer_types"] = ["linear_attention"] * config["num_hidden_layers"]
    check_config(config)
    return config


def check_config(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the field of ``config`` that is missing, of the wrong
    type, or that we do not support."""
    common.check_ints(config, INT_FIELDS)
    common.check_ints(config, ("num_local_experts",), minimum=0)
    mamba2.check_inner_width(config, "mamba_expand", "mamba_n_heads", "mamba_d_head")
    common.check_divides(config, "mamba_n_groups", "mamba_n_heads")
    common.check_divides(config, "num_key_value_heads", "num_attention_heads")
    common.check_divides(config, "num_attention_heads", "hidden_size")
    if config["num_local_experts"]:
        common.check_ints(config, ("num_experts_per_tok",))
        common.check_at_most(config, "num_experts_per_tok", "num_local_experts")
    types = config["layer_types"]
    if (
        not isinstance(types, list)
        or len(types) != config["num_hidden_layers"]
        or any(t not in LAYER_KINDS for t in types)
    ):
        raise ValueError(
            f"config.json: layer_types must list num_hidden_layers={config['num_hidden_layers']} "
            f"of {tuple(LAYER_KINDS)}, got {types!r}"
        )
    common.check_positive(config, (*MULTIPLIERS, "logits_scaling"))
    common.check_choice(config, "position_embedding_type", (None, "rope"))
    common.check_choice(config, "hidden_act", ("silu",))
    common.check_false(config, ("attention_bias",))
    common.check_bools(config, ("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings"))
    bamba.check_config(
        {
            **config,
            "model_type": "bamba",
            "attn_layer_indices": None,
            "mlp_bias": False,
            "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": 0.5},
        }
    )  # its epsilon and time-step checks
    if config["rope_parameters"]["rope_type"] != "default":
        raise ValueError(
            f"config.json: rope_parameters must have rope_type 'default', got "
            f"{config['rope_parameters']!r}"
        )


def moe_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """``layers.MoE``'s options of a normalised config with experts."""
    return dict(
        num_experts=config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        hidden=config["intermediate_size"],
        normalize=True,
        shared_hidden=config["shared_intermediate_size"],
    )


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``normalize_config`` config:
    the computation in ``dtype``, the parameters in ``param_dtype`` (None: ``dtype``). The
    RMSNorms' epsilon is set on the built model (``finish``)."""
    heads = config["num_attention_heads"]
    rope = config["position_embedding_type"] == "rope"
    softmax = dict(
        num_heads=heads,
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["hidden_size"] // heads,
        scale=float(config["attention_multiplier"]),
        rope=rope,
    )
    if rope:
        softmax.update(rope_theta=float(config["rope_parameters"]["rope_theta"]))
    experts = config["num_local_experts"]
    mlp = dict(mlp="moe", moe=moe_options(config)) if experts else dict(mlp="swiglu")
    return common.language_model_options(
        config,
        dtype,
        param_dtype,
        num_heads=heads,
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options={
            "mamba2": mamba2.hybrid_mixer_options(config),
            "softmax": softmax,
        },
        mlp_hidden=config["intermediate_size" if experts else "shared_intermediate_size"],
        embedding_multiplier=float(config["embedding_multiplier"]),
        logits_scaling=float(config["logits_scaling"]),
        residual_multiplier=float(config["residual_multiplier"]),
        **mlp,
    )


def finish(model, config: Mapping[str, Any]) -> None:
    """Sets the blocks' and the final RMSNorm's epsilon to ``rms_norm_eps``; the router
    losses' record starts at zero (not a weight)."""
    common.set_rms_norm_epsilon(model, config["rms_norm_eps"])
    for _, node in nnx.iter_graph(model):
        if isinstance(node, RouterLosses):
            node.set_value(jnp.zeros(2, jnp.float32))


def config_from_model(model) -> dict[str, Any]:
    """The ``granitemoehybrid`` config of a ``LanguageModel`` in Granite-4.0-H's form (its
    dimensions and multipliers read from the layers).

    Raises:
      ValueError: a model not of that form (scanned layers, a kind other than ``mamba2``
        and ``softmax``, an MLP other than Granite's mixture or SwiGLU, attention other
        than Llama's, layers of one kind with different sizes), naming what differs.
    """
    common.check_unrolled(model)
    fields: dict[str, Any] = {}
    width = model.embed.features
    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where, mlp = f"blocks[{i}]", block.mlp
        if kind not in LAYER_KINDS.values():
            raise ValueError(f"{where}: Granite-4.0-H has mamba2 and softmax layers, got {kind!r}")
        if block.conv is not None or block.attention_norm.zero_centred:
            raise ValueError(
                f"{where}: Granite-4.0-H's blocks have no short_conv and plain RMSNorms"
            )
        common.agree(fields, "residual_multiplier", block.residual_multiplier, where)
        if isinstance(mlp, MoE):
            plain = (mlp.score, mlp.normalize, mlp.scaling, mlp.bias, mlp.num_groups) == (
                "softmax", True, 1.0, None, 1,
            )  # fmt: skip
            if not plain or mlp.shared is None or mlp.shared_gate is not None:
                raise ValueError(
                    f"{where}: Granite-4.0-H's MoE has a softmax router, normalised top-k "
                    "weights, no scaling, bias or groups, and an ungated shared MLP"
                )
            common.agree(fields, "num_local_experts", mlp.num_experts, where)
            common.agree(fields, "num_experts_per_tok", mlp.top_k, where)
            common.agree(fields, "intermediate_size", mlp.gate.shape[-1], where)
            common.agree(
                fields, "shared_intermediate_size", mlp.shared.gate_proj.out_features, where
            )
        elif type(mlp).__name__ == "SwiGLU":
            common.agree(fields, "num_local_experts", 0, where)
            common.agree(fields, "shared_intermediate_size", mlp.gate_proj.out_features, where)
        else:
            raise ValueError(f"{where}: Granite-4.0-H's blocks have a MoE or a SwiGLU MLP")
        a = block.attention
        if kind == "mamba2":
            mamba2.agree_hybrid_mixer(fields, a, where)
            continue
        rope = a.rotary_dim is not None
        llama = (not rope or a.rotary_dim == a.head_dim) and not a.output_gate
        llama = llama and a.q_norm is None and a.sliding_window is None
        if not llama or a.head_dim * a.num_heads != width:
            raise ValueError(
                f"{where}: Granite-4.0-H's attention has RoPE on whole heads or none, heads of "
                "hidden_size / num_attention_heads channels, no output gate, QK-norm "
                "or sliding window"
            )
        common.agree(fields, "num_attention_heads", a.num_heads, where)
        common.agree(fields, "num_key_value_heads", a.num_kv_heads, where)
        scale = a.head_dim**-0.5 if a.scale is None else a.scale
        common.agree(fields, "attention_multiplier", scale, where)
        common.agree(fields, "position_embedding_type", "rope" if rope else None, where)
        if rope:
            common.agree(fields, "rope_theta", a.rope_theta, where)
    theta = fields.pop("rope_theta", 10000.0)
    expand = mamba2.hybrid_expand(fields, width, "Granite-4.0-H")
    if not fields["num_local_experts"]:
        fields.setdefault("intermediate_size", fields["shared_intermediate_size"])
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        **common.model_fields(model),
        "layer_types": [{v: k for k, v in LAYER_KINDS.items()}[k] for k in model.layout],
        "rms_norm_eps": mamba2.one_epsilon(model),
        "mamba_expand": expand,
        "hidden_act": "silu",
        "attention_bias": False,
        "embedding_multiplier": model.embedding_multiplier,
        "logits_scaling": model.logits_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
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
    if config is not None:
        if derived.get("position_embedding_type") is None:
            derived.pop("rope_parameters")  # nothing of the model uses RoPE: keep the config's
        if "attention_multiplier" not in derived:  # no attention layer
            derived.pop("position_embedding_type", None)
        if not derived["num_local_experts"] and "intermediate_size" in config:
            derived.pop("intermediate_size")  # unread by a dense model
    merged = common.merge_for_save(derived, config, UNCHECKED)
    return normalize_config(merged)


FORMAT = common.ModelFormat(
    name="Granite-4.0-H",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=(PREFIX,),
    ignored_prefixes=common.tied_head_ignored,
    finish=finish,
)
