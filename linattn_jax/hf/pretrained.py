"""The shared loader: a directory in Hugging Face format to a ``LanguageModel`` and back,
one tensor at a time, for every model type in ``FORMATS``.

What differs by model type (its config's fields, the model it builds, its weight table)
is its module's ``FORMAT`` (``common.ModelFormat``); reading, checking, converting,
casting and placing tensors, and writing shards, is done here for all of them.
"""

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
from linattn_jax.hf import (
    bamba,
    common,
    mamba2,
    nemotron_h,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    safetensors_io,
    xlstm,
)
from linattn_jax.models import LanguageModel

DTYPES = ("float32", "bfloat16")

# One entry per model type's module; adding a model type is its module plus a line here.
_MODULES = (qwen3_5, qwen3_5_moe, qwen3_next, mamba2, bamba, nemotron_h)
_MODULES += (xlstm,)
FORMATS: dict[str, common.ModelFormat] = {
    model_type: module.FORMAT for module in _MODULES for model_type in module.FORMAT.model_types
}
MODEL_TYPES = tuple(FORMATS)


def format_of(config: Mapping[str, Any]) -> common.ModelFormat:
    """The ``ModelFormat`` of a config (raw or normalised) by its ``model_type``.

    Raises:
      ValueError: a ``model_type`` no module reads.
    """
    model_type = config.get("model_type")
    if model_type not in FORMATS:
        raise ValueError(
            f"config.json: model_type must be one of {MODEL_TYPES}, got {model_type!r}"
        )
    return FORMATS[model_type]


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A directory's ``config.json``, read and checked by its model type's module
    (``normalize_config``: defaults filled in as ``transformers`` fills them).

    Raises:
      ValueError: no ``config.json`` or one that is not a JSON object, an unknown
        ``model_type``, or a field missing, of the wrong type or unsupported (named).
    """
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(file):
        raise ValueError(f"{os.fspath(path)} has no config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(raw).__name__}")
    return format_of(raw).normalize_config(raw)


def abstract_model(
    config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
) -> LanguageModel:
    """The ``LanguageModel`` of a normalised config with ``jax.ShapeDtypeStruct``
    parameters (``nnx.eval_shape``: nothing allocated), finished by its format (norms'
    epsilon and the like)."""
    fmt = format_of(config)
    options = fmt.model_options(config, dtype, param_dtype)
    model = nnx.eval_shape(lambda: LanguageModel(**options, rngs=nnx.Rngs(0)))
    if fmt.finish is not None:
        fmt.finish(model, config)
    return model


def expected_tensors(
    config: Mapping[str, Any], prefix: str | None = None
) -> dict[str, tuple[tuple[int, ...], common.Rule]]:
    """Every tensor a checkpoint of ``config`` (normalised) holds: name -> (shape, its
    table row); ``prefix`` None: the format's first."""
    fmt = format_of(config)
    flat = _flat(nnx.state(abstract_model(config)))
    table = fmt.weight_table(config, fmt.prefixes[0] if prefix is None else prefix)
    return {
        name: (common.hf_shape(rule, [flat[p].shape for p in rule.ours]), rule)
        for name, rule in table
    }


def check_pretrained(path: str | os.PathLike) -> dict[str, Any]:
    """Checks a directory without reading a weight: its ``config.json``, every safetensors
    file's header, every tensor's name and shape against the model's table. Returns the
    config (``read_config``'s). ``from_pretrained`` runs it first; the trainer's
    ``init_from`` before it touches the work directory.

    Raises:
      ValueError: as ``from_pretrained``.
    """
    config = read_config(path)
    with safetensors_io.Checkpoint(path) as checkpoint:
        _table(path, config, checkpoint, _flat(nnx.state(abstract_model(config))))
    return config


def _table(path, config, checkpoint, flat) -> list[tuple[str, common.Rule]]:
    """The model's table under the file's prefix, each name and shape checked."""
    fmt = format_of(config)
    names = checkpoint.names()
    tables = [fmt.weight_table(config, prefix) for prefix in fmt.prefixes]
    table = max(tables, key=lambda t: len(set(names).intersection(n for n, _ in t)))
    wanted = {name for name, _ in table}
    ignored = fmt.ignored_prefixes(config)
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
        expected = common.hf_shape(rule, [flat[p].shape for p in rule.ours])
        found = checkpoint.shape(name)
        if found != expected:
            raise ValueError(
                f"tensor {name!r} has shape {found}, config.json's model needs {expected}"
            )
    return table


