"""MiniMax-01 checkpoints in Hugging Face format (``MiniMaxForCausalLM``, ``model_type``
``minimax``) <-> ``LanguageModel``.

MiniMax-01 mixes lightning attention (the ``"linear_attention"`` layers of
``layer_types``, our ``"lightning"``: ``layers.LightningAttention``, its decays fixed by
the layer's index) and softmax attention (``"full_attention"``, our ``"softmax"``: Mixtral's,
GQA, no biases, RoPE on the whole head), every layer followed by a mixture of experts
(Mixtral's: a softmax router choosing ``num_experts_per_tok`` of ``num_local_experts``,
the chosen weights renormalised, SwiGLU experts of ``intermediate_size``, no shared
expert). Its blocks take the residual after the norm and scale both terms
(``normed_residual=True``)::

    h = input_layernorm(x);           x = alpha_a * h + beta_a * attention(h)
    h = post_attention_layernorm(x);  x = alpha_m * h + beta_m * moe(h)

``alpha_a, beta_a`` are ``linear_attn_{alpha,beta}_factor`` or
``full_attn_{alpha,beta}_factor`` by the layer's type, ``alpha_m, beta_m``
``mlp_{alpha,beta}_factor``. The weights (``nn.Linear``'s ``[out, in]`` is our ``[in, out]``):

==========================================================  =================================
Hugging Face (under ``model.``)                             ours
==========================================================  =================================
``embed_tokens.weight``                                     ``embed.embedding``
``norm.weight``                                             ``norm.scale``
``layers.{i}.input_layernorm.weight``                       ``blocks.{i}.attention_norm.scale``
``layers.{i}.post_attention_layernorm.weight``              ``blocks.{i}.mlp_norm.scale``
``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (softmax)    ``...attention.{q,k,v,out}_proj``
``layers.{i}.self_attn.qkv_proj.weight`` (lightning)        ``...attention.{q,k,v}_proj``
``layers.{i}.self_attn.output_gate.weight``                 ``...attention.output_gate``
``layers.{i}.self_attn.norm.weight``                        ``...attention.norm.scale``
``layers.{i}.self_attn.out_proj.weight``                    ``...attention.out_proj``
``layers.{i}.block_sparse_moe.gate.weight``                 ``blocks.{i}.mlp.router``
``layers.{i}.block_sparse_moe.experts.{j}.w1.weight``       ``blocks.{i}.mlp.gate[j]``
``layers.{i}.block_sparse_moe.experts.{j}.w3.weight``       ``blocks.{i}.mlp.up[j]``
``layers.{i}.block_sparse_moe.experts.{j}.w2.weight``       ``blocks.{i}.mlp.down[j]``
``lm_head.weight`` (untied only; not under ``model.``)      ``head.kernel``
==========================================================  =================================

``qkv_proj``'s rows are per head, ``[q_h | k_h | v_h]`` (``head_dim`` each) for each head
in turn. The experts are written per expert under ``block_sparse_moe.`` (as
``transformers`` saves them) and read that way or fused as ``transformers`` holds them in
memory (``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` ``[e, 2 * hidden, width]``, rows
``[w1 | w3]``, and ``mlp.experts.down_proj`` ``[e, width, hidden]``). The lightning layers'
buffers ``slope_rate``, ``query_decay``, ``key_decay`` and ``diagonal_decay`` follow from
the config (``layers.lightning.lightning_decays``): read past, not written (``transformers``
recomputes them). ``block_size`` is the chunk of ``transformers``' own form, with no effect
on the result; ``router_jitter_noise`` acts in ``transformers``' training only and is not
applied here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from linattn_jax.hf import common, qwen3_5_moe, tables
from linattn_jax.hf.tables import COPY, LINEAR

MODEL_TYPES = ("minimax",)
PREFIX = "model."
FUSED = qwen3_5_moe.FUSED
LAYER_KINDS = {"linear_attention": "lightning", "full_attention": "softmax"}
FACTORS = {
    "linear_attention": ("linear_attn_alpha_factor", "linear_attn_beta_factor"),
    "full_attention": ("full_attn_alpha_factor", "full_attn_beta_factor"),
    "mlp": ("mlp_alpha_factor", "mlp_beta_factor"),
}
BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
# transformers' MiniMaxConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
    sliding_window=None, num_experts_per_tok=2, num_local_experts=8, router_jitter_noise=0.0,
    block_size=256, **{field: 1 for pair in FACTORS.values() for field in pair},
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok",
    "num_local_experts", "block_size",
)  # fmt: skip

MODEL_RULES, NORM_RULES = tables.MODEL_RULES, tables.NORM_RULES
SOFTMAX_RULES = tables.ATTENTION_RULES
LIGHTNING_RULES = tables.rules(
    ("self_attn.output_gate.weight", "attention.output_gate.kernel", LINEAR),
    ("self_attn.norm.weight", "attention.norm.scale", COPY),
    ("self_attn.out_proj.weight", "attention.out_proj.kernel", LINEAR),
)
EXPERT_RULES = tables.rules(  # under block_sparse_moe.experts.{j}., slice j
    ("w1.weight", "mlp.gate", LINEAR),
    ("w3.weight", "mlp.up", LINEAR),
    ("w2.weight", "mlp.down", LINEAR),
)
ROUTER_RULES = tables.rules(("block_sparse_moe.gate.weight", "mlp.router", LINEAR))


def table(config: Mapping[str, Any], prefix: str) -> tables.Table:
    """Every tensor, in the model's order: the experts per expert, or fused for a
    ``prefix`` ending in ``FUSED``."""
    fused, prefix = prefix.endswith(FUSED), prefix.removesuffix(FUSED)
    qkv = tables.rules(
        (
            "self_attn.qkv_proj.weight",
            ("attention.q_proj.kernel", "attention.k_proj.kernel", "attention.v_proj.kernel"),
            tables.grouped(config["num_attention_heads"]),
        )
    )
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i, layer_type in enumerate(config["layer_types"]):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        own = SOFTMAX_RULES if layer_type == "full_attention" else qkv + LIGHTNING_RULES
        rows += tables.prefixed(NORM_RULES + own, layer, block)
        if fused:
            rows += tables.prefixed(
                qwen3_5_moe.ROUTER_RULES + qwen3_5_moe.FUSED_RULES, layer, block
            )
            continue
        rows += tables.prefixed(ROUTER_RULES, layer, block)
        n = config["num_local_experts"]
        rows += tables.experts(EXPERT_RULES, layer, block, n, "block_sparse_moe.experts.")
    return rows


def ignored(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The names not read: the lightning layers' derived buffers, and a tied head's copy."""
    names = tuple(
        f"{PREFIX}layers.{i}.self_attn.{buffer}"
        for i, t in enumerate(config["layer_types"])
        if t == "linear_attention"
        for buffer in BUFFERS
    )
    return names


