"""The shared loader: a directory in Hugging Face format to a ``LanguageModel`` and back,
one tensor at a time, for every model type in ``FORMATS``.

What differs by model type (its config's fields, the model it builds, its weight table)
is its module's ``FORMAT`` (``common.ModelFormat``); reading, checking, converting,
casting and placing tensors, and writing shards, is done here for all of them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
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
    falcon_h1,
    granitemoehybrid,
    kimi_linear,
    mamba2,
    minimax,
    nemotron_h,
    olmo_hybrid,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    safetensors_io,
    xlstm,
)
from linattn_jax.layers.moe import RouterBias
from linattn_jax.models import LanguageModel

DTYPES = ("float32", "bfloat16")

# One entry per model type's module; adding a model type is its module plus a line here.
_MODULES = (
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    mamba2,
    bamba,
    nemotron_h,
    granitemoehybrid,
    falcon_h1,
    kimi_linear,
    minimax,
    olmo_hybrid,
    xlstm,
)
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
      ValueError: no such directory, no ``config.json`` or one that is not a JSON object,
        an unknown ``model_type``, or a field missing, of the wrong type or unsupported
        (named).
    """
    common.check_directory(path)
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
    config: Mapping[str, Any],
    dtype: Any = jnp.float32,
    param_dtype: Any = None,
    *,
    scan_layers: bool = False,
) -> LanguageModel:
    """The ``LanguageModel`` of a normalised config with ``jax.ShapeDtypeStruct``
    parameters (``nnx.eval_shape``: nothing allocated), finished by its format (norms'
    epsilon and the like); ``scan_layers``: its layers scanned (``models.stack``)."""
    fmt = format_of(config)
    options = fmt.model_options(config, dtype, param_dtype)
    if scan_layers:
        options = {**options, "scan_layers": True}
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


_LAYER = re.compile(r"^blocks\.(\d+)\.")


def scanned_table(
    table: list[tuple[str, common.Rule]], period: int | None
) -> list[tuple[str, common.Rule]]:
    """An unrolled model's weight table for the same model scanned over ``period`` layers
    (``models.stack``): layer ``l``'s ``blocks.l.*`` is the slice ``l // period`` of block
    ``l % period``'s stacked parameter (before any index the row had: an expert's).
    ``period`` None: the table as it is."""
    if period is None:
        return table
    rows = []
    for name, rule in table:
        layers = {int(m[1]) for m in map(_LAYER.match, rule.ours) if m}
        if not layers:
            rows.append((name, rule))
            continue
        (layer,) = layers  # a row fills one layer's parameters
        ours = tuple(_LAYER.sub(f"blocks.{layer % period}.", p) for p in rule.ours)
        index = () if rule.index is None else rule.index
        index = (layer // period, *(index if isinstance(index, tuple) else (index,)))
        rows.append((name, dataclasses.replace(rule, ours=ours, index=index)))
    return rows


def _table(path, config, checkpoint, flat, period=None) -> list[tuple[str, common.Rule]]:
    """The model's table under the file's prefix (``scanned_table``'s with ``period``), each
    name and shape checked."""
    fmt = format_of(config)
    names = checkpoint.names()
    tables = [scanned_table(fmt.weight_table(config, p), period) for p in fmt.prefixes]
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
    scan_layers: bool = False,
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
      scan_layers: build the model with its layers scanned (``models.stack``: the layout's
        period, e.g. the 4 layers of ``"3 gated_deltanet : 1 softmax"``, compiled once and
        run ``depth / period`` times; its parameters stacked ``depth / period`` deep, each
        layer's tensors read into its slice): one period in the program whatever the
        depth (XLA already compiles identical unrolled layers once, so the compile time
        falls by less: docs/benchmarks.md), the outputs the same to float32 rounding.
        ``save_pretrained`` writes either form. False: one block per layer.

    Returns:
      ``(model, config)``: the ``LanguageModel`` (``model(tokens)``, ``model.generate``)
      and the text model's config (a dict, ``read_config``'s).

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
    abstract = abstract_model(config, dtype, param_dtype, scan_layers=scan_layers)
    graphdef, state = nnx.split(abstract)
    variables = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(state)}
    flat = {p: v.get_value() for p, v in variables.items()}
    # Parameters in param_dtype; other weights (a MoE's score bias) keep their own dtype.
    dtypes = {
        p: param_dtype if isinstance(v, nnx.Param) else flat[p].dtype for p, v in variables.items()
    }
    shardings = None if mesh is None else _flat(sharding.place(state, mesh))
    stacks: dict[str, np.ndarray] = {}  # indexed rules' parameters, filled slice by slice
    with safetensors_io.Checkpoint(path) as checkpoint:
        table = _table(path, config, checkpoint, flat, abstract.period)
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
                    part = np.asarray(part, dtypes[p], order="C")  # cast, transpose: one copy
                    flat[p] = jax.device_put(part, None if shardings is None else shardings[p])
                    continue
                if p not in stacks:
                    stacks[p] = np.empty(flat[p].shape, dtypes[p])
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


