"""Qwen3.5's mixture-of-experts text models in Hugging Face format <-> ``LanguageModel``.

``qwen3_5_moe_text`` (``Qwen3_5MoeForCausalLM``), or the text part of ``qwen3_5_moe``
(``Qwen3_5MoeForConditionalGeneration``), is Qwen3.5 (``hf.qwen3_5``: its attention, Gated
DeltaNet, norms and RoPE, read by that module) with every MLP a mixture of experts
(``layers.MoE``): a softmax router over ``num_experts`` choosing ``num_experts_per_tok``,
the chosen weights renormalised (always, in ``transformers``), SwiGLU experts of width
``moe_intermediate_size``, and one shared SwiGLU expert of width
``shared_expert_intermediate_size`` behind a sigmoid gate. The experts' weights are read in
either layout ``transformers`` reads, and written per expert, as ``transformers`` saves:

* ``mlp.gate.weight`` ``[e, width]``: our ``router`` ``[width, e]``;
* per expert ``j``: ``mlp.experts.{j}.{gate,up}_proj.weight`` ``[hidden, width]`` and
  ``mlp.experts.{j}.down_proj.weight`` ``[width, hidden]``: slice ``j`` of our ``gate``,
  ``up`` ``[e, width, hidden]`` and ``down`` ``[e, hidden, width]`` (transposed);
* or fused: ``mlp.experts.gate_up_proj`` ``[e, 2 * hidden, width]`` (rows ``[gate | up]``)
  and ``mlp.experts.down_proj`` ``[e, width, hidden]``;
* ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``:
  our ``shared`` SwiGLU's kernels and ``shared_gate``'s (transposed).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax.hf import common, qwen3_5
from linattn_jax.hf.common import Conversion, rules
from linattn_jax.layers.moe import MoE, RouterLosses

MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
_DENSE = {"qwen3_5_moe_text": "qwen3_5_text", "qwen3_5_moe": "qwen3_5"}
# transformers' defaults (Qwen3_5MoeTextConfig) of the mixture's fields.
MOE_DEFAULTS = dict(
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)
MOE_FIELDS = tuple(MOE_DEFAULTS)

# [e, 2h, width] (rows [gate | up] per expert) <-> our gate, up [e, width, h].
common.CONVERSIONS.setdefault(
    "experts_gate_up",
    Conversion(
        lambda s: (s[0][0], s[0][2] + s[1][2], s[0][1]),
        lambda x, s: [p.transpose(0, 2, 1) for p in np.split(x, [s[0][2]], axis=1)],
        lambda xs: np.concatenate([x.transpose(0, 2, 1) for x in xs], axis=1),
    ),
)
# [e, width, h] <-> our down [e, h, width]: each expert's nn.Linear, transposed.
common.CONVERSIONS.setdefault(
    "experts_linear",
    Conversion(
        lambda s: (s[0][0], s[0][2], s[0][1]),
        lambda x, s: [x.transpose(0, 2, 1)],
        lambda xs: xs[0].transpose(0, 2, 1),
    ),
)

ROUTER_RULES = rules(("mlp.gate.weight", "mlp.router", "linear"))
FUSED_RULES = rules(
    ("mlp.experts.gate_up_proj", ("mlp.gate", "mlp.up"), "experts_gate_up"),
    ("mlp.experts.down_proj", "mlp.down", "experts_linear"),
)
EXPERT_RULES = rules(  # under mlp.experts.{j}., slice j
    ("gate_proj.weight", "mlp.gate", "linear"),
    ("up_proj.weight", "mlp.up", "linear"),
    ("down_proj.weight", "mlp.down", "linear"),
)
SHARED_RULES = rules(
    ("mlp.shared_expert.gate_proj.weight", "mlp.shared.gate_proj.kernel", "linear"),
    ("mlp.shared_expert.up_proj.weight", "mlp.shared.up_proj.kernel", "linear"),
    ("mlp.shared_expert.down_proj.weight", "mlp.shared.down_proj.kernel", "linear"),
    ("mlp.shared_expert_gate.weight", "mlp.shared_gate.kernel", "linear"),
)


def _as_dense(config: Mapping[str, Any]) -> dict[str, Any]:
    """A MoE config in Qwen3.5's dense form (``intermediate_size`` the experts' width), for
    ``hf.qwen3_5``'s functions to read what the two share."""
    dense = dict(config)
    dense["model_type"] = _DENSE.get(dense.get("model_type"), dense.get("model_type"))
    if isinstance(dense.get("text_config"), Mapping):
        text = dict(dense["text_config"])
        text["model_type"] = _DENSE.get(text.get("model_type"), "qwen3_5_text")
        text.setdefault("intermediate_size", text.get("moe_intermediate_size", 512))
        dense["text_config"] = text
    dense.setdefault("intermediate_size", dense.get("moe_intermediate_size", 512))
    return dense


def normalize_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents as the text model's config, checked: Qwen3.5's fields as
    ``hf.qwen3_5`` reads them, and the mixture's (``MOE_FIELDS``, ``transformers``'
    defaults when absent).

    Raises:
      ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
        unsupported, named.
    """
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type must be one of {MODEL_TYPES}, got {model_type!r}"
        )
    text = raw.get("text_config") if model_type == "qwen3_5_moe" else raw
    own = dict(text) if isinstance(text, Mapping) else {}
    config = qwen3_5.normalize_config(_as_dense(raw))
    if "intermediate_size" not in own:
        config.pop("intermediate_size")
    config["model_type"] = "qwen3_5_moe_text"
    for field, default in MOE_DEFAULTS.items():
        config[field] = own.get(field, default)
    common.check_ints(config, MOE_FIELDS)
    common.check_at_most(config, "num_experts_per_tok", "num_experts")
    return config


def moe_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """``layers.MoE``'s options of a normalised config."""
    return dict(
        num_experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        hidden=config["moe_intermediate_size"],
        normalize=True,
        shared_hidden=config["shared_expert_intermediate_size"],
        shared_gate=True,
    )


