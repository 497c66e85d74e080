"""Weight tables: each row a Hugging Face tensor's name, our parameter path(s), and the
conversion between them, a value (``COPY``, ``LINEAR``, ``SPLIT``, ``CONV``, ...); the rows
several model types share (Llama's embedding, norms, attention and SwiGLU; the experts).

A model type's table is a function ``(config, prefix) -> [(full hf name, Rule)]``;
``layered`` builds the common one: model rows, each layer's rows under ``layers.{i}.`` and
``blocks.{i}.``, the untied head.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Shapes = list[tuple[int, ...]]
Table = list[tuple[str, "Rule"]]


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One way a Hugging Face tensor maps onto our parameter(s).

    Attributes:
      name: what it is called in errors and docs.
      hf_shape: the Hugging Face tensor's shape from our parameters' shapes.
      to_ours: the tensor as our parameters (views; the loader casts and copies).
      to_hf: our parameters as the tensor (``to_ours``' inverse).
    """

    name: str
    hf_shape: Callable[[Shapes], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, Shapes], list[np.ndarray]]
    to_hf: Callable[[list[np.ndarray]], np.ndarray]


def _cuts(sizes) -> np.ndarray:
    return np.cumsum(sizes)[:-1]


COPY = Conversion("copy", lambda s: s[0], lambda x, s: [x], lambda xs: xs[0])
# nn.Linear's [out, in] is our kernel's [in, out]
LINEAR = Conversion("linear", lambda s: s[0][::-1], lambda x, s: [x.T], lambda xs: xs[0].T)
# one fused nn.Linear: its rows split in the order of ``ours``, each transposed
SPLIT = Conversion(
    "split",
    lambda s: (sum(x[1] for x in s), s[0][0]),
    lambda x, s: [part.T for part in np.split(x, _cuts([p[1] for p in s]), axis=0)],
    lambda xs: np.concatenate([x.T for x in xs], axis=0),
)
# a depthwise nn.Conv1d's [c, 1, k] is our [k, c]
CONV = Conversion(
    "conv",
    lambda s: (s[0][1], 1, s[0][0]),
    lambda x, s: [x[:, 0, :].T],
    lambda xs: xs[0].T[:, None, :],
)
# [e, 2h, width] (rows [gate | up] per expert) <-> our gate, up [e, width, h]
EXPERTS_GATE_UP = Conversion(
    "experts_gate_up",
    lambda s: (s[0][0], s[0][2] + s[1][2], s[0][1]),
    lambda x, s: [p.transpose(0, 2, 1) for p in np.split(x, [s[0][2]], axis=1)],
    lambda xs: np.concatenate([x.transpose(0, 2, 1) for x in xs], axis=1),
)
# [e, width, h] <-> our down [e, h, width]: each expert's nn.Linear, transposed
EXPERTS_LINEAR = Conversion(
    "experts_linear",
    lambda s: (s[0][0], s[0][2], s[0][1]),
    lambda x, s: [x.transpose(0, 2, 1)],
    lambda xs: xs[0].transpose(0, 2, 1),
)