def _multipliers(model) -> tuple:
    """What the weights do not hold: ``(embedding_multiplier, logits_scaling, per block
    (residual_multiplier, the halves' residual factors, branch_multipliers, the MLP's
    multipliers, per mixer its softmax score scale or Mamba-2 projection multipliers and
    norm))``."""

    def mixer(layer):
        if hasattr(layer, "projection_multipliers"):  # Mamba2Mixer
            return layer.projection_multipliers, getattr(layer.norm, "gate_first", None)
        if hasattr(layer, "scale"):  # SoftmaxAttention
            return layer.head_dim**-0.5 if layer.scale is None else layer.scale
        return None

    blocks = tuple(
        (
            b.residual_multiplier,
            (b.attention_residual, b.mlp_residual),
            b.branch_multipliers,
            getattr(b.mlp, "multipliers", None),
            mixer(b.attention),
            mixer(b.parallel),
        )
        for b in model.blocks
    )
    return (model.embedding_multiplier, model.logits_scaling, blocks)


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
    unrolled = _unrolled_view(model)  # the formats read a model's layers one by one
    if config is not None:
        fmt = format_of(config)
    elif model_type is not None:
        fmt = format_of({"model_type": model_type})
    else:
        fmt = _format_of_model(unrolled)
    merged = fmt.config_for_save(unrolled, config)
    weights = nnx.Any(nnx.Param, RouterBias)  # a score bias: a weight the gradient leaves
    flat = _flat(nnx.state(model, weights))
    table = scanned_table(fmt.weight_table(merged, fmt.prefixes[0]), model.period)
    rebuilt = abstract_model(merged, scan_layers=model.period is not None)
    expected = _flat(nnx.state(rebuilt, weights))
    if {p: x.shape for p, x in expected.items()} != {p: x.shape for p, x in flat.items()}:
        # the written config must rebuild this model, parameter by parameter
        raise ValueError(
            f"the {fmt.name} config made for the model builds other parameters (a bug of "
            "its config_for_save)"
        )
    if _multipliers(abstract_model(merged)) != _multipliers(unrolled):
        raise ValueError(
            f"the model's multipliers {_multipliers(unrolled)} are not the {fmt.name} config's "
            f"{_multipliers(abstract_model(merged))} (embedding, logits, each block's residual "
            "and its branches', MLP's and mixers' own; a model type without them has all 1, "
            "head_dim ** -0.5 and Mamba-2's norm)"
        )
    rows = dict(table)

    def hf_tensor(name: str) -> np.ndarray:
        rule = rows[name]
        # An indexed row's slice is taken before the copy to the host.
        xs = [np.asarray(flat[p] if rule.index is None else flat[p][rule.index]) for p in rule.ours]
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


def _unrolled_view(model: LanguageModel) -> LanguageModel:
    """``model`` itself if unrolled; for a scanned one, a copy whose blocks are one per
    layer, with ``jax.ShapeDtypeStruct`` parameters (nothing copied): what a format's
    ``config_for_save`` reads (kinds, sizes, options), not its weights."""
    if model.period is None:
        return model
    layers = []
    for layer in range(model.depth):
        graphdef, state = nnx.split(model.blocks[layer % model.period])
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state)
        layers.append(nnx.merge(graphdef, shapes))
    view = copy.copy(model)
    view.blocks, view.period = nnx.List(layers), None
    return view


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
