"""What every model type's module shares: ``ModelFormat`` (a model type as the loader
reads and writes it; a derived type is its base's ``derive``), the normalising steps a
``config.json`` goes through (``defaults``, the field checks as values: ``ints``,
``bools``, ``choice``, ...), and the finishing of a built model (``rms_norm_eps``).

A model type's module (``qwen3_5.py`` is the model for one; ``docs/development.md``:
"Adding a model type") defines ``FORMAT``. The loader (``pretrained.py``) does the rest
for every model type alike.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

from linattn_jax.hf.tables import HEAD_RULE, Rule, Table

Config = dict[str, Any]
Step = Callable[[Config], None]  # a config (in place): fills fields in, or raises


@dataclasses.dataclass(frozen=True)
class ModelFormat:
    """A Hugging Face model type as the loader reads and writes it.

    A derived model type states only what differs from its base: ``base.derive(name=...,
    steps=base.steps + (...), options=...)`` (``dataclasses.replace``).

    Attributes:
      name: a readable name ("Qwen3.5").
      model_types: the ``config.json`` ``model_type`` values it reads.
      architecture: ``config.json``'s ``architectures`` entry written on save.
      steps: what turns a ``config.json``'s contents into the checked config, in order
        (each a ``Step``: defaults as ``transformers`` fills them, derived fields, checks
        raising a ``ValueError`` that names the field).
      options: ``config -> `` the ``LanguageModel`` arguments besides ``vocab_size``,
        ``width``, ``depth``, ``tie_embeddings`` and the dtypes (which it may override).
      table: ``(config, prefix) ->`` every tensor of a checkpoint but the output head's as
        ``(full name, Rule with our full paths)``, in the model's order
        (``tables.layered`` for most).
      prefixes: where the text model's tensors live in a file: the first is written, the
        one whose table names most of a file's tensors is read.
      ignored: ``config ->`` name prefixes not read (multi-token prediction heads, a
        vision tower).
      ties_head: whether ``tie_word_embeddings`` ties the output head to the embedding, as
        in most model types (then a checkpoint's ``lm_head.weight`` is a copy, not read);
        False: ``transformers``' model has its own head whatever the config says (Kimi
        Linear, Nemotron-H, xLSTM), read and written as ``lm_head.weight``.
      finish: ``(abstract model, config) -> None``: sets what the layers take no option
        for (norms' epsilon) on the built model; or None.
      head: the untied output head's row (``lm_head.weight``; RWKV's ``head.weight``).
    """

    name: str
    model_types: tuple[str, ...]
    architecture: str
    steps: tuple[Step, ...]
    options: Callable[[Mapping[str, Any]], dict[str, Any]]
    table: Callable[[Mapping[str, Any], str], Table]
    prefixes: tuple[str, ...] = ("model.",)
    ignored: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda config: ()
    ties_head: bool = True
    finish: Callable[[Any, Mapping[str, Any]], None] | None = None
    head: Rule = HEAD_RULE

    def derive(self, **changes: Any) -> ModelFormat:
        """This format with ``changes`` (``dataclasses.replace``): a derived model type."""
        return dataclasses.replace(self, **changes)

    def normalize_config(self, raw: Mapping[str, Any]) -> Config:
        """A ``config.json``'s contents (a dict) as the checked config the loader takes.

        Raises:
          ValueError: an unknown ``model_type``, or a field missing, of the wrong type or
            unsupported, named.
        """
        check_model_type(raw, self.model_types)
        config = dict(raw)
        for step in self.steps:
            step(config)
        return config

    def model_options(
        self, config: Mapping[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None
    ) -> dict[str, Any]:
        """``LanguageModel``'s arguments (all but ``rngs``) of a normalised config: the
        computation in ``dtype``, the parameters in ``param_dtype`` (None: ``dtype``)."""
        return {
            "vocab_size": config["vocab_size"],
            "width": config["hidden_size"],
            "depth": config.get("num_hidden_layers"),  # or the format's own (Nemotron-H)
            "tie_embeddings": self.tied(config),
            "dtype": dtype,
            "param_dtype": dtype if param_dtype is None else param_dtype,
            **self.options(config),
        }

    def tied(self, config: Mapping[str, Any]) -> bool:
        """Whether the model of ``config`` (normalised) ties its output head."""
        return self.ties_head and config["tie_word_embeddings"]

    def weight_table(self, config: Mapping[str, Any], prefix: str | None = None) -> Table:
        """Every tensor of a checkpoint of ``config`` (normalised) under ``prefix`` (None:
        the format's first); an untied head's ``lm_head.weight`` last."""
        rows = self.table(config, self.prefixes[0] if prefix is None else prefix)
        return rows if self.tied(config) else [*rows, (self.head.hf, self.head)]

    def ignored_names(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The name prefixes not read: ``ignored``'s, and a tied head's copy."""
        head = self.head.hf.rsplit(".", 1)[0] + "."  # lm_head., head.
        return self.ignored(config) + ((head,) if self.tied(config) else ())


def rms_norm_eps(field: str) -> Callable[[Any, Mapping[str, Any]], None]:
    """A ``finish`` setting every ``nnx.RMSNorm`` of the model to ``config[field]`` (the
    layers take no epsilon option)."""

    def finish(model, config: Mapping[str, Any]) -> None:
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.RMSNorm):
                node.epsilon = float(config[field])

    return finish


