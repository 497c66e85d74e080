"""The one registry of attention kinds: each kind's layer, the options it reads, and what it
supports. The models, the trainer, the sweep and the recall experiment read it; adding a
kind is one entry here plus its layer file (``docs/development.md``)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from flax import nnx

from linattn_jax.layers.delta import DeltaRuleAttention
from linattn_jax.layers.gated_conv import GatedShortConv
from linattn_jax.layers.indexed import IndexedAttention
from linattn_jax.layers.lightning import LightningAttention
from linattn_jax.layers.linear import LinearAttention
from linattn_jax.layers.linearized import LinearizedAttention
from linattn_jax.layers.mamba import MambaMixer
from linattn_jax.layers.mamba2 import Mamba2Mixer
from linattn_jax.layers.mla import LatentAttention
from linattn_jax.layers.mlstm import MLSTMLayer
from linattn_jax.layers.rglru import RGLRUBlock
from linattn_jax.layers.rwkv import RWKVTimeMix
from linattn_jax.layers.softmax import SoftmaxAttention


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """One attention kind.

    Attributes:
      layer: the layer class, called as ``layer(width, num_heads, **options)``; None for
        the kind without a mixer (``"mlp"``: the block is its MLP alone).
      label: a readable name (tables and plots).
      fixed: options the kind always sets (a caller may not change them).
      defaults: options the kind sets unless the caller gives them.
      options: the names of the options an experiment config may set for this kind
        (``model.<name>``); the others are not read for it.
      sequence_parallel: whether its layer splits one sequence over devices
        (``sequence_axis=``).
      takes_max_length: whether its layer takes ``max_length=``, the longest sequence it
        will see (cosFormer's reweighting, softmax's KV cache).
      section: the experiment config's section of the family's own layer options
        (``model.<section>.<option>``: ``"softmax"``, ``"delta"``), or None.
      section_options: the options read from that section (``num_heads`` there overrides
        the model's for this kind's layers).
      takes_layer_index: whether its layer takes ``layer_index=`` and ``num_layers=``
        (its place in the model: Lightning's decays); the stack passes them.
    """

    layer: Callable[..., nnx.Module] | None
    label: str
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: tuple[str, ...] = ()
    sequence_parallel: bool = True
    takes_max_length: bool = False
    section: str | None = None
    section_options: tuple[str, ...] = ()
    takes_layer_index: bool = False


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
_SOFTMAX_OPTIONS = (
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope",
    "rope_theta",
    "partial_rotary_factor",
    "qk_norm",
    "zero_centred_qk_norm",
    "output_gate",
    "sliding_window",
)
_MLA_OPTIONS = (
    "num_heads",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope",
    "rope_theta",
)
_DELTA_OPTIONS = ("num_heads", "num_v_heads", "head_dim", "value_head_dim", "conv_size")
_DELTA = dict(section="delta", section_options=_DELTA_OPTIONS)
_MAMBA2_OPTIONS = ("num_heads", "head_dim", "state_dim", "n_groups", "expand", "conv_size")
_frozen = MappingProxyType

KINDS: Mapping[str, AttentionKind] = _frozen(
    {
        "linear": AttentionKind(
            LinearAttention, "linear attention", options=_LINEAR_OPTIONS, takes_max_length=True
        ),
        "softmax": AttentionKind(
            SoftmaxAttention,
            "softmax attention",
            sequence_parallel=False,
            takes_max_length=True,
            section="softmax",
            section_options=_SOFTMAX_OPTIONS,
        ),
        # The local layers of a model that has global ones beside them (Gemma's, Qwen2's
        # windowed layers): softmax attention with options of its own, set through
        # kind_options["local_softmax"] (its sliding_window, its RoPE base).
        "local_softmax": AttentionKind(
            SoftmaxAttention,
            "local softmax attention",
            sequence_parallel=False,
            takes_max_length=True,
        ),
        # Multi-head latent attention (DeepSeek-V2/V3, Kimi Linear): a compressed KV cache.
        "mla": AttentionKind(
            LatentAttention,
            "MLA",
            sequence_parallel=False,
            takes_max_length=True,
            section="mla",
            section_options=_MLA_OPTIONS,
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
            **_DELTA,
        ),
        "gated_deltanet": AttentionKind(
            DeltaRuleAttention,
            "Gated DeltaNet",
            fixed=_frozen({"variant": "gated_deltanet"}),
            options=("chunk_size",),
            **_DELTA,
        ),
        "kda": AttentionKind(
            DeltaRuleAttention,
            "KDA",
            fixed=_frozen({"variant": "kda"}),
            options=("chunk_size",),
            **_DELTA,
        ),
        "mamba2": AttentionKind(
            Mamba2Mixer,
            "Mamba-2",
            options=("method", "chunk_size"),
            section="mamba2",
            section_options=_MAMBA2_OPTIONS,
        ),
        "lightning": AttentionKind(
            LightningAttention,
            "Lightning attention",
            options=("method", "chunk_size"),
            section="lightning",
            section_options=("num_heads", "head_dim"),
            takes_layer_index=True,
        ),
        "mlstm": AttentionKind(
            MLSTMLayer,
            "mLSTM (xLSTM)",
            options=("method", "chunk_size"),
        ),
        # A softmax layer's parameters with a learned linear core (linearised transformers).
        "linearized": AttentionKind(
            LinearizedAttention,
            "linearised softmax (Hedgehog, LoLCATs)",
            options=("method", "chunk_size"),
            sequence_parallel=False,
            section="softmax",
            section_options=tuple(o for o in _SOFTMAX_OPTIONS if o != "sliding_window"),
        ),
        "mamba": AttentionKind(
            MambaMixer,
            "Mamba (selective scan)",
            options=("method", "chunk_size"),
        ),
        # No mixer: an MLP-only block (Nemotron-H's "-" layers).
        "mlp": AttentionKind(None, "MLP only"),
        # LFM2's gated short convolution: no attention, a causal conv between two gates.
        "gated_conv": AttentionKind(
            GatedShortConv, "gated short convolution (LFM2)", sequence_parallel=False
        ),
        # RWKV-4's time mix; its block's MLP is the channel mix (mlp="rwkv").
        "rwkv": AttentionKind(
            RWKVTimeMix, "RWKV-4", options=("method", "chunk_size"), sequence_parallel=False
        ),
        # Griffin's recurrent block (RecurrentGemma): gated branch, conv, RG-LRU.
        "rglru": AttentionKind(
            RGLRUBlock,
            "RG-LRU (Griffin)",
            options=("method", "chunk_size"),
        ),
        # Qwen4-Exp's indexed sparse attention (QSA): softmax over the blocks an indexer picks.
        "indexed_softmax": AttentionKind(
            IndexedAttention,
            "indexed sparse softmax attention (QSA)",
            sequence_parallel=False,
            takes_max_length=True,
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

    ``"linear"``: ``LinearAttention``; ``"softmax"``: ``SoftmaxAttention``;
    ``"local_softmax"``: ``SoftmaxAttention`` too, with options of its own (a model's local
    layers beside its global ones); ``"gla"``: ``LinearAttention`` with GLA's per-channel
    gate (``gate="channel"``), by default over the identity map without a denominator
    (``feature_map="identity"``, ``normalize=False``: an output RMSNorm per head);
    ``"deltanet"``,
    ``"gated_deltanet"``, ``"kda"``: ``DeltaRuleAttention`` of that variant; ``"mamba2"``:
    ``Mamba2Mixer`` (``num_heads`` its SSD heads); ``"lightning"``: ``LightningAttention``
    (MiniMax-01; ``layer_index``, ``num_layers`` its place in the model).
    ``"mla"``: ``LatentAttention`` (multi-head latent attention).
    ``"linearized"``: ``LinearizedAttention`` (a softmax layer's parameters with a learned
    linear core: a linearised transformer's student layers).
    ``"mlstm"``: ``MLSTMLayer`` (xLSTM).
    ``"gated_conv"``: ``GatedShortConv`` (LFM2's gated short convolution).
    ``"rwkv"``: ``RWKVTimeMix`` (RWKV-4's time mix; its block's MLP ``mlp="rwkv"``).
    ``"mamba"``: ``MambaMixer`` (Mamba-1's selective scan; ``num_heads`` unused).

    Raises:
      ValueError: an unknown kind, the kind without a mixer (``"mlp"``), or an option that
        contradicts one the kind fixes.
    """
    spec = get(kind)
    if spec.layer is None:
        raise ValueError(f"kind {kind!r} has no mixer layer (its blocks are an MLP alone)")
    for name, value in spec.fixed.items():
        if name in options and options[name] != value:
            raise ValueError(f"{kind}'s {name} is {value!r}, got {name}={options[name]!r}")
    return spec.layer(width, num_heads, **{**spec.defaults, **options, **spec.fixed})


_PART = re.compile(r"^\s*(?:(\d+)\s*)?([a-z_][a-z0-9_]*)\s*$")  # kinds may hold digits


def is_layout(attention: Any) -> bool:
    """Whether ``attention`` names several layers (a list of kinds or a pattern with
    ``:``), not one kind for all."""
    return not isinstance(attention, str) or ":" in attention


def parse_layout(attention: str | Sequence[str], depth: int | None = None) -> tuple[str, ...]:
    """The kind of each layer: ``attention`` is one kind (every layer), a list of ``depth``
    kinds, or a pattern such as ``"3 gated_deltanet : 1 softmax"`` (Qwen3-Next's
    ``full_attention_interval`` 4; Kimi Linear's ``"3 kda : 1 mla"``) repeated from the
    first layer on and cut at ``depth`` (layer ``i`` is the pattern's ``i mod period``).

    With ``depth`` None, the pattern's one period (or the list) is returned.

    Raises:
      ValueError: an unknown kind, a malformed pattern, or a list not of ``depth`` kinds.
    """
    if isinstance(attention, str) and ":" not in attention:
        get(attention)
        return (attention,) * (depth or 1)
    if isinstance(attention, str):
        period = []
        for part in attention.split(":"):
            match = _PART.match(part)
            count = int(match.group(1) or 1) if match else 0
            if count < 1:
                raise ValueError(
                    f"attention pattern must look like '3 gated_deltanet : 1 softmax' (a count "
                    f">= 1 and a kind per part), got {attention!r}"
                )
            get(match.group(2))
            period += [match.group(2)] * count
        kinds = tuple(period)
        return kinds if depth is None else tuple(kinds[i % len(kinds)] for i in range(depth))
    kinds = tuple(attention)
    if not kinds:
        raise ValueError("attention must name at least one kind, got an empty list")
    for kind in kinds:
        get(kind)
    if depth is not None and len(kinds) != depth:
        raise ValueError(f"attention must list depth={depth} kinds, got {len(kinds)}: {kinds}")
    return kinds


def layout_period(kinds: Sequence[str]) -> int:
    """The shortest ``p`` with ``kinds`` the first ``p`` kinds repeated (``len(kinds) / p``
    times): the layers a scan over the depth groups into one step."""
    n = len(kinds)
    return next(
        p for p in range(1, n + 1) if n % p == 0 and tuple(kinds) == tuple(kinds[:p]) * (n // p)
    )