@functools.cache
def grouped(groups: int) -> Conversion:
    """A fused nn.Linear whose rows are ``groups`` groups in turn, each the parts of our
    parameters in order (Qwen3-Next's ``in_proj_qkvz``, MiniMax's ``qkv_proj``)."""

    def to_ours(x, shapes):
        sizes = [s[1] // groups for s in shapes]
        parts = np.split(x.reshape(groups, -1, x.shape[-1]), _cuts(sizes), 1)
        return [p.reshape(-1, x.shape[-1]).T for p in parts]

    def to_hf(xs):
        parts = [x.T.reshape(groups, -1, xs[0].shape[0]) for x in xs]
        return np.concatenate(parts, axis=1).reshape(-1, xs[0].shape[0])

    return Conversion(
        f"groups_of_{groups}", lambda s: (sum(x[1] for x in s), s[0][0]), to_ours, to_hf
    )


@functools.cache
def reshaped(hf_shape: Callable[[int], tuple[int, ...]], name: str) -> Conversion:
    """Our vector ``[n]`` stored as ``hf_shape(n)`` (Kimi's ``A_log`` ``[1, 1, h, 1]``)."""
    return Conversion(
        name,
        lambda s: hf_shape(s[0][0]),
        lambda x, s: [x.reshape(-1)],
        lambda xs: xs[0].reshape(hf_shape(xs[0].shape[0])),
    )


@functools.cache
def rope_pairs(block: int, pairs: int) -> Conversion:
    """``LINEAR`` but the last ``2 pairs`` rows of each ``block`` rows, interleaved pairs
    ``(x0, x1), (x2, x3), ...``, read as rotate-half's halves, evens then odds, and written
    back interleaved (DeepSeek-V3's ``rope_interleave``: q's rows per head, the shared key's)."""
    order = np.arange(block)
    order[block - 2 * pairs :] = np.concatenate([order[-2 * pairs :: 2], order[1 - 2 * pairs :: 2]])
    rows = lambda x, o: x.reshape(-1, block, x.shape[-1])[:, o].reshape(x.shape)
    return Conversion(
        f"rope_pairs_{block}_{pairs}", LINEAR.hf_shape, lambda x, s: [rows(x, order).T],
        lambda xs: rows(xs[0].T, np.argsort(order)),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a weight table.

    Attributes:
      hf: the Hugging Face name (under the model's or the layer's prefix).
      ours: our parameter path(s) (under the model or block ``i``); several for a split.
      how: the ``Conversion`` (``COPY``, ``LINEAR``, ``SPLIT``, ``CONV``, ...).
      index: None, or the tensor is the slice ``index`` of our one parameter along its
        first axis (per-expert tensors stacked into one parameter); the conversion then
        sees that slice's shape. A tuple (of ints and slices) indexes other axes too
        (a scanned model's layers: ``(layer // period, expert)``; Kimi Linear's and
        OLMo-Hybrid's q, k and v convs: channel ranges of our one conv kernel).
    """

    hf: str
    ours: tuple[str, ...]
    how: Conversion
    index: int | tuple | None = None

    def at(self, hf: str, ours: Sequence[str], index: Any = None) -> Rule:
        """The same conversion for full names (and a slice index)."""
        return Rule(hf, tuple(ours), self.how, self.index if index is None else index)


def rules(*rows) -> tuple[Rule, ...]:
    """Rules from ``(hf, ours or (ours, ...), how)`` rows."""
    return tuple(
        Rule(hf, (ours,) if isinstance(ours, str) else tuple(ours), how) for hf, ours, how in rows
    )


def under(rows: Sequence[Rule], hf_prefix: str, ours_prefix: str) -> tuple[Rule, ...]:
    """``rows`` with ``hf_prefix`` and ``ours_prefix`` put before their names (a mixer's
    rows under another module, e.g. Bamba's ``mamba.`` and our ``attention.``)."""
    return tuple(r.at(hf_prefix + r.hf, [ours_prefix + p for p in r.ours]) for r in rows)


def prefixed(rows: Sequence[Rule], hf_prefix: str, ours_prefix: str, index: Any = None) -> Table:
    """``(full hf name, rule with full paths)`` for rows under a layer's prefixes (and a
    slice ``index``: one expert's rows)."""
    return [
        (hf_prefix + r.hf, r.at(hf_prefix + r.hf, [ours_prefix + p for p in r.ours], index))
        for r in rows
    ]


def experts(rows: Sequence[Rule], hf_layer: str, block: str, n: int, name="mlp.experts.") -> Table:
    """Per-expert ``rows`` for experts ``0..n-1`` under ``{hf_layer}{name}{j}.``, each the
    slice ``j`` of our stacked parameters."""
    return [row for j in range(n) for row in prefixed(rows, f"{hf_layer}{name}{j}.", block, j)]


def slice_shapes(rule: Rule, shapes: Shapes) -> Shapes:
    """Our parameters' shapes as the rule's conversion sees them (one slice if indexed)."""
    if rule.index is None:
        return shapes
    # The slice's shape, from a view that allocates nothing (an int or a tuple of slices).
    return [np.broadcast_to(np.empty((), bool), s)[rule.index].shape for s in shapes]


def hf_shape(rule: Rule, shapes: Shapes) -> tuple[int, ...]:
    """The Hugging Face tensor's shape of ``rule`` given our parameters' shapes."""
    return tuple(rule.how.hf_shape(slice_shapes(rule, shapes)))


_LAYER = re.compile(r"^blocks\.(\d+)\.")


def scanned_table(table: Table, period: int | None) -> Table:
    """An unrolled model's weight table for the same model scanned over ``period`` layers
    (``models.stack``): layer ``l``'s ``blocks.l.*`` is the slice ``l // period`` of block
    ``l % period``'s stacked parameter (before any index the row had: an expert's).
    ``period`` None: the table as it is."""
    if period is None:
        return table
    rows = []
    for name, rule in table:
        layers = {int(m[1]) for m in map(_LAYER.match, rule.ours) if m}
        if not layers:
            rows.append((name, rule))
            continue
        (layer,) = layers  # a row fills one layer's parameters
        ours = tuple(_LAYER.sub(f"blocks.{layer % period}.", p) for p in rule.ours)
        index = () if rule.index is None else rule.index
        index = (layer // period, *(index if isinstance(index, tuple) else (index,)))
        rows.append((name, dataclasses.replace(rule, ours=ours, index=index)))
    return rows


def layered(
    model_rules: Sequence[Rule],
    layer_rules: Callable[[Any, int], Sequence[Rule]],
    *,
    layers: str = "layers.",
) -> Callable[[Any, str], Table]:
    """The common table: ``model_rules`` under the prefix, then each layer ``i``'s
    ``layer_rules(config, i)`` under ``{prefix}{layers}{i}.`` and ``blocks.{i}.``."""

    def table(config, prefix: str) -> Table:
        rows = [(prefix + r.hf, r) for r in model_rules]
        for i in range(config["num_hidden_layers"]):
            rows += prefixed(layer_rules(config, i), f"{prefix}{layers}{i}.", f"blocks.{i}.")
        return rows

    return table


# ------------------------------------------------------- rows several model types share

# Llama's: the model's (under the format's prefix), the untied head's (no prefix; every
# format's: ``ModelFormat.weight_table``), a block's two norms, its softmax attention (no
# biases) and its SwiGLU MLP.
MODEL_RULES = rules(
    ("embed_tokens.weight", "embed.embedding", COPY),
    ("norm.weight", "norm.scale", COPY),
)
HEAD_RULE = Rule("lm_head.weight", ("head.kernel",), LINEAR)
NORM_RULES = rules(
    ("input_layernorm.weight", "attention_norm.scale", COPY),
    ("post_attention_layernorm.weight", "mlp_norm.scale", COPY),
)
ATTENTION_RULES = rules(
    ("self_attn.q_proj.weight", "attention.q_proj.kernel", LINEAR),
    ("self_attn.k_proj.weight", "attention.k_proj.kernel", LINEAR),
    ("self_attn.v_proj.weight", "attention.v_proj.kernel", LINEAR),
    ("self_attn.o_proj.weight", "attention.out_proj.kernel", LINEAR),
)
# The attention's biases: Qwen2's on q, k and v; Llama's and Qwen3's ``attention_bias`` on
# all four projections.
QKV_BIAS_RULES = rules(
    ("self_attn.q_proj.bias", "attention.q_proj.bias", COPY),
    ("self_attn.k_proj.bias", "attention.k_proj.bias", COPY),
    ("self_attn.v_proj.bias", "attention.v_proj.bias", COPY),
)
OUT_BIAS_RULES = rules(("self_attn.o_proj.bias", "attention.out_proj.bias", COPY))
QK_NORM_RULES = rules(
    ("self_attn.q_norm.weight", "attention.q_norm.scale", COPY),
    ("self_attn.k_norm.weight", "attention.k_norm.scale", COPY),
)
SWIGLU_RULES = rules(
    ("gate_proj.weight", "gate_proj.kernel", LINEAR),
    ("up_proj.weight", "up_proj.kernel", LINEAR),
    ("down_proj.weight", "down_proj.kernel", LINEAR),
)
MLP_RULES = under(SWIGLU_RULES, "mlp.", "mlp.")
# A mixture's experts, stored per expert (under mlp.experts.{j}., slice j of ours) or fused.
EXPERT_RULES = rules(
    ("gate_proj.weight", "mlp.gate", LINEAR),
    ("up_proj.weight", "mlp.up", LINEAR),
    ("down_proj.weight", "mlp.down", LINEAR),
)
FUSED_EXPERT_RULES = rules(
    ("mlp.experts.gate_up_proj", ("mlp.gate", "mlp.up"), EXPERTS_GATE_UP),
    ("mlp.experts.down_proj", "mlp.down", EXPERTS_LINEAR),
)
