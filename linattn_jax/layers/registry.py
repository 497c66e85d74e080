"""The one registry of attention kinds: each kind's layer, the options it reads, and what it
supports. The models, the trainer, the sweep and the recall experiment read it; adding a
kind is one entry here plus its layer file (``docs/development.md``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from flax import nnx

from linattn_jax.layers.delta import DeltaRuleAttention
from linattn_jax.layers.linear import LinearAttention
from linattn_jax.layers.softmax import SoftmaxAttention


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """One attention kind.

    Attributes:
      layer: the layer class, called as ``layer(width, num_heads, **options)``.
      label: a readable name (tables and plots).
      fixed: options the kind always sets (a caller may not change them).
      defaults: options the kind sets unless the caller gives them.
      options: the names of the options an experiment config may set for this kind
        (``model.<name>``); the others are not read for it.
      sequence_parallel: whether its layer splits one sequence over devices
        (``sequence_axis=``).
      takes_max_length: whether its layer takes ``max_length=``, the longest sequence it
        will see (cosFormer's reweighting, softmax's KV cache).
    """

    layer: Callable[..., nnx.Module]
    label: str
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: tuple[str, ...] = ()
    sequence_parallel: bool = True
    takes_max_length: bool = False


_LINEAR_OPTIONS = (
    "feature_map",
    "method",
    "chunk_size",
    "decay",
    "gate",
    "normalize",
    "num_features",
    "feature_dim",
)
_frozen = MappingProxyType

KINDS: Mapping[str, AttentionKind] = _frozen(
    {
        "linear": AttentionKind(
            LinearAttention, "linear attention", options=_LINEAR_OPTIONS, takes_max_length=True
        ),
        "softmax": AttentionKind(
            SoftmaxAttention, "softmax attention", sequence_parallel=False, takes_max_length=True
        ),
        "gla": AttentionKind(
            LinearAttention,
            "GLA",
            fixed=_frozen({"gate": "channel"}),
            defaults=_frozen({"feature_map": "identity", "normalize": False}),
            options=("method", "chunk_size"),
            takes_max_length=True,
        ),
        "deltanet": AttentionKind(
            DeltaRuleAttention,
            "DeltaNet",
            fixed=_frozen({"variant": "deltanet"}),
            options=("chunk_size",),
        ),
        "gated_deltanet": AttentionKind(
            DeltaRuleAttention,
            "Gated DeltaNet",
            fixed=_frozen({"variant": "gated_deltanet"}),
            options=("chunk_size",),
        ),
        "kda": AttentionKind(
            DeltaRuleAttention, "KDA", fixed=_frozen({"variant": "kda"}), options=("chunk_size",)
        ),
    }
)
ATTENTION_KINDS = tuple(KINDS)


def get(kind: str) -> AttentionKind:
    """The registered ``kind``, or a ValueError naming the kinds there are."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    return KINDS[kind]


def make_attention(kind: str, width: int, num_heads: int, **options: Any) -> nnx.Module:
    """An attention layer of ``kind`` (one of ``ATTENTION_KINDS``) from one set of options.

    ``"linear"``: ``LinearAttention``; ``"softmax"``: ``SoftmaxAttention``; ``"gla"``:
    ``LinearAttention`` with GLA's per-channel gate (``gate="channel"``), by default over
    the identity map without a denominator (``feature_map="identity"``,
    ``normalize=False``: an output RMSNorm per head); ``"deltanet"``,
    ``"gated_deltanet"``, ``"kda"``: ``DeltaRuleAttention`` of that variant.

    Raises:
      ValueError: an unknown kind, or an option that contradicts one the kind fixes.
    """
    spec = get(kind)
    for name, value in spec.fixed.items():
        if name in options and options[name] != value:
            raise ValueError(f"{kind}'s {name} is {value!r}, got {name}={options[name]!r}")
    return spec.layer(width, num_heads, **{**spec.defaults, **options, **spec.fixed})
