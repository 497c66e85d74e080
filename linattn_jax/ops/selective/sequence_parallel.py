"""The selective scan with the length sharded over a mesh axis.

The recurrence is linear in the state: a shard's tokens map the state ``h`` entering it to
``exp(L_s) * h + h_s``, with ``L_s = A sum_t dt_t`` the shard's total log-decay and ``h_s``
its final state from zeros. Each device runs the chunked form over its shard from zeros for
``h_s``; the shards' ``(L_s, h_s)`` are all-gathered (``[b, d, n]`` each, never the inputs)
and folded in order into the state entering each shard; each device then runs its shard
again from that state. Two passes of the chunked form, exact; gradients by autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linattn_jax.ops import checks
from linattn_jax.ops.selective import inputs
from linattn_jax.ops.selective.chunked import run_chunks
from linattn_jax.ops.selective.state import State, as_internal
from linattn_jax.typing import Array, Float


def sequence_parallel(
    x: Float[Array, "b t d"],
    dt: Float[Array, "b t d"],
    A: Float[Array, "d n"],
    B: Float[Array, "b t n"],
    C: Float[Array, "b t n"],
    *,
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    D: Float[Array, " d"] | None = None,
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
):
    """``causal`` with the length sharded over mesh axis ``axis_name``.

    Args:
      x: inputs ``[b, t, d]`` (a global array); t must be divisible by the size of
        ``axis_name``.
      dt: steps ``[b, t, d]``, >= 0.
      A: rates ``[d, n]``, <= 0.
      B: input projections ``[b, t, n]``.
      C: output projections ``[b, t, n]``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis (or axes) that splits the batch too.
      D: as in ``causal``.
      chunk_size: as in ``causal``.
      initial_state: as in ``causal``.
      return_state: as in ``causal``.

    Returns:
      ``y [b, t, d]``, or ``(y, state)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not divide, or
        any error of ``causal``.
    """
    b, d, n = inputs.check(x, dt, A, B, C, D, step=False)
    checks.check_bool("return_state", return_state)
    t = x.shape[1]
    mesh = checks.check_mesh(mesh, axis_name, batch_axis, t)
    checks.check_batch_axis(mesh, axis_name, batch_axis, b)
    checks.check_chunk_size(chunk_size)
    chunk_size = checks.default_chunk_size(chunk_size, A)
    shards = mesh.shape[axis_name]
    checks.check_steps("dt", dt)
    u, dt32, A32, B, C, first = inputs.operands(x, dt, A, B, C, None)
    state = as_internal(initial_state, b, d, n, u.dtype)

    def local(u, dt, B, C, A, state):
        xs = (u, dt, B[:, :, None], C[:, :, None], None)
        _, (h_s, _) = run_chunks(xs, (jnp.zeros_like(state), A), chunk_size)
        total = jnp.exp(inputs.log_decay(jnp.sum(dt, axis=1), A))  # [b, d, n]
        totals, finals = jax.lax.all_gather(total, axis_name), jax.lax.all_gather(h_s, axis_name)
        prefix = [state]
        for s in range(shards):
            prefix.append(totals[s] * prefix[-1] + finals[s])
        entering = jnp.stack(prefix[:-1])[jax.lax.axis_index(axis_name)]
        y, _ = run_chunks(xs, (entering, A), chunk_size)
        return y, prefix[-1]

    seq = P(batch_axis, axis_name)
    y, h = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(seq, seq, seq, seq, P(), P(batch_axis)),
        out_specs=(seq, P(batch_axis)),
        check_vma=False,  # the local scans start from a device-invariant state
    )(u, dt32, B, C, A32, state)
    y, h = inputs.finish(y, x, D, first, h, None)
    y = y.astype(x.dtype)
    return (y, State(h)) if return_state else y
