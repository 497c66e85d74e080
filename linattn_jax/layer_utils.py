"""Small helpers shared by the Flax layers (``layers.py``, ``delta_layers.py``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def split_heads(x: jax.Array, heads: int) -> jax.Array:
    """``[b, t, h * d] -> [b, t, h, d]``."""
    return x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads))


def check_int(name: str, value: Any, minimum: int) -> None:
    """An int (not a bool) of at least ``minimum``, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_width(width: int, num_heads: int) -> None:
    check_int("width", width, 1)
    check_int("num_heads", num_heads, 1)
    if width % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide the width {width}")


def check_tokens(x: jax.Array, width: int) -> None:
    if x.ndim != 3 or x.shape[-1] != width:
        raise ValueError(f"x must have shape [batch, length, {width}], got {x.shape}")
