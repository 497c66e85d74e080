"""The student on disk: the library's own format, for models no ``transformers`` type holds
(a Llama's softmax layers beside linearised ones): ``linattn_jax.json``, the
``LanguageModel``'s constructor options (``model.options``), and ``model.safetensors``, one
tensor per parameter under its ``nnx`` path. A model loaded by ``hf.from_pretrained`` whose
layers are unchanged is better written with ``hf.save_pretrained``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from linattn_jax.hf import safetensors_io
from linattn_jax.models import LanguageModel
from linattn_jax.models.options import thaw

OPTIONS_FILE = "linattn_jax.json"
DTYPE_OPTIONS = ("dtype", "param_dtype")


def _flat(model) -> dict[str, nnx.Variable]:
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}


def save_student(model: LanguageModel, path: str | os.PathLike) -> None:
    """Writes ``model`` to the directory ``path`` (created): its options and parameters."""
    options = thaw(model.options)
    for name in DTYPE_OPTIONS:
        if options.get(name) is not None:
            options[name] = jnp.dtype(options[name]).name
    flat = {name: np.asarray(v.get_value()) for name, v in _flat(model).items()}
    shapes = {name: (x.shape, x.dtype) for name, x in flat.items()}
    safetensors_io.write(path, shapes, flat.__getitem__)
    (Path(path) / OPTIONS_FILE).write_text(json.dumps(options, indent=2, sort_keys=True))


def load_student(path: str | os.PathLike) -> LanguageModel:
    """The model ``save_student`` wrote to ``path``, bit for bit.

    Raises:
      ValueError: no ``linattn_jax.json`` there, or a tensor missing or of another shape.
    """
    file = Path(path) / OPTIONS_FILE
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
