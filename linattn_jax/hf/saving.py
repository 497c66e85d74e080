"""The way back: a ``LanguageModel`` to a directory that ``transformers`` loads, its
``config.json`` the one the model carries (``model.hf_config``) or a given one checked to
build the model."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax.hf import safetensors_io, tables
from linattn_jax.hf.pretrained import abstract_model, flat_state, format_of
from linattn_jax.models import LanguageModel
from linattn_jax.models.options import freeze, thaw

# Fields save_pretrained writes from the model (not compared with its record).
WRITTEN = ("architectures", "dtype", "torch_dtype")


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
      model: a ``LanguageModel`` loaded by ``from_pretrained`` (or built by
        ``abstract_model``): it carries its ``config.json`` (``model.hf_config``), written
        back; or any ``LanguageModel`` with a ``config`` that builds it.
      path: the directory (created if needed). Shards of an earlier save there that this
        one does not write are removed (no second copy of the weights is left).
      config: None (the model's own), or a config (``from_pretrained``'s, or a
        ``config.json``'s contents) written in its place: it must build this model, the
        same options, structure and shapes (its other fields, ``eos_token_id`` and the
        like, are free); for a loaded model, a field that differs from the model's own and
        changes the model is named.
      model_type: where given, the model type the written config must be of (a check).
      max_shard_size: bytes or a size such as ``"5GB"`` per safetensors file (beyond it,
        shards and an index); None: one file.

    Raises:
      ValueError: a model that carries no config and no ``config`` given, a ``config`` of
        another model type than ``model_type``, or one that does not build this model
        (what differs named).
    """
    given = model.hf_config if config is None else config
    if given is None:
        raise ValueError(
            "the model carries no Hugging Face config (model.hf_config: it was not loaded by "
            "hf.from_pretrained): pass config=, a config.json's contents that builds it"
        )
    fmt = format_of(given)
    if model_type is not None and model_type not in fmt.model_types:
        raise ValueError(f"model_type={model_type!r}, but the config is {fmt.name}'s")
    config = fmt.normalize_config(thaw(given))
    _check_builds(model, config)
    flat = flat_state(nnx.state(model))
    table = tables.scanned_table(fmt.weight_table(config), model.period)
    rows = dict(table)

    def hf_tensor(name: str) -> np.ndarray:
        rule = rows[name]
        # An indexed row's slice is taken before the copy to the host.
        xs = [np.asarray(flat[p] if rule.index is None else flat[p][rule.index]) for p in rule.ours]
        return rule.how.to_hf(xs)

    shapes = {
        name: (
            tables.hf_shape(rule, [flat[p].shape for p in rule.ours]),
            jnp.dtype(flat[rule.ours[0]].dtype),
        )
        for name, rule in table
    }
    safetensors_io.write(path, shapes, hf_tensor, max_shard_size)
    config["architectures"] = [fmt.architecture]
    config["dtype"] = jnp.dtype(model.embed.embedding.dtype).name
    config.pop("torch_dtype", None)  # transformers' older name of dtype
    with open(os.path.join(os.fspath(path), "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _check_builds(model: LanguageModel, config: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` unless ``config`` (normalised) builds ``model``: the same
    options, the same structure (what the format's ``finish`` sets too) and shapes."""
    options = model.options
    rebuilt = abstract_model(
        config, options["dtype"], options["param_dtype"], scan_layers=options["scan_layers"]
    )
    record = model.hf_config
    rebuilt.hf_config = record
    same = rebuilt.options == options and nnx.graphdef(rebuilt) == nnx.graphdef(model)
    if same and _shapes(rebuilt) == _shapes(model):
        return
    if record is not None:
        differ = [
            f"config[{k!r}]={config.get(k)!r}, but the model has {thaw(record.get(k))!r}"
            for k in sorted(set(config) | set(record))
            if k not in WRITTEN and freeze(config.get(k)) != record.get(k)
        ]
        if differ:
            raise ValueError("; ".join(differ))
    raise ValueError(
        f"the {format_of(config).name} config builds another model: " + _difference(rebuilt, model)
    )


def _shapes(model) -> dict[str, tuple]:
    return {p: (x.shape, x.dtype) for p, x in flat_state(nnx.state(model)).items()}


def _difference(ours, theirs) -> str:
    """The first difference between two models, described (an option, an attribute of a
    layer, or a parameter's shape)."""
    for key in dict.fromkeys([*ours.options, *theirs.options]):
        if ours.options.get(key) != theirs.options.get(key):
            return (
                f"its option {key}={thaw(ours.options.get(key))!r}, the model's "
                f"{thaw(theirs.options.get(key))!r}"
            )
    for (path, a), (_, b) in zip(nnx.iter_graph(ours), nnx.iter_graph(theirs), strict=False):
        if not isinstance(a, nnx.Module):
            continue
        if type(a) is not type(b):
            return f"{_where(path)} is a {type(a).__name__}, the model's a {type(b).__name__}"
        for key, value in vars(a).items():
            other = vars(b).get(key)
            if (
                key.startswith("_")
                or nnx.graph.is_graph_node(value)
                or isinstance(value, nnx.Variable)
            ):
                continue
            if not _equal(value, other):
                return f"{_where(path)}.{key}={value!r}, the model's {other!r}"
    ours_shapes, theirs_shapes = _shapes(ours), _shapes(theirs)
    for p in dict.fromkeys([*ours_shapes, *theirs_shapes]):
        if ours_shapes.get(p) != theirs_shapes.get(p):
            return f"its {p} is {ours_shapes.get(p)}, the model's {theirs_shapes.get(p)}"
    return "its structure differs"


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays and the like: not options
        return True


def _where(path) -> str:
    return ".".join(map(str, path)) or "the model"
