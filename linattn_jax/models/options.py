"""What a model was built from, recorded on it as data: its constructor's options as a
frozen, hashable mapping (a static attribute: ``nnx.jit`` keys compiled programs on it).

``LanguageModel(**thaw(model.options), rngs=...)`` builds the same model again;
``linattn_jax.hf`` records beside it the normalised ``config.json`` a checkpoint came from
(``model.hf_config``), which ``hf.save_pretrained`` writes back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


class Frozen(Mapping):
    """An immutable, hashable mapping (nested mappings and sequences frozen too: ``freeze``).

    Compares equal to another ``Frozen`` with the same items; ``thaw`` gives plain dicts
    and lists back.
    """

    __slots__ = ("_items", "_hash")

    def __init__(self, items: Mapping[str, Any]):
        object.__setattr__(self, "_items", {k: freeze(v) for k, v in items.items()})
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(frozenset(self._items.items())))
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Frozen) and self._items == other._items

    def __setattr__(self, name: str, value: Any):
        raise AttributeError(f"a Frozen mapping is read-only (setting {name!r})")

    def __repr__(self) -> str:
        return f"Frozen({self._items!r})"


def freeze(value: Any) -> Any:
    """``value`` with every mapping a ``Frozen``, every list or tuple a tuple and every dtype
    a ``numpy.dtype`` (hashable; a dtype compares equal however it was spelt)."""
    if isinstance(value, Frozen):
        return value
    if isinstance(value, Mapping):
        return Frozen(value)
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    if isinstance(value, type) and issubclass(value, np.generic) or _is_dtype_like(value):
        return np.dtype(value)
    return value


def _is_dtype_like(value: Any) -> bool:
    # jnp.bfloat16 and friends are scalar types with a dtype attribute, not np.generic.
    return isinstance(value, np.dtype) or (
        isinstance(value, type) and isinstance(getattr(value, "dtype", None), np.dtype)
    )


def thaw(value: Any) -> Any:
    """``freeze``'s inverse: ``Frozen`` mappings as dicts, tuples as lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value
