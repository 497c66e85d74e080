"""The dispatch of a recurrent layer, written once for every family of ``linattn_jax.ops``:
one decoding step, the sequence-parallel form, or the causal full-sequence form."""

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


def run_causal(
    family: ModuleType,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *per_token: jax.Array,
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

    A one-token call with a state (and no mask or segments) takes ``family.step``; a
    call without a state on a layer with ``sharding`` runs ``family.sequence_parallel``;
    anything else runs ``family.causal`` from ``state`` (None: zeros).

    Args:
      family: ``linattn_jax.ops.additive`` or ``linattn_jax.ops.delta``.
      q: queries ``[b, t, h, dk]``.
      k: keys ``[b, t, h, dk]``.
      v: values ``[b, t, h, dv]``.
      *per_token: the family's own inputs, ``[b, t, ...]`` (the delta rule's ``beta``).
      state: the family's ``State`` before the first token, or None.
      key_mask: optional bool ``[b, t]``, as in ``family.causal``.
      segment_ids: optional int ``[b, t]``, as in ``family.causal``.
      method: the full-sequence form, one of ``family.METHODS``.
      chunk_size: tokens per chunk; None: the family's default.
      sharding: where a full sequence runs sequence-parallel, or None.
      gate: optional log-decays ``[b, t, h(, f)]``.
      options: keywords every form takes (``decay``, the family's options).
      step_options: keywords only the step takes (the additive family's ``position``).
      causal_options: keywords only ``family.causal`` takes (the additive family's
        ``positions``).
    """
    options = dict(options or {}, gate=gate)
    t = q.shape[1]
    if state is not None and t == 1 and key_mask is None and segment_ids is None:
        first = lambda x: None if x is None else x[:, 0]
        options["gate"] = first(gate)
        out, state = family.step(
            *(first(x) for x in (q, k, v, *per_token)), state, **options, **(step_options or {})
        )
        return out[:, None], state
    if sharding is not None and state is None:
        if key_mask is not None or segment_ids is not None:
            raise ValueError("a sequence-parallel layer takes no key_mask or segment_ids")
        return family.sequence_parallel(
            q,
            k,
            v,
            *per_token,
            axis_name=sharding.axis,
            batch_axis=sharding.batch_axis,
            mesh=sharding.mesh,
            chunk_size=chunk_size,
            return_state=True,
            **options,
        )
    return family.causal(
        q,
        k,
        v,
        *per_token,
        method=method,
        chunk_size=chunk_size,
        initial_state=state,
        return_state=True,
        key_mask=key_mask,
        segment_ids=segment_ids,
        **options,
        **(causal_options or {}),
    )