def model_options(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``): Qwen3.5's, every MLP a ``MoE``."""
    dense = dict(config, intermediate_size=config["moe_intermediate_size"])
    options = qwen3_5.model_options(dense, dtype, param_dtype)
    return options | dict(mlp="moe", moe=moe_options(config))


# A prefix ending so names the fused layout's table: the loader reads a file by the table
# (of those of FORMAT.prefixes) that names most of its tensors, and writes the first.
FUSED = "#fused"


def weight_table(config: Mapping[str, Any], prefix: str = "model.") -> list[tuple[str, Any]]:
    """Every tensor of a checkpoint of ``config``: Qwen3.5's rows but for the dense MLP's,
    and each layer's mixture (per expert, or fused for a ``prefix`` ending in ``FUSED``),
    in the model's order."""
    fused, prefix = prefix.endswith(FUSED), prefix.removesuffix(FUSED)
    rows = []
    for name, rule in qwen3_5.weight_table(config, prefix):
        if ".mlp." in name:
            continue
        rows.append((name, rule))
        if not name.endswith(".post_attention_layernorm.weight"):
            continue
        i = int(name[len(prefix) :].split(".")[1])
        layer, block = f"{prefix}layers.{i}.", f"blocks.{i}."
        rows += common.prefixed(ROUTER_RULES, layer, block)
        if fused:
            rows += common.prefixed(FUSED_RULES, layer, block)
        else:
            for j in range(config["num_experts"]):
                rows += common.prefixed(EXPERT_RULES, f"{layer}mlp.experts.{j}.", block, j)
        rows += common.prefixed(SHARED_RULES, layer, block)
    return rows


class SwiGLU(types.SimpleNamespace):
    """A stand-in for a dense MLP of the experts' width, so that ``qwen3_5``'s
    ``config_from_model`` reads everything but the MLP from a MoE model."""


def config_for_save(model, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config ``save_pretrained`` writes for ``model``: Qwen3.5's (``hf.qwen3_5``'s
    ``config_for_save``, the RoPE compared on what the model uses) with the mixture's.

    Raises:
      ValueError: a model not of Qwen3.5-MoE's form (a block without a ``MoE`` of its
        form, experts of different sizes, ...), or a ``config`` that describes another
        model, named.
    """
    fields: dict[str, Any] = {}
    blocks = []
    for i, block in enumerate(getattr(model, "blocks", ())):
        where, mlp = f"blocks[{i}]", block.mlp
        if not isinstance(mlp, MoE):
            raise ValueError(
                f"{where}: Qwen3.5-MoE's blocks have a MoE MLP, got {type(mlp).__name__}"
            )
        if (mlp.score, mlp.normalize, mlp.scaling, mlp.bias, mlp.num_groups) != (
            "softmax", True, 1.0, None, 1,
        ) or mlp.shared is None or mlp.shared_gate is None:  # fmt: skip
            raise ValueError(
                f"{where}: Qwen3.5-MoE's MoE has a softmax router, normalised top-k weights, no "
                "scaling, bias or groups, and a gated shared expert"
            )
        for field, value in (
            ("num_experts", mlp.num_experts),
            ("num_experts_per_tok", mlp.top_k),
            ("moe_intermediate_size", mlp.gate.shape[-1]),
            ("shared_expert_intermediate_size", mlp.shared.gate_proj.out_features),
        ):
            common.agree(fields, field, value, where)
        dense_mlp = SwiGLU(gate_proj=types.SimpleNamespace(out_features=mlp.gate.shape[-1]))
        blocks.append(types.SimpleNamespace(**{**vars(block), "mlp": dense_mlp}))
    common.check_unrolled(model)
    view = types.SimpleNamespace(
        **{k: getattr(model, k) for k in ("period", "layout", "norm", "vocab_size", "embed",
                                          "depth", "head")},
        blocks=blocks,
    )  # fmt: skip
    dense = qwen3_5.config_for_save(view, None if config is None else _as_dense(config))
    if config is None or "intermediate_size" not in config:
        dense.pop("intermediate_size")
    merged = common.merge_for_save(
        fields | {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"},
        None if config is None else {**dense, **{k: config[k] for k in MOE_FIELDS if k in config}},
        qwen3_5.UNCHECKED,
    )
    return normalize_config({**dense, **merged})


def _finish(model, config: Mapping[str, Any]) -> None:
    qwen3_5.FORMAT.finish(model, config)
    for _, node in nnx.iter_graph(model):
        # Not a weight: the losses' record starts at zero (the loader fills only weights).
        if isinstance(node, RouterLosses):
            node.set_value(jnp.zeros(node.get_value().shape, jnp.float32))  # [2], stacked


FORMAT = common.ModelFormat(
    name="Qwen3.5-MoE",
    model_types=MODEL_TYPES,
    normalize_config=normalize_config,
    model_options=model_options,
    weight_table=weight_table,
    config_for_save=config_for_save,
    prefixes=qwen3_5.FORMAT.prefixes + tuple(p + FUSED for p in qwen3_5.FORMAT.prefixes),
    ignored_prefixes=qwen3_5.FORMAT.ignored_prefixes,
    finish=_finish,
)