def from_pretrained(
    path: str | os.PathLike,
    dtype: Any = None,
    *,
    param_dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[LanguageModel, dict[str, Any]]:
    """Loads a directory in Hugging Face format (nothing is downloaded), of any model type
    in ``MODEL_TYPES``.

    Reads ``config.json`` and ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``. Every name and shape is checked first
    (``check_pretrained``); the model is built without weights (``nnx.eval_shape``), then
    each tensor is read, converted (its model type's table), cast and placed one at a
    time: the host holds about one copy of the weights.

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
        the mesh lacks are not used, unnamed parameters replicated); its axes must be
        ``Auto`` (``jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)``); None: the
        default device.

    Returns:
      ``(model, config)``: the ``LanguageModel`` (unrolled layers; ``model(tokens)``,
      ``model.generate``) and the text model's config (a dict, ``read_config``'s).

    Raises:
      ValueError: no ``config.json`` or safetensors, an unreadable or truncated file
        (named), an unknown ``model_type`` or a bad or unsupported field (named), a tensor
        missing, of the wrong shape or not in the model's table (named), an unsupported
        ``dtype``, or a mesh with ``Explicit`` or ``Manual`` axes.
    """
    _check_mesh(mesh)
    config = read_config(path)
    dtype = _dtype(dtype, config)
    param_dtype = dtype if param_dtype is None else _dtype(param_dtype, config, "param_dtype")
    graphdef, state = nnx.split(abstract_model(config, dtype, param_dtype))
    variables = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}
    flat = {p: v.get_value() for p, v in variables.items()}
    shardings = None if mesh is None else _flat(sharding.place(state, mesh))
    stacks: dict[str, np.ndarray] = {}  # indexed rules' parameters, filled slice by slice
    with safetensors_io.Checkpoint(path) as checkpoint:
        table = _table(path, config, checkpoint, flat)
        left = {}  # indexed parameter -> slices still to read
        for _, rule in table:
            if rule.index is not None:
                for p in rule.ours:
                    left[p] = left.get(p, 0) + 1
        for name, rule in table:
            shapes = common.slice_shapes(rule, [flat[p].shape for p in rule.ours])
            x = checkpoint.get(name)
            parts = rule.conversion.to_ours(x, shapes)
            for p, part in zip(rule.ours, parts, strict=True):
                if rule.index is None:
                    part = np.asarray(part, param_dtype, order="C")  # cast, transpose: one copy
                    flat[p] = jax.device_put(part, None if shardings is None else shardings[p])
                    continue
                if p not in stacks:
                    stacks[p] = np.empty(flat[p].shape, param_dtype)
                stacks[p][rule.index] = part
                left[p] -= 1
                if not left[p]:  # every slice read: placed, the host copy dropped
                    flat[p] = jax.device_put(
                        stacks.pop(p), None if shardings is None else shardings[p]
                    )
            del x, parts  # one tensor at a time
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
    model_type: str | None = None,
    max_shard_size: int | str | None = "5GB",
) -> None:
    """Writes ``model`` as a directory that ``transformers`` loads (its model type's
    ``...ForCausalLM.from_pretrained(path)``) and ``from_pretrained`` reads back.

    Args:
      model: a ``LanguageModel`` in one model type's form (``from_pretrained``'s, or one
        built with that module's ``model_options``); its dimensions make the config.
      path: the directory (created if needed). Shards of an earlier save there that this
        one does not write are removed (no second copy of the weights is left).
      config: the config ``from_pretrained`` returned: its other fields
        (``eos_token_id``, ``max_position_embeddings``, ...) are kept; it must describe
        ``model`` (compared on what the model uses).
      model_type: the model type to write when ``config`` is None (None: the first of
        ``MODEL_TYPES`` whose form ``model`` has).
      max_shard_size: bytes or a size such as ``"5GB"`` per safetensors file (beyond it,
        shards and an index); None: one file.

    Raises:
      ValueError: a model not of the model type's form, or a ``config`` that describes
        another model (the field named).
    """
    if config is not None:
        fmt = format_of(config)
    elif model_type is not None:
        fmt = format_of({"model_type": model_type})
    else:
        fmt = _format_of_model(model)
    merged = fmt.config_for_save(model, config)
    flat = _flat(nnx.state(model, nnx.Param))
    table = fmt.weight_table(merged, fmt.prefixes[0])
    expected = _flat(nnx.state(abstract_model(merged), nnx.Param))
    if {p: x.shape for p, x in expected.items()} != {p: x.shape for p, x in flat.items()}:
        # the written config must rebuild this model, parameter by parameter
        raise ValueError(
            f"the {fmt.name} config made for the model builds other parameters (a bug of "
            "its config_for_save)"
        )
    rows = dict(table)

    def hf_tensor(name: str) -> np.ndarray:
        rule = rows[name]
        xs = [np.asarray(flat[p]) for p in rule.ours]
        if rule.index is not None:
            xs = [x[rule.index] for x in xs]
        return rule.conversion.to_hf(xs)

    shapes = {
        name: (
            common.hf_shape(rule, [flat[p].shape for p in rule.ours]),
            jnp.dtype(flat[rule.ours[0]].dtype),
        )
        for name, rule in table
    }
    safetensors_io.write(path, shapes, hf_tensor, max_shard_size)
    with open(os.path.join(os.fspath(path), "config.json"), "w") as f:
        json.dump(merged, f, indent=2, sort_keys=True)


def _format_of_model(model) -> common.ModelFormat:
    reasons = []
    for fmt in dict.fromkeys(FORMATS.values()):
        try:
            fmt.config_for_save(model, None)
        except ValueError as e:
            reasons.append(f"{fmt.name}: {e}")
            continue
        return fmt
    raise ValueError("the model has no model type's form: " + "; ".join(reasons))


def _check_mesh(mesh) -> None:
    if mesh is None:
        return
    types = getattr(mesh, "axis_types", None) or ()
    named = [
        f"{name}={kind.name}"
        for name, kind in zip(mesh.axis_names, types, strict=False)
        if kind != jax.sharding.AxisType.Auto
    ]
    if named:
        n = len(mesh.axis_names)
        raise ValueError(
            f"mesh: from_pretrained places parameters on Auto mesh axes, got {', '.join(named)}; "
            f"make it with jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,)"
            f" * {n})"
        )


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
