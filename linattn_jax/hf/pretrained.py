"""The shared loader: a directory in Hugging Face format to a ``LanguageModel``, one tensor
at a time, for every model type in ``FORMATS`` (the way back: ``saving``).

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
    bailing_hybrid,
    bamba,
    common,
    deepseek_v3,
    falcon_h1,
    falcon_mamba,
    gemma2,
    gemma3,
    granitemoehybrid,
    jamba,
    kimi_linear,
    lara_mini,
    lfm2,
    lfm2_moe,
    lfm3,
    llama,
    mamba,
    mamba2,
    minimax,
    mistral,
    mixtral,
    nemotron_h,
    olmo_hybrid,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    qwen4_exp,
    recurrent_gemma,
    rwkv,
    safetensors_io,
    tables,
    unsupported,
    xlstm,
    zamba,
    zamba2,
)
from linattn_jax.models import LanguageModel
from linattn_jax.models.options import freeze

DTYPES = ("float32", "bfloat16")

# Every model type's format; adding a model type is its module plus a line here.
_FORMATS = (
    qwen3_5.FORMAT,
    qwen3_5_moe.FORMAT,
    qwen3_next.FORMAT,
    mamba2.FORMAT,
    bamba.FORMAT,
    nemotron_h.FORMAT,
    granitemoehybrid.FORMAT,
    falcon_h1.FORMAT,
    kimi_linear.FORMAT,
    minimax.FORMAT,
    olmo_hybrid.FORMAT,
    xlstm.FORMAT,
    llama.FORMAT,
    mistral.FORMAT,
    phi3.FORMAT,
    gemma2.FORMAT,
    gemma3.FORMAT,
    qwen3_moe.FORMAT,
    mixtral.FORMAT,
    deepseek_v3.FORMAT,
    qwen2.FORMAT,
    qwen3.FORMAT,
    lfm2.FORMAT,
    lfm2_moe.FORMAT,
    lfm3.FORMAT,
    lara_mini.FORMAT,
    bailing_hybrid.FORMAT,
    rwkv.FORMAT,
    zamba2.FORMAT,
    recurrent_gemma.FORMAT,
    mamba.FORMAT,
    falcon_mamba.FORMAT,
    zamba.FORMAT,
    jamba.FORMAT,
    qwen4_exp.FORMAT,
)
FORMATS: dict[str, common.ModelFormat] = {
    model_type: fmt for fmt in _FORMATS for model_type in fmt.model_types
}
MODEL_TYPES = tuple(FORMATS)


def format_of(config: Mapping[str, Any]) -> common.ModelFormat:
    """The ``ModelFormat`` of a config (raw or normalised) by its ``model_type``.

    Raises:
      ValueError: a ``model_type`` no module reads (one ``transformers`` has whose blocks
        are missing here, ``unsupported.MODEL_TYPES``, named with them).
    """
    unsupported.check(config)
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
    epsilon and the like), carrying ``config`` (``model.hf_config``); ``scan_layers``: its
    layers scanned (``models.stack``).

    Each call returns a model of its own (its own variables); the traced construction is
    kept for the last few configs (``check_pretrained``, ``from_pretrained`` and
    ``save_pretrained`` of one config trace it once)."""
    # repr: equal configs of other types (1 and 1.0, written back as read) kept apart.
    key = (repr(freeze(config)), freeze(dtype), freeze(param_dtype), scan_layers)
    if key not in _ABSTRACT:
        fmt = format_of(config)
        options = fmt.model_options(config, dtype, param_dtype)
        if scan_layers:
            options = {**options, "scan_layers": True}
        model = nnx.eval_shape(lambda: LanguageModel(**options, rngs=nnx.Rngs(0)))
        if fmt.finish is not None:
            fmt.finish(model, config)
        model.hf_config = freeze(config)
        if len(_ABSTRACT) >= 8:
            del _ABSTRACT[next(iter(_ABSTRACT))]  # the oldest
        _ABSTRACT[key] = nnx.split(model)
    return nnx.merge(*_ABSTRACT[key], copy=True)


# abstract_model's traced constructions: (frozen config's repr, dtype, param dtype, scan_layers)
# -> (graphdef, abstract state). The tracing costs about 0.1 s for a tiny model, seconds
# for a large one; a merge with copies of the variables, well under that.
_ABSTRACT: dict[tuple, tuple] = {}


def expected_tensors(
    config: Mapping[str, Any], prefix: str | None = None
) -> dict[str, tuple[tuple[int, ...], tables.Rule]]:
    """Every tensor a checkpoint of ``config`` (normalised) holds: name -> (shape, its
    table row); ``prefix`` None: the format's first."""
    fmt = format_of(config)
    flat = flat_state(nnx.state(abstract_model(config)))
    return {
        name: (tables.hf_shape(rule, [flat[p].shape for p in rule.ours]), rule)
        for name, rule in fmt.weight_table(config, prefix)
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
        _table(path, config, checkpoint, flat_state(nnx.state(abstract_model(config))))
    return config


def _table(path, config, checkpoint, flat, period=None) -> tables.Table:
    """The model's table under the file's prefix (``scanned_table``'s with ``period``), each
    name and shape checked."""
    fmt = format_of(config)
    names = checkpoint.names()
    candidates = [tables.scanned_table(fmt.weight_table(config, p), period) for p in fmt.prefixes]
    shape = lambda rule: tables.hf_shape(rule, [flat[p].shape for p in rule.ours])
    # The table naming most of the file's tensors; of those alike (OLMo-Hybrid's two cuts of
    # one conv), the one whose shapes the file has.
    fits = lambda t: (
        len(set(names).intersection(n for n, _ in t)),
        sum(
            n in checkpoint.files
            and all(p in flat for p in r.ours)
            and checkpoint.shape(n) == shape(r)
            for n, r in t
        ),
    )
    table = max(candidates, key=fits)
    wanted = {name for name, _ in table}
    ignored = fmt.ignored_names(config)
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
        expected, found = shape(rule), checkpoint.shape(name)
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
    shardings = None if mesh is None else flat_state(sharding.place(state, mesh))
    stacks: dict[str, np.ndarray] = {}  # indexed rules' parameters, filled slice by slice
    with safetensors_io.Checkpoint(path) as checkpoint:
        table = _table(path, config, checkpoint, flat, abstract.period)
        left = {}  # indexed parameter -> slices still to read
        for _, rule in table:
            if rule.index is not None:
                for p in rule.ours:
                    left[p] = left.get(p, 0) + 1
        for name, rule in table:
            shapes = tables.slice_shapes(rule, [flat[p].shape for p in rule.ours])
            x = checkpoint.get(name)
            parts = rule.how.to_ours(x, shapes)
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
    for p, x in flat.items():  # not a weight (a MoE's loss record): it starts at zero
        if isinstance(x, jax.ShapeDtypeStruct) and not isinstance(variables[p], nnx.Param):
            flat[p] = jnp.zeros(x.shape, x.dtype)
    missing = [p for p, x in flat.items() if isinstance(x, jax.ShapeDtypeStruct)]
    if missing:  # a parameter the table does not fill: a bug of ours, not of the checkpoint
        raise ValueError(f"no tensor of the table fills the parameters {missing}")
    for p, variable in variables.items():
        variable.set_value(flat[p])
    return nnx.merge(graphdef, state), config


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


def flat_state(state) -> dict[str, Any]:
    """``{"blocks.0.attention.q_proj.kernel": value}`` of an ``nnx.State``."""
    return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(state)}
