"""The WKV with the length sharded over a mesh axis (LASP, with the running maximum).

Each device runs the per-token scan over its shard from the empty state, which gives per
token the stabilised numerator, denominator and stabiliser of its own shard's keys (the
bonus term among them), and the shard's state ``(num, den, m)`` with its total log decay
``F = n w``. The shards' states are all-gathered (three ``[b, h, d]`` arrays each, never
keys or values) and folded into the state entering each shard, in log space::

    m' = max(F + m_in, m_s),  num' = exp(F + m_in - m') num_in + exp(m_s - m') num_s

(``den`` alike), and each token then joins the entering state, decayed by the shard's
tokens before it, to its own part the same way before the division. The result equals
the single-device output; gradients flow through by autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linattn_jax.ops import checks, chunking
from linattn_jax.ops.wkv import inputs, recurrent
from linattn_jax.ops.wkv.state import State, as_internal
from linattn_jax.typing import Array, Float


def sequence_parallel(
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h d"],
    *,
    time_decay: Float[Array, "h d"],
    time_first: Float[Array, "h d"],
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
):
    """``causal`` with the length sharded over mesh axis ``axis_name``.

    Args:
      k: keys ``[b, t, h, d]`` (a global array); t must be divisible by the size of
        ``axis_name``.
      v: values ``[b, t, h, d]``.
      time_decay: as in ``causal``, ``[h, d]``.
      time_first: as in ``causal``, ``[h, d]``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis (or axes) that splits the batch too.
      chunk_size: tokens per recomputed block of the backward pass (the scan's).
      initial_state: as in ``causal``.
      return_state: as in ``causal``.

    Returns:
      ``out [b, t, h, d]``, or ``(out, state)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not divide, or
        any error of ``causal``.
    """
    b, t, h, d = inputs.check(k, v, time_decay, time_first, step=False)
    checks.check_bool("return_state", return_state)
    mesh = checks.check_mesh(mesh, axis_name, batch_axis, t)
    checks.check_batch_axis(mesh, axis_name, batch_axis, b)
    checks.check_chunk_size(chunk_size)
    shards = mesh.shape[axis_name]
    k, v32, w, u, _ = inputs.operands(k, v, time_decay, time_first, None)
    state = as_internal(initial_state, b, h, d, k.dtype)

    def local(k, v, w, u, state):
        b_local, t_local = k.shape[:2]
        empty = as_internal(None, b_local, h, d, k.dtype)
        block = checks.default_chunk_size(chunk_size)
        live = inputs.live(None, b_local, t_local, block)
        (num, den, p), (num_s, den_s, m_s) = recurrent.run_scan(
            (k, v, w, u, live, None), empty, block
        )
        # [b, t, h, d]: the decays before each token (a sum, not a difference of sums)
        into = jnp.cumsum(jnp.pad(w[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0))), axis=1)
        total = jnp.sum(w, axis=1)
        gather = lambda x: jax.lax.all_gather(x, axis_name)
        nums, dens, ms, totals = gather(num_s), gather(den_s), gather(m_s), gather(total)
        prefix = [state]
        for s in range(shards):
            num_in, den_in, m_in = prefix[-1]
            m_out, (num_out, den_out) = chunking.log_join(
                totals[s] + m_in, (num_in, den_in), ms[s], (nums[s], dens[s])
            )
            prefix.append((num_out, den_out, inputs.floor(m_out)))
        index = jax.lax.axis_index(axis_name)
        num_in, den_in, m_in = (jnp.stack(x)[index] for x in zip(*prefix[:-1], strict=True))
        # Each token: the entering state, decayed by the shard's tokens before it, and its own.
        from_in = (num_in[:, None], den_in[:, None])
        _, (num, den) = chunking.log_join(into + m_in[:, None], from_in, p, (num, den))
        return inputs.finish(num, den, v.dtype), prefix[-1]

    seq = P(batch_axis, axis_name)
    out, final = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(seq, seq, seq, seq, P(batch_axis)),
        out_specs=(seq, P(batch_axis)),
        check_vma=False,  # the local scans start from a device-invariant state
    )(k, v32, w, u, state)
    return (out, State(*final)) if return_state else out
