"""What every model type's module shares: a weight table's row (``Rule``) and its
conversions, the ``ModelFormat`` a module describes its model type with, and the checks of
a ``config.json``'s fields.

A model type's module (``qwen3_5.py`` is the model for one) defines ``FORMAT``, a
``ModelFormat``: how its ``config.json`` is read and checked, which ``LanguageModel`` it
builds, its weight table, and its config from a model. The loader (``pretrained.py``)
does the rest for every model type alike: reading, converting, casting and placing one
tensor at a time, refusing unknown tensors and fields by name, writing shards.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

Shapes = list[tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One way a Hugging Face tensor maps onto our parameter(s).

    Attributes:
      hf_shape: the Hugging Face tensor's shape from our parameters' shapes.
      to_ours: the tensor as our parameters (views; the loader casts and copies).
      to_hf: our parameters as the tensor (``to_ours``' inverse).
    """

    hf_shape: Callable[[Shapes], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, Shapes], list[np.ndarray]]
    to_hf: Callable[[list[np.ndarray]], np.ndarray]


def _split_cuts(shapes: Shapes) -> np.ndarray:
    return np.cumsum([s[1] for s in shapes])[:-1]


# ``Rule.how``: a model type's module may add its own (``CONVERSIONS["name"] = ...``).
CONVERSIONS: dict[str, Conversion] = {
    # the same array
    "copy": Conversion(lambda s: s[0], lambda x, s: [x], lambda xs: xs[0]),
    # nn.Linear's [out, in] is our kernel's [in, out]
    "linear": Conversion(lambda s: s[0][::-1], lambda x, s: [x.T], lambda xs: xs[0].T),
    # one fused nn.Linear: its rows split in the order of ``ours``, each transposed
    "split": Conversion(
        lambda s: (sum(x[1] for x in s), s[0][0]),
        lambda x, s: [part.T for part in np.split(x, _split_cuts(s), axis=0)],
        lambda xs: np.concatenate([x.T for x in xs], axis=0),
    ),
    # a depthwise nn.Conv1d's [c, 1, k] is our [k, c]
    "conv": Conversion(
        lambda s: (s[0][1], 1, s[0][0]), lambda x, s: [x[:, 0, :].T], lambda xs: xs[0].T[:, None, :]
    ),
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a weight table.

    Attributes:
      hf: the Hugging Face name (under the model's or the layer's prefix).
      ours: our parameter path(s) (under the model or block ``i``); several for a split.
      how: a key of ``CONVERSIONS``: ``"copy"``, ``"linear"`` (transpose), ``"split"``
        (rows split in the order of ``ours``, each transposed), ``"conv"``, or one a model
        type's module adds.
      index: None, or the tensor is the slice ``index`` of our one parameter along its
        first axis (per-expert tensors stacked into one parameter); the conversion then
        sees that slice's shape. A tuple (of ints and slices) indexes other axes too
        (a scanned model's layers: ``(layer // period, expert)``; Kimi Linear's and
        OLMo-Hybrid's q, k and v convs: channel ranges of our one conv kernel).
    """

    hf: str
    ours: tuple[str, ...]
    how: str
    index: int | tuple | None = None

    @property
    def conversion(self) -> Conversion:
        return CONVERSIONS[self.how]

    def at(self, hf: str, ours: Sequence[str], index: int | None = None) -> Rule:
        """The same conversion for full names (and a slice index)."""
        return Rule(hf, tuple(ours), self.how, self.index if index is None else index)


def rules(*rows) -> tuple[Rule, ...]:
    """Rules from ``(hf, ours or (ours, ...), how)`` rows."""
    return tuple(
        Rule(hf, (ours,) if isinstance(ours, str) else tuple(ours), how) for hf, ours, how in rows
    )


# Llama's rows, which several formats share: the model's (under the format's prefix), the
# untied head's (no prefix), a block's two norms and its softmax attention (no biases).
MODEL_RULES = rules(
    ("embed_tokens.weight", "embed.embedding", "copy"),
    ("norm.weight", "norm.scale", "copy"),
)
HEAD_RULE = Rule("lm_head.weight", ("head.kernel",), "linear")
NORM_RULES = rules(
    ("input_layernorm.weight", "attention_norm.scale", "copy"),
    ("post_attention_layernorm.weight", "mlp_norm.scale", "copy"),
)
ATTENTION_RULES = rules(
    ("self_attn.q_proj.weight", "attention.q_proj.kernel", "linear"),
    ("self_attn.k_proj.weight", "attention.k_proj.kernel", "linear"),
    ("self_attn.v_proj.weight", "attention.v_proj.kernel", "linear"),
    ("self_attn.o_proj.weight", "attention.out_proj.kernel", "linear"),
)


def prefixed(
    rows: Sequence[Rule],
    hf_prefix: str,
    ours_prefix: str,
    index: int | tuple[slice, ...] | None = None,
) -> list[tuple[str, Rule]]:
    """``(full hf name, rule with full paths)`` for rows under a layer's prefixes."""
    return [
        (hf_prefix + r.hf, r.at(hf_prefix + r.hf, [ours_prefix + p for p in r.ours], index))
        for r in rows
    ]


def slice_shapes(rule: Rule, shapes: Shapes) -> Shapes:
    """Our parameters' shapes as the rule's conversion sees them (one slice if indexed)."""
    if rule.index is None:
        return shapes
    # The slice's shape, from a view that allocates nothing (an int or a tuple of slices).
    return [np.broadcast_to(np.empty((), bool), s)[rule.index].shape for s in shapes]


def hf_shape(rule: Rule, shapes: Shapes) -> tuple[int, ...]:
    """The Hugging Face tensor's shape of ``rule`` given our parameters' shapes."""
    return tuple(rule.conversion.hf_shape(slice_shapes(rule, shapes)))


@dataclasses.dataclass(frozen=True)
class ModelFormat:
    """A Hugging Face model type as the loader reads and writes it.

    Attributes:
      name: a readable name ("Qwen3.5").
      model_types: the ``config.json`` ``model_type`` values it reads.
      normalize_config: a ``config.json``'s contents (a dict) -> the checked config the
        other functions take (defaults filled in as ``transformers`` fills them; a
        ``ValueError`` naming an unsupported or bad field).
      model_options: ``(config, dtype, param_dtype)`` -> ``LanguageModel``'s arguments
        (all but ``rngs``).
      weight_table: ``(config, prefix)`` -> every tensor of a checkpoint as ``(full name,
        Rule with our full paths)``, in the model's order.
      config_for_save: ``(model, config or None)`` -> the config ``save_pretrained``
        writes: the model's dimensions over ``config``'s other fields; a ``ValueError``
        where ``config`` describes another model (compared on what the model uses) or the
        model has no such form.
      prefixes: where the text model's tensors live in a file: the first is written, the
        one whose table names most of a file's tensors is read.
      ignored_prefixes: ``config`` -> names not read (multi-token prediction heads, a
        vision tower, a tied head's copy).
      finish: ``(abstract model, config)`` -> None: sets what the layers take no option for
        (e.g. norms' epsilon) on the built model; or None.
      architecture: ``config.json``'s ``architectures`` entry written on save.
    """

    name: str
    model_types: tuple[str, ...]
    normalize_config: Callable[[Mapping[str, Any]], dict[str, Any]]
    model_options: Callable[..., dict[str, Any]]
    weight_table: Callable[[Mapping[str, Any], str], list[tuple[str, Rule]]]
    config_for_save: Callable[[Any, Mapping[str, Any] | None], dict[str, Any]]
    prefixes: tuple[str, ...] = ("model.",)
    ignored_prefixes: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda config: ()
    finish: Callable[[Any, Mapping[str, Any]], None] | None = None


def language_model_options(
    config: Mapping[str, Any], dtype: Any, param_dtype: Any, **options: Any
) -> dict[str, Any]:
    """``LanguageModel``'s arguments (all but ``rngs``) from the fields most formats name
    alike (``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
    ``tie_word_embeddings``), the computation in ``dtype``, the parameters in
    ``param_dtype`` (None: ``dtype``), and a format's own ``options``."""
    return dict(
        vocab_size=config["vocab_size"],
        width=config["hidden_size"],
        depth=config["num_hidden_layers"],
        tie_embeddings=config["tie_word_embeddings"],
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
        **options,
    )


def model_fields(model) -> dict[str, Any]:
    """The config fields most formats name alike, read from ``model``
    (``language_model_options``' inverse): ``vocab_size``, ``hidden_size``,
    ``num_hidden_layers``, ``tie_word_embeddings`` and ``dtype`` (the parameters')."""
    return {
        "vocab_size": model.vocab_size,
        "hidden_size": model.embed.features,
        "num_hidden_layers": model.depth,
        "tie_word_embeddings": model.head is None,
        "dtype": jnp.dtype(model.embed.embedding[...].dtype).name,
    }


def tied_head_ignored(config: Mapping[str, Any]) -> tuple[str, ...]:
    """``("lm_head.",)`` where ``config`` ties the head (a checkpoint's copy of the
    embedding is not read), else ``()``."""
    return ("lm_head.",) if config["tie_word_embeddings"] else ()


def set_rms_norm_epsilon(model, eps) -> None:
    """Sets every ``nnx.RMSNorm`` of ``model`` to epsilon ``eps`` (the layers take no
    epsilon option)."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.RMSNorm):
            node.epsilon = float(eps)


def check_directory(path) -> None:
    """Raises ``ValueError`` unless ``path`` is a directory (a checkpoint's), before a
    missing file in it is named."""
    if not os.path.isdir(path):
        raise ValueError(f"{os.fspath(path)} is not a directory (a checkpoint's)")


def check_unrolled(model) -> None:
    """Raises ``ValueError`` for a model with scanned layers (a config describes layers one
    by one)."""
    if getattr(model, "period", None) is not None:
        raise ValueError("save_pretrained needs an unrolled model (scan_layers=False)")


# ---------------------------------------------------------------- checks of config fields


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check_model_type(raw: Mapping[str, Any], model_types: Sequence[str]) -> None:
    """Raises ``ValueError`` unless ``raw["model_type"]`` is one of ``model_types``."""
    if raw.get("model_type") not in model_types:
        raise ValueError(
            f"config.json: model_type must be one of {model_types}, got {raw.get('model_type')!r}"
        )


def with_defaults(
    raw: Mapping[str, Any],
    model_types: Sequence[str],
    defaults: Mapping[str, Any],
    keep_none: Sequence[str] = (),
) -> dict[str, Any]:
    """``raw`` (a ``config.json``'s contents) over ``defaults`` (``transformers``' values
    for the fields it leaves out); a null field takes its default too, but for those of
    ``keep_none`` (which ``transformers`` derives from other fields when null).

    Raises:
      ValueError: a ``model_type`` not of ``model_types``.
    """
    check_model_type(raw, model_types)
    keep = lambda k, v: v is not None or k not in defaults or k in keep_none
    return {**defaults, **{k: v for k, v in raw.items() if keep(k, v)}}


def check_ints(config: Mapping[str, Any], fields: Sequence[str], minimum: int = 1) -> None:
    """Raises ``ValueError`` naming the first of ``fields`` that is not an int >= minimum."""
    for field in fields:
        value = config.get(field)
        if not is_int(value) or value < minimum:
            raise ValueError(f"config.json: {field} must be an int >= {minimum}, got {value!r}")


def check_bools(config: Mapping[str, Any], fields: Sequence[str]) -> None:
    """Raises ``ValueError`` naming the first of ``fields`` that is not true or false."""
    for field in fields:
        if not isinstance(config[field], bool):
            raise ValueError(f"config.json: {field} must be true or false, got {config[field]!r}")


def check_false(config: Mapping[str, Any], fields: Sequence[str]) -> None:
    """Raises ``ValueError`` naming the first of ``fields`` that is not false (an option,
    such as a bias, that we do not implement)."""
    for field in fields:
        if config[field] is not False:
            raise ValueError(f"config.json: {field} must be false, got {config[field]!r}")


def check_positive(config: Mapping[str, Any], fields: Sequence[str]) -> None:
    """Raises ``ValueError`` naming the first of ``fields`` that is not a finite number
    > 0 (a multiplier)."""
    for field in fields:
        value = config[field]
        if not (is_number(value) and 0 < value < math.inf):
            raise ValueError(f"config.json: {field} must be a finite number > 0, got {value!r}")


def check_choice(config: Mapping[str, Any], field: str, allowed: Sequence[Any]) -> None:
    """Raises ``ValueError`` unless ``config[field]`` is one of ``allowed`` (compared with
    ``==`` and the same type, so ``True`` is not ``1``)."""
    value = config.get(field)
    if not any(value == a and type(value) is type(a) for a in allowed):
        shown = allowed[0] if len(allowed) == 1 else f"one of {list(allowed)}"
        raise ValueError(f"config.json: {field} must be {shown!r}, got {value!r}")


def check_divides(config: Mapping[str, Any], small: str, large: str) -> None:
    """Raises ``ValueError`` unless ``config[small]`` divides ``config[large]``."""
    if config[large] % config[small]:
        raise ValueError(
            f"config.json: {small}={config[small]} must divide {large}={config[large]}"
        )


def check_at_most(config: Mapping[str, Any], small: str, large: str) -> None:
    """Raises ``ValueError`` unless ``config[small] <= config[large]``."""
    if config[small] > config[large]:
        raise ValueError(f"config.json: {small}={config[small]} must be <= {large}={config[large]}")


def check_layer_types(config: Mapping[str, Any], kinds: Sequence[str]) -> None:
    """Raises ``ValueError`` unless ``config["layer_types"]`` lists ``num_hidden_layers``
    of ``kinds``."""
    types, n = config["layer_types"], config["num_hidden_layers"]
    if not isinstance(types, list) or len(types) != n or any(t not in kinds for t in types):
        raise ValueError(
            f"config.json: layer_types must list num_hidden_layers={n} of {list(kinds)}, "
            f"got {types!r}"
        )


def rope_parameters(config: Mapping[str, Any], theta: float | None) -> dict[str, Any]:
    """``config``'s ``rope_parameters`` as ``transformers`` fills them in: ``rope_type``
    ``"default"`` and ``rope_theta`` the top-level ``rope_theta``, else ``theta``, where
    absent."""
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", config.get("rope_theta", theta))
    return rope


def check_unsupported(config: Mapping[str, Any], supported: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming a field set to a value we do not implement:
    ``supported`` maps a field to the one value (or a tuple of values) we take; an absent
    field is taken as its first supported value."""
    for field, allowed in supported.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if field in config and config[field] is not None:
            check_choice(config, field, allowed)


def agree(fields: dict[str, Any], field: str, value: Any, where: str) -> None:
    """Records ``fields[field] = value``, raising ``ValueError`` if an earlier layer set
    another value (every layer of a kind must have the same sizes to make one config)."""
    if fields.setdefault(field, value) != value:
        raise ValueError(f"{where}: {field}={value} differs from the other layers' {fields[field]}")


def merge_for_save(
    derived: Mapping[str, Any], config: Mapping[str, Any] | None, unchecked: Sequence[str] = ()
) -> dict[str, Any]:
    """``config`` with ``derived`` (what the model determines) written over it, raising
    ``ValueError`` naming a field where ``config`` gives another value (``unchecked``
    fields are overwritten without a check: ``architectures``, ``dtype``, ...)."""
    merged = dict(config or {})
    for field, value in derived.items():
        if config is not None and field in config and field not in unchecked:
            if config[field] != value:
                raise ValueError(
                    f"config[{field!r}]={config[field]!r}, but the model has {value!r}"
                )
        merged[field] = value
    return merged
