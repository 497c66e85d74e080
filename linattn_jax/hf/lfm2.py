"""LFM2 checkpoints (``Lfm2ForCausalLM``, ``model_type`` ``lfm2``): Liquid AI's hybrid of
gated short convolutions and GQA softmax attention.

Each layer of ``layer_types`` (by default from ``full_attn_idxs``: the attention layers'
indices, all of them when null) is ``"conv"``, our ``"gated_conv"`` kind
(``layers.GatedShortConv``: ``in_proj`` to ``B, C, x``, a causal depthwise convolution of
``B * x`` of kernel ``conv_L_cache``, times ``C``, ``out_proj``; biases on all three with
``conv_bias``), or ``"full_attention"``, our ``"softmax"`` kind with an RMSNorm over each
head's q and k (``q_layernorm``, ``k_layernorm``: our ``qk_norm``), RoPE (base 1e6 unless
given) and no biases. Every layer has a SwiGLU MLP (``w1``, ``w3``, ``w2``: gate, up, down)
of width ``intermediate_size``, or with ``block_auto_adjust_ff_dim`` ``2/3`` of it, times
``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of`` (``mlp_hidden``).
The norms (``operator_norm``, ``ffn_norm`` and the final ``embedding_norm``, applied after
the last layer) are RMSNorms of epsilon ``norm_eps``. The legacy names ``block_ff_dim``
and ``tie_embedding`` are read as ``transformers`` reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from linattn_jax.hf import common, llama, rope, tables
from linattn_jax.hf.tables import CONV, COPY, LINEAR

# transformers' Lfm2Config defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=65536, hidden_size=2560, intermediate_size=12288, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=128_000,
    norm_eps=1e-5, tie_word_embeddings=True, conv_bias=False, conv_L_cache=3,
    block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
)  # fmt: skip
# Old names transformers still reads (its __post_init__'s).
LEGACY = dict(block_ff_dim="intermediate_size", tie_embedding="tie_word_embeddings")
# ``layer_types``' values as our kinds.
LAYER_KINDS = {"full_attention": "softmax", "conv": "gated_conv"}

MODEL_RULES = tables.rules(
    ("embed_tokens.weight", "embed.embedding", COPY),
    ("embedding_norm.weight", "norm.scale", COPY),
)
NORM_RULES = tables.rules(
    ("operator_norm.weight", "attention_norm.scale", COPY),
    ("ffn_norm.weight", "mlp_norm.scale", COPY),
)
ATTENTION_RULES = tables.rules(
    ("self_attn.q_proj.weight", "attention.q_proj.kernel", LINEAR),
    ("self_attn.k_proj.weight", "attention.k_proj.kernel", LINEAR),
    ("self_attn.v_proj.weight", "attention.v_proj.kernel", LINEAR),
    ("self_attn.out_proj.weight", "attention.out_proj.kernel", LINEAR),
    ("self_attn.q_layernorm.weight", "attention.q_norm.scale", COPY),
    ("self_attn.k_layernorm.weight", "attention.k_norm.scale", COPY),
)
CONV_RULES = tables.rules(
    ("conv.in_proj.weight", "attention.in_proj.kernel", LINEAR),
    ("conv.conv.weight", "attention.conv.kernel", CONV),
    ("conv.out_proj.weight", "attention.out_proj.kernel", LINEAR),
)
CONV_BIAS_RULES = tables.rules(
    ("conv.in_proj.bias", "attention.in_proj.bias", COPY),
    ("conv.conv.bias", "attention.conv_bias", COPY),
    ("conv.out_proj.bias", "attention.out_proj.bias", COPY),
)
MLP_RULES = tables.rules(
    ("feed_forward.w1.weight", "mlp.gate_proj.kernel", LINEAR),
    ("feed_forward.w3.weight", "mlp.up_proj.kernel", LINEAR),
    ("feed_forward.w2.weight", "mlp.down_proj.kernel", LINEAR),
)


def mixer_rules(config: Mapping[str, Any], i: int) -> tuple[tables.Rule, ...]:
    """Layer ``i``'s mixer rows: attention's, or the convolution's (with its biases)."""
    if config["layer_types"][i] == "full_attention":
        return ATTENTION_RULES
    return CONV_RULES + (CONV_BIAS_RULES if config["conv_bias"] else ())


