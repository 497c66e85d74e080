"""The swap: a student ``LanguageModel`` made from a softmax teacher, chosen attention layers
replaced by a linear kind that reuses their q/k/v/o weights, everything else the teacher's.

Student kinds (``STUDENT_KINDS``):

* ``"hedgehog"``: ``layers.LinearizedAttention`` with learned Hedgehog maps (Hedgehog);
* ``"lolcats"``: the same with softmax inside a sliding window (LoLCATs' hybrid form);
* ``"t2r"``: T2R's learned ``relu`` MLP map;
* ``"liger"``: Hedgehog maps and a GLA-style per-channel gate (Liger's gated form);
* ``"gated_deltanet"``: ``layers.DeltaRuleAttention`` (Gated DeltaNet) with new gates,
  beta and output norm, its q/k/v/o the teacher's (GQA's key and value heads repeated), its
  convolution the identity (Mamba-in-the-Llama); it has no RoPE or QK-norm, so its start
  is further from the teacher's.

The layers that stay softmax (``keep_softmax``): none (``""``), a list (``"0,3"``), every
k-th (``"every:4"``: layers 3, 7, ...), or the ``n`` layers whose attention-transfer loss is
highest (``"ranked:2"``, LightTransfer's criterion; decided after stage 1).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from linattn_jax.layers import SoftmaxAttention
from linattn_jax.models import LanguageModel
from linattn_jax.models.options import thaw

# Student kind -> (registry kind, its options beyond the teacher's shapes).
STUDENT_KINDS = {
    "hedgehog": ("linearized", {"feature_map": "hedgehog"}),
    "lolcats": ("linearized", {"feature_map": "hedgehog"}),  # + the config's window
    "t2r": ("linearized", {"feature_map": "t2r"}),
    "liger": ("linearized", {"feature_map": "hedgehog", "gate": "channel"}),
    "gated_deltanet": ("gated_deltanet", {}),
}
LABELS = {
    "hedgehog": "Hedgehog (learned feature maps)",
    "lolcats": "LoLCATs (Hedgehog + sliding-window softmax)",
    "t2r": "T2R (learned ReLU MLP map)",
    "liger": "Liger (Hedgehog + GLA-style gate)",
    "gated_deltanet": "Gated DeltaNet (new gates)",
}


@dataclasses.dataclass(frozen=True)
class NewParams:
    """An ``nnx`` filter (hashable: a static argument of jitted steps) of the student's
    parameters the teacher does not have: the feature maps, gates and norms of the swap."""

    paths: frozenset

    def __call__(self, path, value) -> bool:
        return isinstance(value, nnx.Param) and tuple(path) in self.paths


def softmax_layers(teacher: LanguageModel) -> tuple[int, ...]:
    """The indices of the teacher's softmax layers."""
    return tuple(i for i, kind in enumerate(teacher.layout) if kind == "softmax")


def swapped_layers(teacher: LanguageModel, keep_softmax: str, losses=None) -> tuple[int, ...]:
    """The layers to swap: the teacher's softmax layers but those ``keep_softmax`` keeps
    (the module docstring's forms); ``"ranked:n"`` reads ``losses`` (each softmax layer's
    transfer loss) and is every softmax layer while they are None.

    Raises:
      ValueError: a malformed ``keep_softmax``, a layer that is not a softmax layer, or a
        teacher without one left to swap.
    """
    candidates = softmax_layers(teacher)
    text = keep_softmax.strip()
    form, _, arg = text.partition(":")
    try:
        if not text:
            kept = ()
        elif form == "every":
            every = int(arg)
            kept = tuple(i for i in candidates if (i + 1) % every == 0) if every > 0 else None
        elif form == "ranked":
            n = int(arg)
            ranked = sorted(candidates, key=lambda i: -losses[i]) if losses is not None else []
            kept = tuple(sorted(ranked[:n])) if n >= 0 else None
        else:
            kept = tuple(int(i) for i in text.split(","))
    except ValueError:
        kept = None
    if kept is None:
        raise ValueError(
            f"keep_softmax must be '', a list '0,3', 'every:k' or 'ranked:n', got {keep_softmax!r}"
        )
    strangers = [i for i in kept if i not in candidates]
    if strangers:
        raise ValueError(f"keep_softmax names {strangers}, not softmax layers of {candidates}")
    swapped = tuple(i for i in candidates if i not in kept)
    if not swapped:
        raise ValueError(f"no layer left to swap: softmax layers {candidates}, kept {kept}")
    return swapped


