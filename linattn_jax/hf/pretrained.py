"""``from_pretrained`` and ``save_pretrained``: a Qwen3.5 directory in Hugging Face format
to a ``LanguageModel`` and back, one tensor at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax import sharding
from linattn_jax.hf import qwen3_5, safetensors_io
from linattn_jax.models import LanguageModel

DTYPES = ("float32", "bfloat16")
TEXT_PREFIXES = ("model.language_model.", "model.")  # qwen3_5 (multimodal), qwen3_5_text
UNCHECKED = ("architectures", "dtype", "model_type")  # save_pretrained writes the model's


def abstract_model(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> LanguageModel:
    """The ``LanguageModel`` of a ``read_config`` config with ``jax.ShapeDtypeStruct``
    parameters (``nnx.eval_shape``: nothing allocated), its RMSNorms' epsilon the config's
    ``rms_norm_eps`` (``dtype``, ``param_dtype`` as in ``qwen3_5.model_options``)."""
    options = qwen3_5.model_options(config, dtype, param_dtype)
    model = nnx.eval_shape(lambda: LanguageModel(**options, rngs=nnx.Rngs(0)))
    for _, node in nnx.iter_graph(model):
        # The blocks', the final, q/k and gated norms: the layers take no epsilon option
        # (their default is Qwen3.5's 1e-6), so it is set on the built modules.
        if isinstance(node, nnx.RMSNorm):
            node.epsilon = float(config["rms_norm_eps"])
    return model


def expected_tensors(
    config: Mapping[str, Any], prefix: str = "model."
) -> dict[str, tuple[tuple[int, ...], qwen3_5.Rule]]:
    """Every tensor a checkpoint of ``config`` holds: name -> (shape, its table row)."""
    flat = _flat(nnx.state(abstract_model(config)))
    return {
        name: (qwen3_5.hf_shape(rule.how, [flat[p].shape for p in rule.ours]), rule)
        for name, rule in qwen3_5.weight_table(config, prefix)
    }


def from_pretrained(
    path: str | os.PathLike,
    dtype: Any = None,
    *,
    param_dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[LanguageModel, dict[str, Any]]:
    """Loads a Qwen3.5 directory in Hugging Face format (nothing is downloaded).

    Reads ``config.json`` (``model_type`` ``qwen3_5_text``, or ``qwen3_5``'s text part) and
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``. The model is built
    without weights (``nnx.eval_shape``), then each tensor is read, converted
    (``qwen3_5``'s table), cast and placed one at a time: the host holds about one copy of
    the weights.

    Args:
      path: the directory.
      dtype: the parameters' and the computation's dtype, ``float32`` or ``bfloat16``
        (None: the config's ``dtype`` where it is one of those, else float32: a float16
        checkpoint loads as float32).
      param_dtype: the parameters' dtype where it is not ``dtype`` (None), ``float32`` or
        ``bfloat16``: float32 parameters under a bfloat16 computation, as for training.
      mesh: place each parameter on ``mesh`` as it is read, split as
        ``linattn_jax.sharding.place`` splits it (the layers' logical axis names under
        ``sharding.RULES``: FSDP over a ``fsdp`` axis, heads and MLP over ``tensor``; axes
        the mesh lacks are not used, unnamed parameters replicated); None: the default
        device.

    Returns:
      ``(model, config)``: the ``LanguageModel`` (unrolled layers; ``model(tokens)``,
      ``model.generate``) and the text model's config (a dict, ``read_config``'s).

    Raises:
      ValueError: no ``config.json`` or safetensors, an unknown ``model_type`` or a bad or
        unsupported field (named), a tensor missing, of the wrong shape or not in the
        model's table (named), or an unsupported ``dtype``.
    """
    config = qwen3_5.read_config(path)
    dtype = _dtype(dtype, config)
    param_dtype = dtype if param_dtype is None else _dtype(param_dtype, config, "param_dtype")
    graphdef, state = nnx.split(abstract_model(config, dtype, param_dtype))
    variables = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}
    flat = {p: v.get_value() for p, v in variables.items()}
    shardings = None if mesh is None else _flat(sharding.place(state, mesh))
    with safetensors_io.Checkpoint(path) as checkpoint:
        names = checkpoint.names()
        prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p) for n in names)), "model.")
        table = qwen3_5.weight_table(config, prefix)
        wanted = {name for name, _ in table}
        ignored = qwen3_5.IGNORED_PREFIXES + (
            ("lm_head.",) if config["tie_word_embeddings"] else ()
        )
        unknown = [n for n in names if n not in wanted and not n.startswith(ignored)]
        if unknown:
            raise ValueError(
                f"{os.fspath(path)}: {len(unknown)} tensor(s) that a model of its config.json "
                f"does not have, such as {unknown[:3]}"
            )
        for name, rule in table:
            if name not in checkpoint.files:
                raise ValueError(
                    f"{os.fspath(path)}: tensor {name!r} is missing (config.json's model has it)"
                )
            shapes = [flat[p].shape for p in rule.ours]
            expected, found = qwen3_5.hf_shape(rule.how, shapes), checkpoint.shape(name)
            if found != expected:
                raise ValueError(
                    f"tensor {name!r} has shape {found}, config.json's model needs {expected}"
                )
            x = checkpoint.get(name)
            for p, part in zip(rule.ours, qwen3_5.to_ours(rule.how, x, shapes), strict=True):
                part = np.asarray(part, param_dtype, order="C")  # cast, transpose: one copy
                flat[p] = jax.device_put(part, None if shardings is None else shardings[p])
            del x  # one tensor at a time
    missing = [p for p, x in flat.items() if isinstance(x, jax.ShapeDtypeStruct)]
    if missing:  # a parameter the table does not fill: a bug of ours, not of the checkpoint
        raise ValueError(f"no tensor of the table fills the parameters {missing}")
    for p, variable in variables.items():
        variable.set_value(flat[p])
    return nnx.merge(graphdef, state), config


def save_pretrained(
    model: LanguageModel,
    path: str | os.PathLike,
    config: Mapping[str, Any] | None = None,
    *,
    max_shard_size: int | str | None = "5GB",
) -> None:
    """Writes ``model`` as a Qwen3.5 directory that ``transformers`` loads
    (``Qwen3_5ForCausalLM.from_pretrained(path)``) and ``from_pretrained`` reads back.

    Args:
      model: a ``LanguageModel`` in Qwen3.5's form (``from_pretrained``'s, or one built
        with ``qwen3_5.model_options``); its dimensions make the config.
      path: the directory (created if needed).
      config: the config ``from_pretrained`` returned: its other fields (``eos_token_id``,
        ``max_position_embeddings``, ...) are kept; the dimensions must be the model's.
      max_shard_size: bytes or a size such as ``"5GB"`` per safetensors file (beyond it,
        shards and an index); None: one file.

    Raises:
      ValueError: a model not of Qwen3.5's form (``qwen3_5.config_from_model``), or a
        ``config`` whose dimensions differ from the model's (the field named).
    """
    derived = qwen3_5.config_from_model(model)
    merged = {**qwen3_5.ABSENT_KIND_SIZES, **(config or {})}
    for field, value in derived.items():
        old = merged.get(field)
        if field == "rope_parameters" and isinstance(old, Mapping):
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in old and float(old[key]) != float(value[key]):
                    raise ValueError(
                        f"config['rope_parameters'][{key!r}]={old[key]}, but the model has "
                        f"{value[key]}"
                    )
            value = {**old, **value}  # mrope_section and the like kept
        elif config is not None and field in config and field not in UNCHECKED and old != value:
            raise ValueError(f"config[{field!r}]={old!r}, but the model has {value!r}")
        merged[field] = value
    merged = qwen3_5.normalize_config(merged)
    flat = _flat(nnx.state(model, nnx.Param))
    table = dict(qwen3_5.weight_table(merged, "model."))

    def hf_tensor(name: str) -> np.ndarray:
        rule = table[name]
        return qwen3_5.to_hf(rule.how, [np.asarray(flat[p]) for p in rule.ours])

    shapes = {
        name: (
            qwen3_5.hf_shape(rule.how, [flat[p].shape for p in rule.ours]),
            jnp.dtype(flat[rule.ours[0]].dtype),
        )
        for name, rule in table.items()
    }
    safetensors_io.write(path, shapes, hf_tensor, max_shard_size)
    with open(os.path.join(os.fspath(path), "config.json"), "w") as f:
        json.dump(merged, f, indent=2, sort_keys=True)


def _dtype(dtype, config, field: str = "dtype") -> jnp.dtype:
    if dtype is None:
        stored = config.get("dtype", config.get("torch_dtype"))
        dtype = stored if stored in DTYPES else "float32"
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"{field} must be one of {DTYPES} (or None), got {dtype!r}")
    return jnp.dtype(name)


def _flat(state) -> dict[str, Any]:
    """``{"blocks.0.attention.q_proj.kernel": value}`` of an ``nnx.State``."""
    return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(state)}
