"""The RG-LRU with the length sharded over a mesh axis.

Each device runs the chunked form over its shard from the zero state, which gives per
token ``U_t`` (the shard's own part of ``h_t``), and the shard's decay from its start,
``A_t = prod a`` (0 once a sequence start was passed). The shards' ``(A, U)`` after their
last token are all-gathered (a ``[b, h, d]`` pair each) and folded into the state entering
each shard, ``h_in' = A h_in + U``; each token is then ``h_t = A_t h_in + U_t``. The
result equals the single-device output; gradients flow through by autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linattn_jax.ops import checks, feature_maps
from linattn_jax.ops.rglru import inputs
from linattn_jax.ops.rglru.chunked import run_chunks
from linattn_jax.ops.rglru.state import State, as_internal
from linattn_jax.typing import Array, Float


def sequence_parallel(
    x: Float[Array, "b t h d"],
    i: Float[Array, "b t h d"],
    r: Float[Array, "b t h d"],
    *,
    a_param: Float[Array, "h d"],
    c: float = 8.0,
    reset: Array | None = None,
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
):
    """``causal`` with the length sharded over mesh axis ``axis_name``.

    Args:
      x: inputs ``[b, t, h, d]`` (a global array); t must be divisible by the size of
        ``axis_name``.
      i: input gate pre-activations ``[b, t, h, d]``.
      r: recurrence gate pre-activations ``[b, t, h, d]``.
      a_param: as in ``causal``.
      c: as in ``causal``.
      reset: as in ``causal``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis (or axes) that splits the batch too.
      chunk_size: as in ``causal``.
      initial_state: as in ``causal`` (None: token 0 starts the sequence).
      return_state: as in ``causal``.

    Returns:
      ``out [b, t, h, d]``, or ``(out, state)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not divide, or
        any error of ``causal``.
    """
    b, t, h, d = inputs.check(x, i, r, a_param, c, reset, step=False)
    checks.check_bool("return_state", return_state)
    mesh = checks.check_mesh(mesh, axis_name, batch_axis, t)
    checks.check_batch_axis(mesh, axis_name, batch_axis, b)
    checks.check_chunk_size(chunk_size)
    shards = mesh.shape[axis_name]
    dtype = feature_maps.accumulation_dtype(jnp.result_type(x, i, r))
    state = as_internal(initial_state, b, h, d, dtype)
    starts = jnp.zeros((b, t), bool) if reset is None else reset
    if initial_state is None:
        starts = starts.at[:, 0].set(True)
    u, log_a = inputs.gated(*(y.astype(dtype) for y in (x, i, r, a_param)), c, starts)

    def local(u, log_a, starts, state):
        zero = jnp.zeros((u.shape[0], h, d), u.dtype)
        own, own_last = run_chunks((u, log_a, starts[..., None]), zero,
                                   checks.default_chunk_size(chunk_size))  # fmt: skip
        seen = jax.lax.cummax(starts.astype(jnp.int32), axis=1)[..., None, None] > 0
        decay = jnp.where(seen, 0.0, jnp.exp(jnp.cumsum(log_a, axis=1)))  # [b, t, h, d]
        decays, lasts = (jax.lax.all_gather(y, axis_name) for y in (decay[:, -1], own_last))
        prefix = [state]
        for s in range(shards):
            prefix.append(decays[s] * prefix[-1] + lasts[s])
        entering = jnp.stack(prefix[:-1])[jax.lax.axis_index(axis_name)]
        out = jnp.where(seen, own, decay * entering[:, None] + own)
        return out.astype(x.dtype), prefix[-1]

    seq = P(batch_axis, axis_name)
    out, final = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(seq, seq, seq, P(batch_axis)),
        out_specs=(seq, P(batch_axis)),
        check_vma=False,  # the local scans start from a device-invariant state
    )(u, log_a, starts, state)
    return (out, State(final)) if return_state else out
