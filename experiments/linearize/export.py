"""The student on disk. Where the teacher is a Hugging Face hybrid whose layer types name
each of the student's kinds (a Qwen3.5 teacher's softmax layers made Gated DeltaNet ones of
its own dimensions), its ``config.json`` with the student's ``layer_types``, written by
``hf.save_pretrained``: a directory ``transformers`` loads. Otherwise (a Llama's softmax
layers beside linearised ones: no ``transformers`` type holds them) the library's own format:
``linattn_jax.json``, the ``LanguageModel``'s constructor options (``model.options``), and
``model.safetensors``, one tensor per parameter under its ``nnx`` path. ``load_student``
reads either.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax import hf
from linattn_jax.hf import safetensors_io
from linattn_jax.models import LanguageModel
from linattn_jax.models.options import thaw

OPTIONS_FILE = "linattn_jax.json"
DTYPE_OPTIONS = ("dtype", "param_dtype")


def _flat(model) -> dict[str, nnx.Variable]:
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}


def hf_config_for(model: LanguageModel, teacher: LanguageModel) -> dict | None:
    """The teacher's Hugging Face config with ``model``'s layer types, where it has
    ``layer_types`` naming a layer of each of ``model``'s kinds; else None."""
    config = teacher.hf_config
    types = None if config is None else config.get("layer_types")
    if not isinstance(types, tuple) or len(types) != len(teacher.layout):
        return None
    labels = dict(zip(reversed(teacher.layout), reversed(types), strict=True))
    if any(kind not in labels for kind in model.layout):
        return None
    return dict(thaw(config), layer_types=[labels[kind] for kind in model.layout])


def save_student(
    model: LanguageModel, path: str | os.PathLike, teacher: LanguageModel | None = None
) -> str:
    """Writes ``model`` to the directory ``path`` (created): with ``hf.save_pretrained``
    where ``hf_config_for(model, teacher)`` gives a config that builds it, else in the
    library's own format. Returns which, in words."""
    config = None if teacher is None else hf_config_for(model, teacher)
    if config is not None:
        try:
            hf.save_pretrained(model, path, config)
        except ValueError as e:
            reason = f" (the teacher's {config['model_type']} config does not build it: {e})"
        else:
            return f"Hugging Face {config['model_type']} directory (hf.save_pretrained)"
    else:
        reason = ""
    options = thaw(model.options)
    for name in DTYPE_OPTIONS:
        if options.get(name) is not None:
            options[name] = jnp.dtype(options[name]).name
    flat = {name: np.asarray(v.get_value()) for name, v in _flat(model).items()}
    shapes = {name: (x.shape, x.dtype) for name, x in flat.items()}
    safetensors_io.write(path, shapes, flat.__getitem__)
    (Path(path) / OPTIONS_FILE).write_text(json.dumps(options, indent=2, sort_keys=True))
    return f"the library's own format ({OPTIONS_FILE} + model.safetensors){reason}"


def load_student(path: str | os.PathLike) -> LanguageModel:
    """The model ``save_student`` wrote to ``path``, bit for bit (in float32 from a Hugging
    Face directory, as the teacher is loaded).

    Raises:
      ValueError: neither ``linattn_jax.json`` nor ``config.json`` there, or a tensor
        missing or of another shape.
    """
    file = Path(path) / OPTIONS_FILE
    if not file.is_file() and (Path(path) / "config.json").is_file():
        return hf.from_pretrained(path, "float32", param_dtype="float32")[0]
    if not file.is_file():
        raise ValueError(f"{os.fspath(path)} has no {OPTIONS_FILE}: not a saved student")
    options = json.loads(file.read_text())
    for name in DTYPE_OPTIONS:
        if options.get(name) is not None:
            options[name] = np.dtype(jnp.dtype(options[name]))
    model = nnx.eval_shape(lambda: LanguageModel(**options, rngs=nnx.Rngs(0)))
    with safetensors_io.Checkpoint(path) as checkpoint:
        for name, variable in _flat(model).items():
            if name not in checkpoint.files:
                raise ValueError(f"{os.fspath(path)}: tensor {name!r} is missing")
            x = checkpoint.get(name)
            if x.shape != variable.get_value().shape:
                raise ValueError(
                    f"{os.fspath(path)}: tensor {name!r} has shape {x.shape}, the model's "
                    f"{variable.get_value().shape}"
                )
            variable.set_value(jnp.asarray(x))
    return model
