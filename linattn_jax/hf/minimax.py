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

import jax.numpy as jnp
from flax import nnx

from linattn_jax.hf import common, qwen3_5_moe, qwen3_next
from linattn_jax.layers.lightning import LightningAttention
from linattn_jax.layers.moe import MoE, RouterLosses

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
DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    sliding_window=None,
    num_experts_per_tok=2,
    num_local_experts=8,
    router_jitter_noise=0.0,
    block_size=256,
    **{field: 1 for pair in FACTORS.values() for field in pair},
)  # transformers' MiniMaxConfig defaults, for the fields a config.json leaves out
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok",
    "num_local_experts", "block_size",
)  # fmt: skip
UNCHECKED = ("architectures", "dtype", "torch_dtype", "transformers_version")

MODEL_RULES, HEAD_RULE, NORM_RULES = common.MODEL_RULES, common.HEAD_RULE, common.NORM_RULES
SOFTMAX_RULES = common.ATTENTION_RULES
LIGHTNING_RULES = common.rules(
    ("self_attn.output_gate.weight", "attention.output_gate.kernel", "linear"),
    ("self_attn.norm.weight", "attention.norm.scale", "copy"),
    ("self_attn.out_proj.weight", "attention.out_proj.kernel", "linear"),
)
EXPERT_RULES = common.rules(  # under block_sparse_moe.experts.{j}., slice j
    ("w1.weight", "mlp.gate", "linear"),
    ("w3.weight", "mlp.up", "linear"),
    ("w2.weight", "mlp.down", "linear"),
)
ROUTER_RULES = common.rules(("block_sparse_moe.gate.weight", "mlp.router", "linear"))


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's type, ``"full_attention"`` or ``"linear_attention"``."""
    return list(config["layer_types"])


def weight_table(config: Mapping[str, Any], prefix: str = PREFIX) -> list[tuple[str, Any]]:
    """Every tensor of a checkpoint of ``config`` (``normalize_config``'s), in the model's
    order: the experts per expert, or fused for a ``prefix`` ending in ``FUSED``."""
    fused, prefix = prefix.endswith(FUSED), prefix.removesuffix(FUSED)
    qkv = common.rules(
        (
            "self_attn.qkv_proj.weight",
            ("attention.q_proj.kernel", "attention.k_proj.kernel", "attention.v_proj.kernel"),
            qwen3_next.grouped_conversion(config["num_attention_heads"]),
        )
    )
    rows = [(prefix + r.hf, r) for r in MODEL_RULES]
    for i, layer_type in enumerate(layer_types(config)):
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        own = SOFTMAX_RULES if layer_type == "full_attention" else qkv + LIGHTNING_RULES
        rows += common.prefixed(NORM_RULES + own, layer, block)
        if fused:
            rows += common.prefixed(
                qwen3_5_moe.ROUTER_RULES + qwen3_5_moe.FUSED_RULES, layer, block
            )
            continue
        rows += common.prefixed(ROUTER_RULES, layer, block)
        for j in range(config["num_local_experts"]):
            expert = f"{layer}block_sparse_moe.experts.{j}."
            rows += common.prefixed(EXPERT_RULES, expert, block, j)
    if not config["tie_word_embeddings"]:
        rows.append((HEAD_RULE.hf, HEAD_RULE))
    return rows


