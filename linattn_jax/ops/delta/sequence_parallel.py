"""The delta rule (DeltaNet, Gated DeltaNet, KDA) with the length sharded over a mesh axis.

Each shard gathers the other shards' affine maps of the state, ``(M, S_local)``:
``n * b * h * dk * (dk + dv)`` floats per layer, never keys or values.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linattn_jax.ops import checks, feature_maps
from linattn_jax.ops.delta.api import causal
from linattn_jax.ops.delta.state import State, as_internal, check_beta, check_options, check_qkv
from linattn_jax.typing import Array, Float


def sequence_parallel(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    beta: Float[Array, "b t h"],
    *,
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    decay: Any = None,
    gate: Array | None = None,
    scale: float = 1.0,
):
    """The delta rule (DeltaNet, Gated DeltaNet, KDA) with the length sharded over an axis.

    A shard's effect on the state is affine, ``S_out = M S_in + S_local``, with
    ``M = prod_t alpha_t (I - beta_t k_t k_t^T)`` (``dk x dk`` per head). The
    recurrence is linear in (state, values), so one chunked pass with values
    ``[v | 0]`` from the state ``[0 | I]`` ends in ``[S_local | M]``. Each device
    all-gathers these (``n * b * h * dk * (dk + dv)`` floats, never keys or
    values), folds the exclusive prefix into the state entering its shard, and
    reruns its shard from that state for the outputs. Equal to ``causal`` on
    one device; gradients by autodiff.

    Args:
      q: queries ``[b, t, h, dk]`` (a global array); t must be divisible by the size
        of ``axis_name``.
      k: keys ``[b, t, h, dk]``.
      v: values ``[b, t, hv, dv]`` (``hv`` a multiple of ``h``: grouped value heads, as in
        ``causal``).
      beta: writing strengths ``[b, t, hv]``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis (or axes) that splits the batch too.
      chunk_size: as in ``causal``.
      initial_state: as in ``causal``.
      return_state: as in ``causal``.
      decay: as in ``causal``.
      gate: as in ``causal``.
      scale: as in ``causal``.

    Returns:
      ``out [b, t, hv, dv]``, or ``(out, DeltaRuleState)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not
        divide, or any error of ``causal``.
    """
    (b, t, _, dk), h = check_qkv(q, k, v)  # h: the value heads, each with its own state
    dv = v.shape[-1]
    check_options(q, k, decay=decay, scale=scale, return_state=return_state)
    mesh = checks.check_mesh(mesh, axis_name, batch_axis, t)
    checks.check_batch_axis(mesh, axis_name, batch_axis, b)
    shards = mesh.shape[axis_name]
    # Validates everything else on the global arrays before tracing the shards (beta's
    # range and the state here: eval_shape sees neither's values).
    check_beta(beta, (b, t, h), "[batch, length, heads]")
    jax.eval_shape(
        lambda *a: causal(*a, decay=decay, gate=gate, chunk_size=chunk_size, scale=scale),
        q, k, v, beta,
    )  # fmt: skip
    dtype = feature_maps.accumulation_dtype(q.dtype)
    s0 = as_internal(initial_state, b, h, dk, dv, dtype)
    run = functools.partial(causal, decay=decay, chunk_size=chunk_size, scale=scale)
    if 0 in (b, t, h):
        # Nothing to shard (the output is empty, the state passes through): the one-device
        # form. An empty shard in shard_map also crashes XLA's compiler on jax 0.11.2.
        return run(q, k, v, beta, gate=gate, initial_state=initial_state, return_state=return_state)

    def local(q, k, v, beta, s0, extras):
        gate = extras.get("gate")
        b_local, t_local = q.shape[:2]
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=dtype), (b_local, h, dk, dk))
        start = State(jnp.concatenate([jnp.zeros_like(s0), eye], axis=-1))
        values = jnp.concatenate([v, jnp.zeros((b_local, t_local, h, dk), v.dtype)], axis=-1)
        _, end = run(q, k, values, beta, gate=gate, initial_state=start, return_state=True)
        ends = jax.lax.all_gather(end.s, axis_name)  # [n, b, h, dk, dv + dk]: S_local | M
        prefix = [s0]
        for i in range(shards):
            prefix.append(ends[i, ..., dv:] @ prefix[-1] + ends[i, ..., :dv])
        s_in = jnp.stack(prefix[:-1])[jax.lax.axis_index(axis_name)]
        out = run(q, k, v, beta, gate=gate, initial_state=State(s_in))
        return out, prefix[-1]

    seq = P(batch_axis, axis_name)
    extras, extra_specs = {}, {}
    if gate is not None:
        extras["gate"], extra_specs["gate"] = gate, seq
    out, final = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(seq, seq, seq, seq, P(batch_axis), extra_specs),
        out_specs=(seq, P(batch_axis)),
        check_vma=False,  # the local passes start from device-invariant states
    )(q, k, v, beta, s0.astype(dtype), extras)
    return (out, State(final)) if return_state else out