def legacy(names: Mapping[str, str]) -> common.Step:
    """The step reading each old name of ``names`` as its new one (over it, as
    ``transformers``' ``__post_init__`` reads ``block_ff_dim`` and ``tie_embedding``)."""

    def step(config: common.Config) -> None:
        for old, new in names.items():
            if old in config:
                config[new] = config.pop(old)

    return step


def layer_types(config: common.Config) -> None:
    """Fills in ``layer_types`` where null as ``transformers`` does (``"full_attention"``
    at ``full_attn_idxs``, every layer when that is null too; ``"conv"`` elsewhere) and
    checks it."""
    n = config["num_hidden_layers"]
    if config.get("layer_types") is None:
        idxs = config.get("full_attn_idxs")
        idxs = list(range(n)) if idxs is None else idxs
        if not isinstance(idxs, list) or not all(common.is_int(i) for i in idxs):
            raise ValueError(f"config.json: full_attn_idxs must be a list of ints, got {idxs!r}")
        config["layer_types"] = ["full_attention" if i in idxs else "conv" for i in range(n)]
    common.check_layer_types(config, tuple(LAYER_KINDS))


def check_mlp(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming a bad field of the MLP's width, or one it comes to 0."""
    common.check_ints(config, ("block_multiple_of",))
    common.check_bools(config, ("block_auto_adjust_ff_dim",))
    multiplier = config["block_ffn_dim_multiplier"]
    if multiplier is not None and not (common.is_number(multiplier) and multiplier > 0):
        raise ValueError(
            f"config.json: block_ffn_dim_multiplier must be a number > 0 or null, got "
            f"{multiplier!r}"
        )
    if mlp_hidden(config) < 1:
        raise ValueError(
            f"config.json: intermediate_size={config['intermediate_size']} makes an MLP of "
            f"width {mlp_hidden(config)} (block_auto_adjust_ff_dim)"
        )


def mlp_hidden(config: Mapping[str, Any]) -> int:
    """The MLP's width as ``transformers``' ``Lfm2MLP`` computes it."""
    size = config["intermediate_size"]
    if config["block_auto_adjust_ff_dim"]:
        size = int(2 * size / 3)
        multiplier = config["block_ffn_dim_multiplier"]
        if multiplier is not None:
            size = int(multiplier * size)
            step = config["block_multiple_of"]
            size = step * ((size + step - 1) // step)
    return size


def mixer_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Each layer of ``layer_types``: QK-normed softmax attention or the gated short
    convolution (``llama.layered_options``, a SwiGLU MLP of ``intermediate_size``)."""
    kinds = [LAYER_KINDS[t] for t in config["layer_types"]]
    conv = dict(conv_size=config["conv_L_cache"], use_bias=config["conv_bias"])
    softmax = llama.softmax_options(config, qk_norm=True)
    return llama.layered_options(config, kinds, {"softmax": softmax, "gated_conv": conv})


def table(
    mlp_rules: Callable[[Mapping[str, Any], int], tuple[tables.Rule, ...]],
) -> Callable[[Mapping[str, Any], str], tables.Table]:
    """The weight table of layers of two norms, a mixer (``mixer_rules``) and
    ``mlp_rules(config, i)``'s MLP."""
    return tables.layered(
        MODEL_RULES,
        lambda config, i: NORM_RULES + mixer_rules(config, i) + mlp_rules(config, i),
    )


# What LFM2's model types check alike after their defaults.
CHECKS = (
    llama.heads,
    common.ints(llama.INT_FIELDS + ("conv_L_cache",)),
    common.divides("num_key_value_heads", "num_attention_heads"),
    common.bools(("tie_word_embeddings", "conv_bias")),
    common.numbers(("norm_eps",)),
)
STEPS = (
    legacy(LEGACY),
    common.defaults(DEFAULTS, keep_none=("block_ffn_dim_multiplier",)),
    *CHECKS,
    check_mlp,
    layer_types,
    rope.parameters(1_000_000.0),
)

FORMAT = common.ModelFormat(
    name="LFM2",
    model_types=("lfm2",),
    architecture="Lfm2ForCausalLM",
    steps=STEPS,
    options=lambda config: mixer_options(config) | dict(mlp_hidden=mlp_hidden(config)),
    table=table(lambda config, i: MLP_RULES),
    finish=common.rms_norm_eps("norm_eps"),
)