def ignored_prefixes(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The names not read: the lightning layers' derived buffers, and a tied head's copy."""
    names = tuple(
        f"{PREFIX}layers.{i}.self_attn.{buffer}"
        for i, t in enumerate(layer_types(config))
        if t == "linear_attention"
        for buffer in BUFFERS
    )
    return names + common.tied_head_ignored(config)


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents with ``transformers``' defaults filled in, checked.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    config = common.with_defaults(raw, MODEL_TYPES, DEFAULTS)
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = config.get("num_attention_heads")
    if config.get("head_dim") is None and common.is_int(config.get("hidden_size")):
        heads = config.get("num_attention_heads")
        if common.is_int(heads) and heads > 0:
            config["head_dim"] = config["hidden_size"] // heads
    common.check_ints(config, INT_FIELDS)
    common.check_divides(config, "num_key_value_heads", "num_attention_heads")
    n = config["num_hidden_layers"]
    if config.get("layer_types") is None:  # transformers' default: full, linear, full, ...
        config["layer_types"] = [
            "full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)
        ]
    common.check_layer_types(config, LAYER_KINDS)
    common.check_at_most(config, "num_experts_per_tok", "num_local_experts")
    common.check_unsupported(config, {"hidden_act": "silu", "sliding_window": (None,)})
    for field in [f for pair in FACTORS.values() for f in pair] + ["rms_norm_eps"]:
        if not common.is_number(config[field]):
            raise ValueError(f"config.json: {field} must be a number, got {config[field]!r}")
    common.check_bools(config, ("tie_word_embeddings",))
    rope = common.rope_parameters(config, 1e6)
    if rope["rope_type"] != "default" or not common.is_number(rope["rope_theta"]):
        raise ValueError(
            f"config.json: rope_parameters must have rope_type 'default' and a number "
            f"rope_theta, got {rope!r}"
        )
    config["rope_parameters"] = rope
    config.pop("rope_theta", None)
    return config


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) for a ``normalize_config`` config
    (the blocks' and the final RMSNorm's epsilon is set by ``finish``)."""
    factors = lambda kind: tuple(float(config[f]) for f in FACTORS[kind])
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    return common.language_model_options(
        config,
        dtype,
        param_dtype,
        num_heads=heads,
        attention=[LAYER_KINDS[t] for t in layer_types(config)],
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
    own norm keeps ``transformers``' 1e-6); the MoE losses' record zeroed."""
    eps = float(config["rms_norm_eps"])
    model.norm.epsilon = eps
    for block in model.blocks:
        block.attention_norm.epsilon = block.mlp_norm.epsilon = eps
    for _, node in nnx.iter_graph(model):
        if isinstance(node, RouterLosses):  # not a weight: the record starts at zero
            node.set_value(jnp.zeros(2, jnp.float32))


def config_from_model(model) -> dict[str, Any]:
    """The ``minimax`` config of a ``LanguageModel`` in MiniMax-01's form.

    Raises:
      ValueError: a model not of that form (scanned layers, kinds other than
        ``lightning`` and ``softmax``, blocks without ``normed_residual`` or without a MoE of
        Mixtral's router, layers of one kind with different sizes), naming what differs.
    """
    common.check_unrolled(model)
    fields: dict[str, Any] = {}
    types, eps = [], None
    for i, (kind, block) in enumerate(zip(model.layout, model.blocks, strict=True)):
        where, mlp, a = f"blocks[{i}]", block.mlp, block.attention
        if kind not in ("lightning", "softmax"):
            raise ValueError(f"{where}: MiniMax has lightning and softmax layers, got {kind!r}")
        if not block.normed_residual or block.conv is not None:
            raise ValueError(f"{where}: MiniMax's blocks have normed_residual and no short_conv")
        if block.attention_norm.zero_centred or block.mlp_norm.zero_centred:
            raise ValueError(f"{where}: MiniMax's RMSNorms are not zero-centred")
        if not isinstance(mlp, MoE) or (
            mlp.score,
            mlp.normalize,
            mlp.scaling,
            mlp.bias,
            mlp.num_groups,
            mlp.shared,
        ) != ("softmax", True, 1.0, None, 1, None):
            raise ValueError(
                f"{where}: MiniMax's MLP is a MoE with a softmax router, normalised top-k "
                "weights, no scaling, bias, groups or shared expert"
            )
        for field, value in (
            ("num_local_experts", mlp.num_experts),
            ("num_experts_per_tok", mlp.top_k),
            ("intermediate_size", mlp.gate.shape[-1]),
            ("num_attention_heads", a.num_heads),
            ("head_dim", a.head_dim),
            ("rms_norm_eps", block.attention_norm.epsilon),
            ("rms_norm_eps", block.mlp_norm.epsilon),
        ):
            common.agree(fields, field, value, where)
        for field, value in zip(FACTORS["mlp"], block.mlp_residual, strict=True):
            common.agree(fields, field, value, where)
        layer_type = "linear_attention" if kind == "lightning" else "full_attention"
        for field, value in zip(FACTORS[layer_type], block.attention_residual, strict=True):
            common.agree(fields, field, value, where)
        types.append(layer_type)
        if kind == "lightning":
            if not isinstance(a, LightningAttention) or (a.layer_index, a.num_layers) != (
                i,
                model.depth,
            ):
                raise ValueError(f"{where}: its lightning layer is not layer {i} of {model.depth}")
            continue
        if (
            a.rotary_dim != a.head_dim
            or a.output_gate
            or a.q_norm is not None
            or (a.sliding_window is not None)
        ):
            raise ValueError(
                f"{where}: MiniMax's attention has RoPE on the whole head and no output gate, "
                "QK-norm or sliding window"
            )
        common.agree(fields, "num_key_value_heads", a.num_kv_heads, where)
        common.agree(fields, "rope_theta", a.rope_theta, where)
    eps = fields.get("rms_norm_eps")
    if model.norm.epsilon != eps or model.norm.zero_centred:
        raise ValueError(f"the final norm's epsilon {model.norm.epsilon} differs from the blocks'")
    theta = fields.pop("rope_theta", None)
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    for pair in FACTORS.values():  # transformers writes them as given: keep 1 an int
        for field in pair:
            fields.setdefault(field, 1)
            if fields[field] == int(fields[field]):
                fields[field] = int(fields[field])
    derived = {
        "architectures": ["MiniMaxForCausalLM"],
        "model_type": "minimax",
        **common.model_fields(model),
        "layer_types": types,
        "hidden_act": "silu",
        **fields,
    }
    if theta is not None:
        derived["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return derived


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: ``config_from_model``'s fields
    over ``config``'s others.

    Raises:
      ValueError: ``config_from_model``'s, or a field of ``config`` that describes another
        model (named).
    """
    derived = config_from_model(model)
    if config is not None:
        config = normalize_config(config)
        if "rope_parameters" not in derived:  # no softmax layer: the config's RoPE stands
            derived["rope_parameters"] = config["rope_parameters"]
    return normalize_config(common.merge_for_save(derived, config, UNCHECKED))


FORMAT = common.ModelFormat(
    name="MiniMax",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=(PREFIX, PREFIX + FUSED),
    ignored_prefixes=ignored_prefixes,
    finish=finish,
)
