"""The dispatch of a recurrent layer, written once for every family of ``linattn_jax.ops``
(additive, delta, SSD, mLSTM; lightning attention is the additive family with fixed
decays): one decoding step, the sequence-parallel form, or the causal full-sequence form."""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import jax


class SequenceSharding(NamedTuple):
    """The mesh axis that splits a full sequence along its length (sequence parallelism),
    the axis that splits the batch beside it (or None), and the mesh (None: the current)."""

    axis: str
    batch_axis: str | tuple[str, ...] | None = None
    mesh: jax.sharding.Mesh | None = None


def sequence_sharding(
    sequence_axis: str | None,
    batch_axis: str | tuple[str, ...] | None,
    mesh: jax.sharding.Mesh | None,
    causal: bool = True,
) -> SequenceSharding | None:
    """A layer's ``SequenceSharding`` from its options (None without ``sequence_axis``).

    Raises:
      ValueError: a ``sequence_axis`` on a layer that is not causal.
    """
    if sequence_axis is None:
        return None
    if not causal:
        raise ValueError("sequence_axis needs a causal layer (causal=True)")
    return SequenceSharding(sequence_axis, batch_axis, mesh)


def run_causal(
    family: ModuleType,
    *inputs: jax.Array,
    state: Any,
    key_mask: jax.Array | None,
    segment_ids: jax.Array | None,
    method: str,
    chunk_size: int | None,
    sharding: SequenceSharding | None,
    gate: jax.Array | None = None,
    options: dict | None = None,
    step_options: dict | None = None,
    causal_options: dict | None = None,
) -> tuple[jax.Array, Any]:
    """``(out [b, t, h, dv], the family's State after the last token)`` of a layer.

    A one-token call with a state (and no mask or segments) takes ``family.step`` (each
    per-token input at its one token); a call without a state on a layer with ``sharding``
    runs ``family.sequence_parallel``; anything else runs ``family.causal`` from ``state``
    (None: zeros). Every family of ``linattn_jax.ops`` has these three forms with the same
    keywords, so each recurrent layer projects its inputs, calls this, and finishes its
    output:

    - additive (``ops.additive``; ``LinearAttention``, and ``LightningAttention`` with
      fixed decays): ``q, k, v``;
    - delta (``ops.delta``; ``DeltaRuleAttention``): ``q, k, v, beta``;
    - SSD (``ops.ssd``, Mamba-2's, on the additive family's engine; ``Mamba2Mixer``):
      ``x, dt, A, B, C``, ``A`` a per-head constant;
    - mLSTM (``ops.mlstm``; ``MLSTMLayer``): ``q, k, v, i, f``;
    - selective scan (``ops.selective``, Mamba-1's; ``MambaMixer``): ``x, dt, A, B, C``,
      ``A [d, n]`` a constant.

    Args:
      family: a family of ``linattn_jax.ops`` (above).
      *inputs: the family's positional inputs, each ``[b, t, ...]`` (the first sets ``t``),
        or a constant of rank 1 or 2 (SSD's ``A [h]``, the selective scan's ``A [d, n]``),
        which the step takes whole.
      state: the family's ``State`` before the first token, or None.
      key_mask: optional bool ``[b, t]``, as in ``family.causal``.
      segment_ids: optional int ``[b, t]``, as in ``family.causal``.
      method: the full-sequence form, one of ``family.METHODS``.
      chunk_size: tokens per chunk; None: the family's default
        (``linattn_jax.ops.checks.default_chunk_size``).
      sharding: where a full sequence runs sequence-parallel, or None.
      gate: optional log-decays ``[b, t, h(, f)]`` (the additive and delta families').
      options: keywords every form takes (``decay``, the family's options: SSD's ``D``,
        the mLSTM's ``eps``).
      step_options: keywords only the step takes (the additive family's ``position``).
      causal_options: keywords only ``family.causal`` takes (the additive family's
        ``positions``).

    Raises:
      ValueError: a ``key_mask`` or ``segment_ids`` on a sequence-parallel call.
    """
    options = dict(options or {})
    if gate is not None:
        options["gate"] = gate
    t = inputs[0].shape[1]
    if state is not None and t == 1 and key_mask is None and segment_ids is None:
        first = lambda x: x if x.ndim < 3 else x[:, 0]  # a constant ([h], [d, n]) stays whole
        if gate is not None:
            options["gate"] = first(gate)
        out, state = family.step(
            *(first(x) for x in inputs), state, **options, **(step_options or {})
        )
        return out[:, None], state
    if sharding is not None and state is None:
        if key_mask is not None or segment_ids is not None:
            raise ValueError("a sequence-parallel layer takes no key_mask or segment_ids")
        return family.sequence_parallel(
            *inputs,
            axis_name=sharding.axis,
            batch_axis=sharding.batch_axis,
            mesh=sharding.mesh,
            chunk_size=chunk_size,
            return_state=True,
            **options,
        )
    return family.causal(
        *inputs,
        method=method,
        chunk_size=chunk_size,
        initial_state=state,
        return_state=True,
        key_mask=key_mask,
        segment_ids=segment_ids,
        **options,
        **(causal_options or {}),
    )