def make_student(
    teacher: LanguageModel,
    swapped: tuple[int, ...],
    kind: str,
    *,
    window: int = 0,
    conv_size: int = 4,
    seed: int = 0,
) -> tuple[LanguageModel, NewParams]:
    """The student of ``teacher`` with the layers ``swapped`` of ``kind``
    (``STUDENT_KINDS``), and the filter of its new parameters.

    Every parameter the teacher has at the same path is the teacher's (copied, not
    shared); a Gated DeltaNet layer's q/k/v/o are converted from the softmax layer's
    (GQA repeated, an output gate's half dropped), with the teacher's own Gated DeltaNet
    options where it has such layers (a hybrid: the student's new ones are then of its
    type). ``window``: LoLCATs' (``"lolcats"`` only; 0: none). ``conv_size``: Gated
    DeltaNet's convolution (identity at the start) where the teacher has none.

    Raises:
      ValueError: an unknown kind, a layer that is not softmax, a scanned teacher (load it
        with ``scan_layers=False``), or a teacher whose options the student kind cannot
        take (a sliding window; Gated DeltaNet layers of other dimensions).
    """
    if kind not in STUDENT_KINDS:
        raise ValueError(f"kind must be one of {tuple(STUDENT_KINDS)}, got {kind!r}")
    if teacher.period is not None:
        raise ValueError("the teacher's layers are scanned: load it with scan_layers=False")
    others = [i for i in swapped if teacher.layout[i] != "softmax"]
    if others or not swapped:
        raise ValueError(
            f"swapped must list softmax layers of {softmax_layers(teacher)}, got {swapped}"
        )
    registered, extra = STUDENT_KINDS[kind]
    options = thaw(teacher.options)
    softmax = dict(options.get("kind_options") or {}).get("softmax", {})
    kind_options = dict(options.get("kind_options") or {})
    if registered == "linearized":
        extra = dict(extra, window=window or None) if kind == "lolcats" else dict(extra)
        if softmax.get("sliding_window"):
            raise ValueError("a teacher with a sliding window cannot be linearised here")
        kind_options["linearized"] = dict(softmax, **extra)
    elif "gated_deltanet" not in teacher.layout:  # else its own layers' options (a hybrid)
        first = teacher.blocks[swapped[0]].attention
        kind_options["gated_deltanet"] = dict(
            num_heads=first.num_heads, head_dim=first.head_dim, num_v_heads=first.num_heads,
            value_head_dim=first.head_dim, conv_size=conv_size,
        )  # fmt: skip
    layout = [registered if i in swapped else k for i, k in enumerate(teacher.layout)]
    options.update(attention=layout, kind_options=kind_options)
    student = LanguageModel(**options, rngs=nnx.Rngs(seed))
    for i in swapped if registered == "gated_deltanet" else ():
        _delta_from_softmax(student.blocks[i].attention, teacher.blocks[i].attention)
    teacher_flat = dict(nnx.to_flat_state(nnx.state(teacher)))
    new = set()
    for path, variable in nnx.to_flat_state(nnx.state(student)):
        source = teacher_flat.get(path)
        if source is None:
            new.add(path)
            continue
        if registered == "gated_deltanet" and _converted(path, swapped):
            continue
        if source.get_value().shape != variable.get_value().shape:
            raise ValueError(
                f"{'.'.join(map(str, path))}: the teacher's shape "
                f"{source.get_value().shape}, the student's "
                f"{variable.get_value().shape}"
            )
        variable.set_value(jnp.array(source.get_value()))
    return student, NewParams(frozenset(new))


def _converted(path, swapped) -> bool:
    """Whether ``path`` is a projection ``_delta_from_softmax`` filled."""
    return (
        len(path) == 5
        and path[0] == "blocks"
        and path[1] in swapped
        and path[3] in ("q_proj", "k_proj", "v_proj", "out_proj")
    )


def _delta_from_softmax(delta, softmax: SoftmaxAttention) -> None:
    """A Gated DeltaNet layer's q/k/v/o from a softmax layer's (key and value heads repeated
    over their query heads; the output gate's half of q dropped); its convolution the
    identity."""
    width, h, kv, d = softmax.width, softmax.num_heads, softmax.num_kv_heads, softmax.head_dim
    dims = (delta.num_heads, delta.num_v_heads, delta.key_dim, delta.value_dim)
    if dims != (h, h, d, d):
        raise ValueError(
            f"the softmax layer's q/k/v ({h} heads of {d}) do not fit the Gated DeltaNet "
            f"layer's ({dims[0]} key heads and {dims[1]} value heads of {dims[2]} and "
            f"{dims[3]}: the teacher's own gated_deltanet options)"
        )
    q = softmax.q_proj.kernel[...]
    if softmax.output_gate:  # [q_h | gate_h] per head
        q = q.reshape(width, h, 2 * d)[..., :d].reshape(width, h * d)
    repeat = lambda w: jnp.repeat(w.reshape(width, kv, d), h // kv, axis=1).reshape(width, h * d)
    delta.q_proj.kernel[...] = q
    delta.k_proj.kernel[...] = repeat(softmax.k_proj.kernel[...])
    delta.v_proj.kernel[...] = repeat(softmax.v_proj.kernel[...])
    delta.out_proj.kernel[...] = softmax.out_proj.kernel[...]
    if delta.conv is not None:
        kernel = delta.conv.kernel[...]
        delta.conv.kernel[...] = jnp.zeros_like(kernel).at[-1].set(1.0)
