"""RoPE's frequency scalings as released checkpoints set them (``rope_type``): ``"default"``,
``"linear"``, ``"dynamic"`` (NTK), ``"yarn"`` (Peng et al. 2023), ``"llama3"`` and
``"proportional"`` (the first ``partial_rotary_factor`` of the head's frequencies, the rest
0: a partial RoPE whose pairs and frequencies are the whole head's; LFM3): the inverse
frequencies ``rope.apply_rope`` rotates by and its cosines' and sines' factor (YaRN's; else 1),
as ``transformers``' ``ROPE_INIT_FUNCTIONS``. ``"dynamic"``'s length is the call's largest
position plus one (at least ``original_max_position_embeddings``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "proportional")
_NEEDS = dict(linear=("factor",), dynamic=("factor", "original_max_position_embeddings"))
_NEEDS["yarn"] = _NEEDS["dynamic"]
_NEEDS["llama3"] = _NEEDS["dynamic"] + ("low_freq_factor", "high_freq_factor")
_OPTIONAL = dict(proportional=("factor", "partial_rotary_factor"))
_YARN = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A checked scaling (``parse_rope_scaling``), the fields its type does not read at their
    defaults; ``attention_factor`` resolved (YaRN's from ``factor`` and the mscales)."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 1.0
    truncate: bool = True
    partial_rotary_factor: float = 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 mscale ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def parse_rope_scaling(options: Mapping[str, Any] | None, rotary_dim: int) -> RopeScaling | None:
    """``options`` (``{"rope_type": ..., "factor": ..., ...}``; None: no scaling) checked.

    Raises:
      ValueError: an unknown ``rope_type`` (named), a field the type lacks or does not read.
    """
    if options is None:
        return None
    options = dict(options)
    kind = options.pop("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope_type must be one of {ROPE_TYPES}, got {kind!r}")
    needs = _NEEDS.get(kind, ())
    allowed = needs + (_YARN if kind == "yarn" else ()) + _OPTIONAL.get(kind, ())
    unknown, missing = sorted(set(options) - set(allowed)), sorted(set(needs) - set(options))
    if unknown or missing:
        raise ValueError(f"rope_scaling ({kind}): unknown {unknown}, missing {missing}")
    for name, value in options.items():
        if name == "truncate" and not isinstance(value, bool):
            raise ValueError(f"rope_scaling: truncate must be true or false, got {value!r}")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        low = 0 if name.startswith("mscale") else math.ulp(0)  # an mscale of 0 is none
        if name != "truncate" and not (number and low <= value < math.inf):
            raise ValueError(f"rope_scaling: {name} must be a finite number > 0, got {value!r}")
    if kind == "dynamic" and rotary_dim < 4:
        raise ValueError(f"rope_type 'dynamic' needs rotary_dim >= 4, got {rotary_dim}")
    s = RopeScaling(kind, **options)
    if kind == "yarn" and "attention_factor" not in options:  # mscale 0: 1
        top, bottom = (s.mscale, s.mscale_all_dim) if s.mscale and s.mscale_all_dim else (1, 0)
        factor = yarn_mscale(s.factor, top) / yarn_mscale(s.factor, bottom)
        s = dataclasses.replace(s, attention_factor=factor)
    return s


def yarn_ramp(s: RopeScaling, rotary_dim: int, theta: float) -> np.ndarray:
    """YaRN's ``[rotary_dim // 2]`` weights of the interpolated frequencies (0: turning over
    ``beta_fast`` times in the original length, 1: under ``beta_slow``)."""
    n0 = s.original_max_position_embeddings
    edge = lambda beta: rotary_dim * math.log(n0 / (beta * 2 * math.pi)) / (2 * math.log(theta))
    low, high = edge(s.beta_fast), edge(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    return np.clip((np.arange(rotary_dim // 2) - low) / ((high - low) or 0.001), 0, 1)


def inverse_frequencies(
    scaling: RopeScaling | None, rotary_dim: int, theta: float, seq_len: Any = None
) -> jax.Array:
    """The ``[rotary_dim // 2]`` float32 inverse frequencies; ``seq_len`` (an int or a
    traced scalar) is read by ``"dynamic"`` only (None: its original length)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    s = scaling or RopeScaling()
    if s.rope_type == "dynamic":  # a larger base, the longer the sequence
        original = s.original_max_position_embeddings
        n = original if seq_len is None else jnp.maximum(seq_len, original).astype(jnp.float32)
        base = theta * (s.factor * n / original - (s.factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return 1.0 / base ** jnp.asarray(exponents, jnp.float32)
    inv = 1.0 / theta**exponents
    if s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "proportional":  # the other pairs are not rotated (frequency 0)
        kept = np.arange(rotary_dim // 2) < int(s.partial_rotary_factor * rotary_dim // 2)
        inv = np.where(kept, inv, 0.0) / s.factor
    elif s.rope_type == "yarn":
        ramp = yarn_ramp(s, rotary_dim, theta)
        inv = inv / s.factor * ramp + inv * (1 - ramp)
    elif s.rope_type == "llama3":  # long wavelengths divided by factor, short kept, smoothed
        original = s.original_max_position_embeddings
        low, high = s.low_freq_factor, s.high_freq_factor
        wavelength = 2 * math.pi / inv
        smooth = (original / wavelength - low) / (high - low)
        inv = np.where(wavelength > original / low, inv / s.factor, inv)
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        inv = np.where(medium, (1 - smooth) * inv / s.factor + smooth * inv, inv)
    return jnp.asarray(inv, jnp.float32)
