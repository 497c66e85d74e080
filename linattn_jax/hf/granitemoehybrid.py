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
  ``"rope"``, none otherwise (null, or ``"nope"`` as every Granite-4.0-H release says:
  ``transformers`` applies RoPE only for ``"rope"``);
* every RMSNorm's epsilon is ``rms_norm_eps``; ``nn.Linear`` weights are ``[out, in]``, our
  kernels ``[in, out]``.

The tensors live under ``model.`` (``lm_head.weight`` apart, untied only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import bamba, common, mamba2, tables
from linattn_jax.hf.tables import EXPERTS_GATE_UP, EXPERTS_LINEAR, LINEAR, SPLIT, Rule

MODEL_TYPES = ("granitemoehybrid",)
LAYER_KINDS = bamba.LAYER_KINDS
# Released Granite-4.0-H configs name the layer types so; transformers renames them on load.
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier")

MODEL_RULES, BLOCK_RULES = tables.MODEL_RULES, tables.NORM_RULES
ATTENTION_RULES = tables.ATTENTION_RULES
MOE_RULES = tables.rules(
    ("block_sparse_moe.router.layer.weight", "mlp.router", LINEAR),
    ("block_sparse_moe.input_linear.weight", ("mlp.gate", "mlp.up"), EXPERTS_GATE_UP),
    ("block_sparse_moe.output_linear.weight", "mlp.down", EXPERTS_LINEAR),
    (
        "shared_mlp.input_linear.weight",
        ("mlp.shared.gate_proj.kernel", "mlp.shared.up_proj.kernel"),
        SPLIT,
    ),
    ("shared_mlp.output_linear.weight", "mlp.shared.down_proj.kernel", LINEAR),
)
DENSE_RULES = tables.rules(  # num_local_experts 0: the shared MLP is the block's SwiGLU
    ("shared_mlp.input_linear.weight", ("mlp.gate_proj.kernel", "mlp.up_proj.kernel"), SPLIT),
    ("shared_mlp.output_linear.weight", "mlp.down_proj.kernel", LINEAR),
)


def layer_rules(config: Mapping[str, Any], i: int) -> tuple[Rule, ...]:
    """Layer ``i``'s rows: its norms, its mixer or attention, its MLP."""
    mixer = config["layer_types"][i] == "linear_attention"
    own = bamba.hybrid_mixer_rules(config) if mixer else ATTENTION_RULES
    return BLOCK_RULES + own + (MOE_RULES if config["num_local_experts"] else DENSE_RULES)


# ---------------------------------------------------------------------------- the config

# transformers' GraniteMoeHybridConfig defaults, for fields a config.json leaves out.
DEFAULTS = dict(
    tie_word_embeddings=False, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
    embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
    attention_multiplier=1.0, num_local_experts=8, num_experts_per_tok=2,
    shared_intermediate_size=1024, position_embedding_type=None, layer_types=None,
    **bamba.HYBRID_DEFAULTS,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "shared_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "mamba_n_heads",
    "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
)  # fmt: skip


def granite_layout(config: common.Config) -> None:
    """``layer_types`` as ``transformers`` reads it: the older ``layers_block_type``, the
    Hub's ``"mamba"`` and ``"attention"``, every layer Mamba-2 when absent."""
    if config["layer_types"] is None and "layers_block_type" in config:  # the older name
        config["layer_types"] = config.pop("layers_block_type")
    if isinstance(config["layer_types"], list):
        config["layer_types"] = [LEGACY_LAYER_TYPES.get(t, t) for t in config["layer_types"]]
    if config["layer_types"] is None and common.is_int(config.get("num_hidden_layers")):
        config["layer_types"] = ["linear_attention"] * config["num_hidden_layers"]


def check_experts(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming a bad mixture field or layer type."""
    common.check_ints(config, ("num_local_experts",), minimum=0)
    if config["num_local_experts"]:
        common.check_ints(config, ("num_experts_per_tok",))
        common.check_at_most(config, "num_experts_per_tok", "num_local_experts")
    common.check_layer_types(config, tuple(LAYER_KINDS))


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Bamba's layers with Granite's multipliers, each MLP a ``MoE`` with a shared SwiGLU
    (or that SwiGLU alone: no experts)."""
    rope = config["position_embedding_type"] == "rope"
    theta = dict(rope_theta=float(config["rope_parameters"]["rope_theta"])) if rope else {}
    softmax = bamba.llama_attention(
        config, scale=float(config["attention_multiplier"]), rope=rope, **theta
    )
    experts = config["num_local_experts"]
    moe = dict(
        num_experts=experts,
        top_k=config["num_experts_per_tok"],
        hidden=config["intermediate_size"],
        normalize=True,
        shared_hidden=config["shared_intermediate_size"],
    )
    return dict(
        num_heads=config["num_attention_heads"],
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options={"mamba2": bamba.hybrid_mixer_options(config), "softmax": softmax},
        mlp_hidden=config["intermediate_size" if experts else "shared_intermediate_size"],
        embedding_multiplier=float(config["embedding_multiplier"]),
        logits_scaling=float(config["logits_scaling"]),
        residual_multiplier=float(config["residual_multiplier"]),
        **(dict(mlp="moe", moe=moe) if experts else dict(mlp="swiglu")),
    )


FORMAT = bamba.FORMAT.derive(
    name="Granite-4.0-H",
    model_types=MODEL_TYPES,
    architecture="GraniteMoeHybridForCausalLM",
    steps=(
        common.defaults(DEFAULTS, keep_none=("position_embedding_type",)),
        *bamba.HYBRID_STEPS,
        granite_layout,
        common.ints(INT_FIELDS),
        *bamba.HYBRID_CHECKS,
        check_experts,
        common.positive((*MULTIPLIERS, "logits_scaling")),
        common.choice("position_embedding_type", (None, "rope", "nope")),
        common.choice("hidden_act", ("silu",)),
        common.false(("attention_bias",)),
        common.bools(("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings")),
        mamba2.epsilon_and_limit("rms_norm_eps"),
        bamba.check_default_rope,
    ),
    options=options,
    table=tables.layered(MODEL_RULES, layer_rules),
)
