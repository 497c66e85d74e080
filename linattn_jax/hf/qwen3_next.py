"""Qwen3-Next in Hugging Face format <-> ``LanguageModel``.

``qwen3_next`` (``Qwen3NextForCausalLM``) is Qwen3.5's hybrid (``hf.qwen3_5``: gated
attention, Gated DeltaNet, zero-centred norms, partial RoPE) with two differences:

* the Gated DeltaNet's projections are fused per key-head group: ``in_proj_qkvz`` holds,
  for each of the ``linear_num_key_heads`` groups in turn, ``[q_g | k_g | v_g | z_g]`` (the
  group's ``r = linear_num_value_heads / linear_num_key_heads`` value heads in ``v_g`` and
  ``z_g``), and ``in_proj_ba`` holds ``[b_g | a_g]`` (``r`` each): split into our
  ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``, ``beta_proj`` and ``gate.proj``;
* a layer's MLP is a mixture of experts (``hf.qwen3_5_moe``'s weights: router, experts per
  expert or fused, gated shared expert; ``norm_topk_prob`` renormalises the top-k weights)
  when its index is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``,
  else a dense SwiGLU of ``intermediate_size``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from linattn_jax.hf import common, qwen3_5, qwen3_5_moe
from linattn_jax.hf.common import Conversion, rules
from linattn_jax.layers.moe import MoE

MODEL_TYPES = ("qwen3_next",)
# transformers' defaults (Qwen3NextConfig) of the fields Qwen3.5 lacks.
NEXT_DEFAULTS = dict(
    intermediate_size=5632,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    decoder_sparse_step=1,
    norm_topk_prob=True,
)


def grouped_conversion(groups: int) -> str:
    """The name of the conversion of a tensor whose rows are ``groups`` groups in turn, each
    the parts of our parameters (in order): registered on first use."""
    name = f"groups_of_{groups}"

    def sizes(shapes):
        return [s[1] // groups for s in shapes]

    def to_ours(x, shapes):
        parts = np.split(x.reshape(groups, -1, x.shape[-1]), np.cumsum(sizes(shapes))[:-1], 1)
        return [p.reshape(-1, x.shape[-1]).T for p in parts]

    def to_hf(xs):
        width = xs[0].shape[0]
        parts = [x.T.reshape(groups, -1, width) for x in xs]
        return np.concatenate(parts, axis=1).reshape(-1, width)

    common.CONVERSIONS.setdefault(
        name, Conversion(lambda s: (sum(x[1] for x in s), s[0][0]), to_ours, to_hf)
    )
    return name


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents, checked: Qwen3.5's fields as ``hf.qwen3_5`` reads them,
    the mixture's (``NEXT_DEFAULTS``, ``transformers``' when absent) and ``mlp_only_layers``.

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    common.check_model_type(raw, MODEL_TYPES)
    merged = {**NEXT_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    config = qwen3_5.normalize_config(dict(merged, model_type="qwen3_5_text"))
    config["model_type"] = "qwen3_next"
    for field in NEXT_DEFAULTS:
        config[field] = merged[field]
    common.check_ints(config, [f for f in NEXT_DEFAULTS if f != "norm_topk_prob"])
    common.check_bools(config, ("norm_topk_prob",))
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(common.is_int(i) for i in dense):
        raise ValueError(f"config.json: mlp_only_layers must be a list of ints, got {dense!r}")
    config["mlp_only_layers"] = list(dense)
    common.check_at_most(config, "num_experts_per_tok", "num_experts")
    return config


def mlp_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's MLP: ``"moe"`` or ``"swiglu"``, as ``transformers`` chooses."""
    step, dense = config["decoder_sparse_step"], set(config["mlp_only_layers"])
    return [
        "moe" if i not in dense and (i + 1) % step == 0 else "swiglu"
        for i in range(config["num_hidden_layers"])
    ]


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``): Qwen3.5's, with ``mlp_types``."""
    moe = qwen3_5_moe.moe_options(config) | dict(normalize=config["norm_topk_prob"])
    return qwen3_5.model_options(config, dtype, param_dtype) | dict(mlp=mlp_types(config), moe=moe)


def weight_table(config: Mapping[str, Any], prefix: str = "model.") -> list[tuple[str, Any]]:
    """Every tensor of a checkpoint of ``config``, in the model's order: Qwen3.5's rows with
    the Gated DeltaNet's grouped projections, and the MoE layers' mixtures (per expert, or
    fused for a ``prefix`` ending in ``qwen3_5_moe.FUSED``)."""
    fused, prefix = prefix.endswith(qwen3_5_moe.FUSED), prefix.removesuffix(qwen3_5_moe.FUSED)
    groups = grouped_conversion(config["linear_num_key_heads"])
    attention = "attention."
    grouped = rules(
        (
            "linear_attn.in_proj_qkvz.weight",
            [attention + p for p in ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel",
                                     "g_proj.kernel")],
            groups,
        ),
        ("linear_attn.in_proj_ba.weight",
         (attention + "beta_proj.kernel", attention + "gate.proj.kernel"), groups),
    )  # fmt: skip
    replaced = ("in_proj_qkv.", "in_proj_z.", "in_proj_b.", "in_proj_a.")
    kinds, rows = mlp_types(config), []
    moe_rows = {
        i: row for i, row in _moe_rows(config, prefix, fused)
    }  # layer -> its mixture's rows
    for name, rule in qwen3_5.weight_table(config, prefix):
        parts = name[len(prefix) :].split(".")
        i = int(parts[1]) if parts[0] == "layers" else None
        if i is not None and any(f".linear_attn.{r}" in name for r in replaced):
            if "in_proj_qkv." in name:
                rows += common.prefixed(grouped, f"{prefix}layers.{i}.", f"blocks.{i}.")
            continue
        if i is not None and kinds[i] == "moe" and ".mlp." in name:
            continue
        rows.append((name, rule))
        if (
            i is not None
            and kinds[i] == "moe"
            and name.endswith(".post_attention_layernorm.weight")
        ):
            rows += moe_rows[i]
    return rows


