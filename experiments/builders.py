"""What a training config builds: its model (``build_model``) and its optimiser
(``build_optimizer`` on the ``learning_rate`` schedule). The trainer and ``checkpoints.load``
both build from here."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh
from ml_collections import ConfigDict

from experiments.tasks import TASKS
from linattn_jax import hf, models, sharding
from linattn_jax.layers import registry

# The mesh axes that split a batch (the trainer's ``Sharder.BATCH``).
BATCH_AXES = ("data", "fsdp", sharding.EXPERT_AXIS)


def _same(value):
    return value


# A config field's value as the layer option (0 and "" mean the layer's default; a field
# missing from an older run's stored config reads as None).
_OPTION = {
    "chunk_size": lambda n: n or None,
    "decay": lambda d: None if d in ("", None) else (d if d == "retnet" else float(d)),
    "num_features": lambda n: n or None,
    "feature_dim": lambda n: n or None,
    "mlp_hidden": lambda n: n or None,
}


def build_model(config: ConfigDict, mesh: Mesh | None = None) -> nnx.Module:
    """The config's model (its task's kind and vocabulary); ``mesh`` for sequence parallelism.

    ``model.attention`` is one kind or a layout (``"3 gated_deltanet : 1 softmax"``); each
    kind of it reads the fields its registry entry names (``model.<name>`` and
    ``model.<section>.<name>``).
    """
    m, spec = config.model, TASKS[config.task]
    if config.get("init_from"):  # the checkpoint's model; a resumed run overwrites it
        if os.path.exists(os.path.join(config.init_from, "tokenizer.json")):
            logging.warning(
                "init_from=%s: its tokenizer.json is not used; task %s feeds its own token ids",
                config.init_from,
                config.task,
            )
        # float32 parameters whatever model.dtype, as a random initialisation's.
        return hf.from_pretrained(
            config.init_from, m.dtype, param_dtype="float32", scan_layers=m.scan_layers
        )[0]
    kind_options = {
        kind: _kind_options(kind, config) for kind in registry.parse_layout(m.attention, m.depth)
    }
    kwargs = dict(
        attention=m.attention,
        kind_options=kind_options,
        mlp_ratio=m.mlp_ratio,
        rngs=nnx.Rngs(config.seed),
        dtype=jnp.dtype(m.dtype),
    )
    # Fields newer than a stored config read as absent: the models' defaults.
    kwargs.update(
        {k: v for k in _MODEL_FIELDS if (v := _OPTION.get(k, _same)(m.get(k))) is not None}
    )
    if m.get("mlp") == "moe":
        kwargs.update(_moe_options(config))
    if config.mesh.sequence > 1:
        kwargs.update(sequence_axis="sequence", batch_axis=BATCH_AXES, mesh=mesh)
    if spec.kind == "lm":
        return models.LanguageModel(
            spec.vocab_size(config),
            m.width,
            m.depth,
            m.num_heads,
            short_conv=m.short_conv,
            **kwargs,
        )
    return models.SequenceClassifier(
        spec.vocab_size(config), spec.num_classes, m.width, m.depth, m.num_heads, **kwargs
    )


_MODEL_FIELDS = ("mlp", "mlp_hidden", "zero_centred_norm", "scan_layers", "remat")
# Section fields where 0 means the layer's default, and RoPE's, read only with rope=true.
_ZERO_IS_DEFAULT = (
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_v_heads",
    "value_head_dim",
    "sliding_window",
    "expand",
    "state_dim",
    "n_groups",
)
_ROPE_ONLY = ("rope_theta", "partial_rotary_factor")


# MoE's options from model.moe (0: the default, for the widths).
_MOE_FIELDS = (
    "num_experts", "top_k", "hidden", "score", "normalize", "scaling", "score_bias",
    "num_groups", "top_k_groups", "shared_hidden", "shared_gate",
)  # fmt: skip


def _moe_options(config: ConfigDict) -> dict:
    """``mlp`` (each layer's kind: the first ``model.moe.first_dense`` a SwiGLU) and ``moe``
    (``layers.moe.MoE``'s options) of a ``model.mlp="moe"`` config."""
    m = config.model
    options = {k: m.moe[k] for k in _MOE_FIELDS if k in m.moe}
    if not options.get("hidden"):
        options.pop("hidden", None)  # the block's mlp_hidden (or mlp_ratio * width)
    dense = m.moe.get("first_dense", 0)
    return {"mlp": ["swiglu"] * dense + ["moe"] * (m.depth - dense), "moe": options}


def _kind_options(kind: str, config: ConfigDict) -> dict:
    """The options of ``kind``'s layers: its registry fields, as the layer takes them."""
    m, spec = config.model, registry.get(kind)
    options = {name: _OPTION.get(name, _same)(m.get(name)) for name in spec.options}
    section = m.get(spec.section) if spec.section else None
    for name in spec.section_options if section is not None else ():
        value = section.get(name)
        zero = name in _ZERO_IS_DEFAULT and value == 0
        if value is None or zero or (name in _ROPE_ONLY and not section.get("rope")):
            continue
        options[name] = value
    if spec.takes_max_length:
        options.update(max_length=max(config.seq_len, 1))
    return options


def learning_rate(config: ConfigDict) -> optax.Schedule:
    """Linear warmup from 0, then cosine decay to 0 at ``steps``."""
    o = config.optim
    return optax.warmup_cosine_decay_schedule(
        0.0, o.lr, min(o.warmup_steps, config.steps), max(config.steps, o.warmup_steps + 1)
    )


def build_optimizer(config: ConfigDict) -> optax.GradientTransformation:
    """AdamW on the ``learning_rate`` schedule after clipping the gradient norm.

    Equal settings give the same (stateless) object, so that the jitted steps of a
    second run in one process find their compiled code (``nnx.Optimizer`` holds it
    as static data).
    """
    o = config.optim
    return _optimizer(config.steps, o.lr, o.warmup_steps, o.grad_clip, o.b1, o.b2, o.weight_decay)


@functools.lru_cache(maxsize=32)
def _optimizer(steps, lr, warmup_steps, grad_clip, b1, b2, weight_decay):
    config = ConfigDict({"steps": steps, "optim": {"lr": lr, "warmup_steps": warmup_steps}})
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(learning_rate(config), b1=b1, b2=b2, weight_decay=weight_decay),
    )
