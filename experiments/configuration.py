"""Experiment configs: a ``configs/<experiment>.py`` file's ``get_config``, its fields
under flat dotted names (``model.width``), and ``field=value`` overrides of a locked
config, where an unknown field is named with the closest known one.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict


def load_config(spec: str) -> ConfigDict:
    """``"configs/mqar.py:small"`` -> that file's ``get_config("small")``."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None or not Path(path).is_file():
        raise ValueError(f"config file not found: {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def flatten(config: ConfigDict | dict, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"width": 64}}`` -> ``{"model.width": 64}``."""
    out = {}
    for key, value in config.items():
        if isinstance(value, ConfigDict | dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Names other code bases give some fields (a leaf of ours on the right).
SYNONYMS = {
    "learning_rate": "lr",
    "beta1": "b1",
    "beta2": "b2",
    "clip": "grad_clip",
    "max_grad_norm": "grad_clip",
    "warmup": "warmup_steps",
    "heads": "num_heads",
    "n_heads": "num_heads",
    "layers": "depth",
    "num_layers": "depth",
    "n_layers": "depth",
    "d_model": "width",
    "hidden_size": "width",
    "num_steps": "steps",
    "max_steps": "steps",
    "seq_length": "seq_len",
    "max_length": "seq_len",
}


def _initials(leaf: str) -> str:
    """``"learning_rate"`` -> ``"lr"``."""
    return "".join(word[0] for word in leaf.split("_") if word)


def closest_field(config: ConfigDict, name: str) -> str | None:
    """The known field ``name`` most likely means, or None: in the same section a synonym
    or initials (``optim.learning_rate`` -> ``optim.lr``, ``optim.wd`` ->
    ``optim.weight_decay``), else a close spelling (``model.widht`` -> ``model.width``)."""
    fields = list(flatten(config))
    section, _, leaf = name.rpartition(".")
    siblings = {f.rpartition(".")[2]: f for f in fields if f.rpartition(".")[0] == section}
    for candidate in (SYNONYMS.get(leaf), _initials(leaf)):
        if candidate in siblings and candidate != leaf:
            return siblings[candidate]
    for sibling, field in siblings.items():
        if len(leaf) > 1 and _initials(sibling) == leaf:
            return field
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_field(config: ConfigDict, name: str) -> ValueError:
    """The error for a field ``config`` lacks, with a did-you-mean hint when one is close."""
    close = closest_field(config, name)
    hint = f" (did you mean {close!r}?)" if close else ""
    return ValueError(f"unknown config field {name!r}{hint}")


def override(config: ConfigDict, assignment: str) -> None:
    """Applies ``"optim.lr=3e-4"`` to a locked config.

    Raises:
      ValueError: no ``=``, an unknown field (naming the closest one), or a value
        that is not of the field's type.
    """
    name, sep, text = assignment.partition("=")
    if not sep:
        raise ValueError(f"an override must look like field=value, got {assignment!r}")
    *parents, leaf = name.split(".")
    node = config
    for part in parents:
        if not isinstance(node, ConfigDict) or part not in node:
            raise _unknown_field(config, name)
        node = node[part]
    if not isinstance(node, ConfigDict) or leaf not in node or isinstance(node[leaf], ConfigDict):
        raise _unknown_field(config, name)
    old = node[leaf]
    try:
        if isinstance(old, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError
            value = text.lower() == "true"
        elif isinstance(old, int):
            value = int(text)
        elif isinstance(old, float):
            value = float(text)
        else:
            value = text
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}[type(old)]
        raise ValueError(f"{name} must be {kind}, got {text!r}") from None
    node[leaf] = value