def _moe_rows(config, prefix, fused):
    """``(layer, its mixture's rows)`` for each MoE layer."""
    for i, kind in enumerate(mlp_types(config)):
        if kind != "moe":
            continue
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        rows = common.prefixed(qwen3_5_moe.ROUTER_RULES, layer, block)
        if fused:
            rows += common.prefixed(qwen3_5_moe.FUSED_RULES, layer, block)
        else:
            for j in range(config["num_experts"]):
                expert = f"{layer}mlp.experts.{j}."
                rows += common.prefixed(qwen3_5_moe.EXPERT_RULES, expert, block, j)
        rows += common.prefixed(qwen3_5_moe.SHARED_RULES, layer, block)
        yield i, rows


class SwiGLU(types.SimpleNamespace):
    """A stand-in for a dense MLP (``qwen3_5_moe.SwiGLU``'s use)."""


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: Qwen3.5's
    (``hf.qwen3_5``'s ``config_for_save``) with the mixture's fields; the dense layers
    listed in ``mlp_only_layers`` (``decoder_sparse_step`` 1).

    Raises:
      ValueError: a model not of Qwen3-Next's form, or a ``config`` that describes another
        model, named.
    """
    fields: dict[str, Any] = {}
    dense_layers, dense_width = [], None
    for i, block in enumerate(getattr(model, "blocks", ())):
        if isinstance(block.mlp, MoE):
            continue
        dense_layers.append(i)
        if type(block.mlp).__name__ == "SwiGLU":
            common.agree(
                fields, "intermediate_size", block.mlp.gate_proj.out_features, f"blocks[{i}]"
            )
    blocks = []
    for i, block in enumerate(getattr(model, "blocks", ())):
        mlp = block.mlp
        if isinstance(mlp, MoE):
            if (mlp.score, mlp.scaling, mlp.bias, mlp.num_groups) != ("softmax", 1.0, None, 1) or (
                mlp.shared is None or mlp.shared_gate is None
            ):
                raise ValueError(
                    f"blocks[{i}]: Qwen3-Next's MoE has a softmax router, no scaling, bias or "
                    "groups, and a gated shared expert"
                )
            for field, value in (
                ("num_experts", mlp.num_experts),
                ("num_experts_per_tok", mlp.top_k),
                ("moe_intermediate_size", mlp.gate.shape[-1]),
                ("shared_expert_intermediate_size", mlp.shared.gate_proj.out_features),
                ("norm_topk_prob", mlp.normalize),
            ):
                common.agree(fields, field, value, f"blocks[{i}]")
            dense_width = fields.get("intermediate_size", mlp.gate.shape[-1])
            mlp = SwiGLU(gate_proj=types.SimpleNamespace(out_features=dense_width))
        blocks.append(types.SimpleNamespace(**{**vars(block), "mlp": mlp}))
    if "num_experts" not in fields:
        raise ValueError("Qwen3-Next has MoE layers: the model has none")
    common.check_unrolled(model)
    names = ("period", "layout", "norm", "vocab_size", "embed", "depth", "head")
    view = types.SimpleNamespace(**{k: getattr(model, k) for k in names}, blocks=blocks)
    fields.setdefault("intermediate_size", dense_width)
    given = None
    if config is not None:
        given = dict(config, model_type="qwen3_5_text")
        if not dense_layers:  # the dense width the model lacks: the stand-ins'
            given["intermediate_size"] = dense_width
    dense = qwen3_5.config_for_save(view, given)
    if not dense_layers and config is not None:
        fields["intermediate_size"] = config.get("intermediate_size", dense_width)
    derived = fields | {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "mlp_only_layers": dense_layers,
        "decoder_sparse_step": 1,
    }
    if config is not None and mlp_types(config) == mlp_types({**config, **derived}):
        # the same layers dense: keep the config's own way of saying so
        derived.pop("mlp_only_layers")
        derived.pop("decoder_sparse_step")
    merged = common.merge_for_save(derived, config, (*qwen3_5.UNCHECKED, "intermediate_size"))
    return normalize_config({**dense, **merged})


FORMAT = common.ModelFormat(
    name="Qwen3-Next",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=("model.", "model." + qwen3_5_moe.FUSED),
    ignored_prefixes=lambda config: ("mtp.",) + common.tied_head_ignored(config),
    finish=qwen3_5_moe.FORMAT.finish,
)