def check_directory(path) -> None:
    """Raises ``ValueError`` unless ``path`` is a directory (a checkpoint's), before a
    missing file in it is named."""
    if not os.path.isdir(path):
        raise ValueError(f"{os.fspath(path)} is not a directory (a checkpoint's)")


# ------------------------------------------------------------ steps of a config's reading


def defaults(values: Mapping[str, Any], keep_none: Sequence[str] | bool = ()) -> Step:
    """The step filling in ``values`` (``transformers``' defaults of the fields a
    ``config.json`` leaves out); a null field takes its default too, but for those of
    ``keep_none`` (which ``transformers`` derives from other fields when null; True: every
    field, whose null the checks then refuse)."""
    keep = tuple(values) if keep_none is True else tuple(keep_none or ())

    def step(config: Config) -> None:
        for field, value in values.items():
            if config.get(field) is None and (field not in config or field not in keep):
                config[field] = value

    return step


def ints(fields: Sequence[str], minimum: int = 1) -> Step:
    """The step checking that each of ``fields`` is an int >= ``minimum``."""
    return lambda config: check_ints(config, fields, minimum)


def bools(fields: Sequence[str]) -> Step:
    """The step checking that each of ``fields`` is true or false."""
    return lambda config: check_bools(config, fields)


def false(fields: Sequence[str]) -> Step:
    """The step checking that each of ``fields`` is false (an option we do not implement)."""
    return lambda config: check_false(config, fields)


def numbers(fields: Sequence[str]) -> Step:
    """The step checking that each of ``fields`` is a number."""

    def step(config: Config) -> None:
        for field in fields:
            if not is_number(config[field]):
                raise ValueError(f"config.json: {field} must be a number, got {config[field]!r}")

    return step


def positive(fields: Sequence[str]) -> Step:
    """The step checking that each of ``fields`` is a finite number > 0."""
    return lambda config: check_positive(config, fields)


def choice(field: str, allowed: Sequence[Any]) -> Step:
    """The step checking that ``field`` is one of ``allowed``."""
    return lambda config: check_choice(config, field, allowed)


def divides(small: str, large: str) -> Step:
    """The step checking that ``small`` divides ``large``."""
    return lambda config: check_divides(config, small, large)


def at_most(small: str, large: str) -> Step:
    """The step checking that ``small <= large``."""
    return lambda config: check_at_most(config, small, large)


def unsupported(supported: Mapping[str, Any]) -> Step:
    """The step ``check_unsupported(config, supported)``."""
    return lambda config: check_unsupported(config, supported)


# ---------------------------------------------------------------- checks of config fields


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check_model_type(raw: Mapping[str, Any], model_types: Sequence[str]) -> None:
    """Raises ``ValueError`` unless ``raw["model_type"]`` is one of ``model_types``."""
    if raw.get("model_type") not in model_types:
        raise ValueError(
            f"config.json: model_type must be one of {tuple(model_types)}, got "
            f"{raw.get('model_type')!r}"
        )


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


def check_number(config: Mapping[str, Any], field: str, low: float, high: float) -> None:
    """Raises ``ValueError`` unless ``config[field]`` is a number in ``(low, high)``."""
    value = config[field]
    if not is_number(value) or not low < value < high:
        raise ValueError(
            f"config.json: {field} must be a number in ({low:g}, {high:g}), got {value!r}"
        )


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


def check_layer_types(
    config: Mapping[str, Any], kinds: Sequence[str], field: str = "layer_types"
) -> None:
    """Raises ``ValueError`` unless ``config[field]`` lists ``num_hidden_layers`` of
    ``kinds``."""
    types, n = config[field], config["num_hidden_layers"]
    if not isinstance(types, list) or len(types) != n or any(t not in kinds for t in types):
        raise ValueError(
            f"config.json: {field} must list num_hidden_layers={n} of {list(kinds)}, got {types!r}"
        )


def rope_parameters(config: Mapping[str, Any], theta: float | None) -> dict[str, Any]:
    """``config``'s ``rope_parameters`` as ``transformers`` fills them in: ``rope_type``
    ``"default"`` and ``rope_theta`` the top-level ``rope_theta``, else ``theta``, where
    absent."""
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", config.get("rope_theta", theta))
    return rope


def plain_rope(theta: float | None, allow_null: bool = False) -> Step:
    """The step folding the top-level ``rope_theta`` (else ``theta``) into
    ``rope_parameters`` and checking it plain: ``rope_type`` ``"default"``, a number
    ``rope_theta`` (or, ``allow_null``, null: no RoPE)."""

    def step(config: Config) -> None:
        rope = rope_parameters(config, theta)
        value = rope["rope_theta"]
        if rope["rope_type"] != "default" or not (
            is_number(value) or (allow_null and value is None)
        ):
            kind = "a number (or null: no RoPE)" if allow_null else "a number"
            raise ValueError(
                f"config.json: rope_parameters must have rope_type 'default' and {kind} "
                f"rope_theta, got {rope!r}"
            )
        config["rope_parameters"] = rope
        config.pop("rope_theta", None)

    return step


def check_unsupported(config: Mapping[str, Any], supported: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming a field set to a value we do not implement:
    ``supported`` maps a field to the one value (or a tuple of values) we take; an absent
    field is taken as its first supported value."""
    for field, allowed in supported.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if field in config and config[field] is not None:
            check_choice(config, field, allowed)
