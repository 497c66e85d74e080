"""RoPE as released configs write it: ``rope_parameters`` (or the legacy ``rope_scaling``,
which replaces it, and its ``type`` key), the top-level ``rope_theta``, and the scalings
of ``layers.rope_scaling`` (``linear``, ``dynamic``, ``yarn``, ``llama3``,
``proportional``) with the fields
``transformers`` fills in: ``original_max_position_embeddings`` (the top-level one, else
``max_position_embeddings``), YaRN's ``factor`` (their ratio) where null, and ``dynamic``'s
length (``max_position_embeddings``). An unknown ``rope_type`` is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from linattn_jax.hf import common
from linattn_jax.layers.rope_scaling import ROPE_TYPES, parse_rope_scaling

_NOT_SCALING = ("rope_type", "rope_theta")


def parameters(theta: float, keys: Sequence[str] = ()) -> common.Step:
    """The step folding ``rope_scaling``, ``type`` and the top-level ``rope_theta`` (else
    ``theta``) into one checked ``rope_parameters``; ``keys``: other fields it may hold
    (``partial_rotary_factor``), read by the model type."""

    def step(config: common.Config) -> None:
        field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
        rope = normalize(config.get(field) or {}, config, config.get("rope_theta", theta), keys)
        config.pop("rope_scaling", None)
        config.pop("rope_theta", None)
        config["rope_parameters"] = rope

    return step


def normalize(
    given: Any, config: Mapping[str, Any], theta: Any, keys: Sequence[str] = (), name=""
) -> dict[str, Any]:
    """One RoPE dict (``rope_parameters``, or its entry ``name`` for a layer type) as
    ``transformers`` fills it in (``rope_theta`` ``theta`` where absent), checked."""
    field = f"rope_parameters[{name!r}]" if name else "rope_parameters"
    if not isinstance(given, Mapping):
        raise ValueError(f"config.json: {field} must be a dict, got {given!r}")
    rope = dict(given)
    legacy = rope.pop("type", "default")
    rope.setdefault("rope_type", legacy)
    rope.setdefault("rope_theta", theta)
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"config.json: {field}' rope_type must be one of {list(ROPE_TYPES)}, got {kind!r}"
        )
    if kind in ("yarn", "llama3"):
        original = config.get("original_max_position_embeddings")
        if original is not None:  # Phi-3's top-level one wins, as in transformers
            rope["original_max_position_embeddings"] = original
        rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    if kind == "yarn" and rope.get("factor") is None:
        rope["factor"] = (
            config["max_position_embeddings"] / rope["original_max_position_embeddings"]
        )
    if not common.is_number(rope["rope_theta"]) or not rope["rope_theta"] > 0:
        raise ValueError(
            f"config.json: {field}' rope_theta must be > 0, got {rope['rope_theta']!r}"
        )
    try:  # the rotated channels are the layer's to check
        parse_rope_scaling(scaling(rope, config, keys), rotary_dim=4)
    except ValueError as e:
        raise ValueError(f"config.json: {field}: {e}") from None
    return rope


def scaling(
    rope: Mapping[str, Any], config: Mapping[str, Any], keys: Sequence[str] = ()
) -> dict[str, Any] | None:
    """``SoftmaxAttention``'s ``rope_scaling`` of checked ``rope_parameters`` (None for
    ``"default"``), less ``keys``."""
    if rope["rope_type"] == "default":
        extra = sorted(set(rope) - set(_NOT_SCALING) - set(keys))
        return {"rope_type": "default", **{k: rope[k] for k in extra}} if extra else None
    options = {k: v for k, v in rope.items() if k not in _NOT_SCALING + tuple(keys)}
    if rope["rope_type"] == "dynamic":
        options["original_max_position_embeddings"] = config["max_position_embeddings"]
    return {"rope_type": rope["rope_type"], **options}


def options(config: Mapping[str, Any], rope: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``SoftmaxAttention``'s RoPE options of a normalised config (of its ``rope``, by
    default its ``rope_parameters``): ``rope=True``, ``rope_theta``, ``rope_scaling`` and a
    ``partial_rotary_factor`` where the type reads one (the steps refused it elsewhere)."""
    rope = config["rope_parameters"] if rope is None else rope
    # "proportional" reads its factor itself, over the whole head (layers.rope_scaling).
    own = rope["rope_type"] == "proportional"
    partial = None if own else rope.get("partial_rotary_factor")
    return dict(
        rope=True,
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=scaling(rope, config, () if own else ("partial_rotary_factor",)),
        **({} if partial is None else {"partial_rotary_factor": float(partial)}),
    )
