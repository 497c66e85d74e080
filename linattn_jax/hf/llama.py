"""Llama checkpoints in Hugging Face format (``LlamaForCausalLM``, ``model_type``
``llama``) <-> ``LanguageModel``: the base of the softmax model types.

Every layer is softmax attention (GQA, RoPE over whole heads, ``rotate_half``; our
``"softmax"`` kind; biases on its four projections with ``attention_bias``) and a SwiGLU
MLP, each after an RMSNorm of epsilon ``rms_norm_eps``; ``head_dim`` is ``hidden_size /
num_attention_heads`` unless given, ``num_key_value_heads`` ``num_attention_heads`` unless
given; RoPE scaled as ``rope_parameters`` (or the legacy ``rope_scaling``) says
(``hf.rope``: linear, dynamic, yarn, llama3). The tensors are Llama's (``tables``' shared
rows) under ``model.``, ``lm_head.weight`` apart (untied only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from linattn_jax.hf import common, rope, tables

# transformers' LlamaConfig defaults, for the fields a config.json leaves out.
DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, pretraining_tp=1, max_position_embeddings=2048,
)  # fmt: skip
INT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
)  # fmt: skip


def heads(config: common.Config) -> None:
    """``num_key_value_heads`` (``num_attention_heads``) and ``head_dim`` (``hidden_size /
    num_attention_heads``) where null, as ``transformers`` derives them."""
    n = config["num_attention_heads"]
    if config.get("num_key_value_heads") is None:
        config["num_key_value_heads"] = n
    if config.get("head_dim") is None and common.is_int(n) and n > 0:
        if common.is_int(config["hidden_size"]):
            config["head_dim"] = config["hidden_size"] // n


def softmax_options(
    config: Mapping[str, Any], rope_parameters: Mapping[str, Any] | None = None, **more: Any
) -> dict[str, Any]:
    """Llama's attention as ``kind_options["softmax"]``, RoPE of ``rope_parameters`` (by
    default the config's), with ``more`` options."""
    return dict(
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        **rope.options(config, rope_parameters),
        **more,
    )


def layered_options(
    config: Mapping[str, Any],
    kinds: Sequence[str],
    kind_options: Mapping[str, Any],
    mlp: str = "swiglu",
) -> dict[str, Any]:
    """Layer ``i`` of our kind ``kinds[i]`` (``"softmax"``, ``"local_softmax"``: those
    of ``kind_options``), each with an ``mlp`` MLP."""
    used = dict.fromkeys(kinds)
    return dict(
        num_heads=config["num_attention_heads"],
        attention=kinds[0] if len(used) == 1 else list(kinds),
        kind_options={kind: kind_options[kind] for kind in used},
        mlp=mlp,
        mlp_hidden=config["intermediate_size"],
    )


# ``layer_types``' values as our kinds: the windowed layers' own kind beside the global's.
LAYER_KINDS = {"full_attention": "softmax", "sliding_attention": "local_softmax"}


def windowed_options(
    config: Mapping[str, Any], softmax: Mapping[str, Any], local: Mapping[str, Any], **more: Any
) -> dict[str, Any]:
    """Each layer of ``layer_types``: ``"full_attention"`` of ``softmax``'s options,
    ``"sliding_attention"`` of ``local``'s (its window among them); ``more``:
    ``layered_options``' ``mlp``."""
    kinds = [LAYER_KINDS[t] for t in config["layer_types"]]
    return layered_options(config, kinds, {"softmax": softmax, "local_softmax": local}, **more)


def check_windows(config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless ``layer_types`` lists ``num_hidden_layers`` of
    ``LAYER_KINDS`` and, with a sliding one, ``sliding_window`` is an int >= 1."""
    common.check_layer_types(config, tuple(LAYER_KINDS))
    if "sliding_attention" in config["layer_types"]:
        common.check_ints(config, ("sliding_window",))


def options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every layer softmax attention (biased by ``attention_bias``) with a SwiGLU MLP."""
    bias = config["attention_bias"]
    softmax = softmax_options(config, qkv_bias=bias, out_bias=bias)
    return layered_options(config, ["softmax"], {"softmax": softmax})


def attention_rules(qkv_bias: bool, out_bias: bool) -> tuple[tables.Rule, ...]:
    """The attention's rows, with the biases' rows where it has them."""
    rows = tables.ATTENTION_RULES + (tables.QKV_BIAS_RULES if qkv_bias else ())
    return rows + (tables.OUT_BIAS_RULES if out_bias else ())


def table(attention: Callable[[Mapping[str, Any]], tuple[tables.Rule, ...]]) -> Callable:
    """The weight table of layers of two norms, ``attention(config)``'s rows and a SwiGLU
    MLP (``tables.layered``)."""
    return tables.layered(
        tables.MODEL_RULES,
        lambda config, i: tables.NORM_RULES + attention(config) + tables.MLP_RULES,
    )


# What the softmax types check alike after their defaults: the sizes, the tied head, the
# norms' epsilon (then RoPE: ``rope.parameters``, whose fields differ); ``CHECKS`` the
# activation too (SiLU: Gemma's differs).
SIZE_CHECKS = (
    heads,
    common.ints(INT_FIELDS),
    common.divides("num_key_value_heads", "num_attention_heads"),
    common.bools(("tie_word_embeddings",)),
    common.numbers(("rms_norm_eps",)),
)
CHECKS = SIZE_CHECKS + (common.choice("hidden_act", ("silu",)),)


def windowed_steps(
    defaults: Mapping[str, Any], theta: float, *more: common.Step, rope_keys: Sequence[str] = ()
) -> tuple[common.Step, ...]:
    """A windowed softmax type's steps: its ``defaults`` (a null ``sliding_window`` kept:
    no window), ``CHECKS``, RoPE of base ``theta`` (``rope.parameters``), then ``more``."""
    return (
        common.defaults(defaults, keep_none=("sliding_window",)),
        *CHECKS,
        rope.parameters(theta, keys=rope_keys),
        *more,
    )


FORMAT = common.ModelFormat(
    name="Llama",
    model_types=("llama",),
    architecture="LlamaForCausalLM",
    steps=(
        common.defaults(DEFAULTS),
        *CHECKS,
        rope.parameters(10000.0),
        common.bools(("attention_bias",)),
        common.false(("mlp_bias",)),
        common.unsupported({"pretraining_tp": 1}),
    ),
    options=options,
    table=table(lambda config: attention_rules(*(config["attention_bias"],) * 2)),
    finish=common.rms_norm_eps("rms_norm_eps"),
)