def heads(config: common.Config) -> None:
    """``num_key_value_heads`` (``num_attention_heads``) and ``head_dim`` (``hidden_size /
    num_attention_heads``) where null, as ``transformers`` derives them."""
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config.get("num_attention_heads")
    if config.get("head_dim") is None and common.is_int(config.get("hidden_size")):
        n = config.get("num_attention_heads")
        if common.is_int(n) and n > 0:
            config["head_dim"] = config["hidden_size"] // n


def layers(config: common.Config) -> None:
    """``layer_types`` (``transformers``' default: full, linear, full, ...) checked."""
    n = config["num_hidden_layers"]
    if config.get("layer_types") is None:
        config["layer_types"] = [
            "full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)
        ]
    common.check_layer_types(config, LAYER_KINDS)


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning and softmax attention by ``layer_types``, every MLP a mixture, MiniMax's
    normed residuals with their alpha/beta factors."""
    factors = lambda kind: tuple(float(config[f]) for f in FACTORS[kind])
    head_dim = config["head_dim"]
    return dict(
        num_heads=config["num_attention_heads"],
        attention=[LAYER_KINDS[t] for t in config["layer_types"]],
        kind_options={
            "lightning": dict(head_dim=head_dim, attention_residual=factors("linear_attention")),
            "softmax": dict(
                num_kv_heads=config["num_key_value_heads"],
                head_dim=head_dim,
                rope=True,
                rope_theta=float(config["rope_parameters"]["rope_theta"]),
                attention_residual=factors("full_attention"),
            ),
        },
        mlp="moe",
        moe=dict(
            num_experts=config["num_local_experts"],
            top_k=config["num_experts_per_tok"],
            hidden=config["intermediate_size"],
            normalize=True,
        ),
        normed_residual=True,
        mlp_residual=factors("mlp"),
    )


def finish(model, config: Mapping[str, Any]) -> None:
    """The blocks' and the final RMSNorm's epsilon ``rms_norm_eps`` (the lightning layers'
    norm keeps transformers' own default, as MiniMax's does)."""
    eps = float(config["rms_norm_eps"])
    model.norm.epsilon = eps
    for block in model.blocks:
        block.attention_norm.epsilon = block.mlp_norm.epsilon = eps


FORMAT = common.ModelFormat(
    name="MiniMax",
    model_types=MODEL_TYPES,
    architecture="MiniMaxForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        heads,
        common.ints(INT_FIELDS),
        common.divides("num_key_value_heads", "num_attention_heads"),
        layers,
        common.at_most("num_experts_per_tok", "num_local_experts"),
        common.unsupported({"hidden_act": "silu", "sliding_window": (None,)}),
        common.numbers([f for pair in FACTORS.values() for f in pair] + ["rms_norm_eps"]),
        common.bools(("tie_word_embeddings",)),
        common.plain_rope(1e6),
    ),
    options=options,
    table=table,
    prefixes=(PREFIX, PREFIX + FUSED),
    ignored=ignored,
    finish=finish,
)
