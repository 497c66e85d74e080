"""The mLSTM with the length sharded over a mesh axis (LASP, with the stabiliser).

Each device runs the chunked form over its shard from no state at all (``m = -inf``),
which gives per token the stabilised numerator, denominator and ``m`` of its own
shard's keys, and the shard's state ``(C, n, m)`` with its total log forget gate ``F``.
The shards' states are all-gathered (n small matrices, never keys or values) and folded
into the state entering each shard, in log space::

    m' = max(F + m_in, m_s),  C' = exp(F + m_in - m') C_in + exp(m_s - m') C_s   (n alike)

and each token then joins the entering state to its own shard's part the same way
(``m_t = max(F_t + m_in, m_t^shard)``) before the normaliser. The result equals the
single-device output; gradients flow through by autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linattn_jax.ops import checks, chunking
from linattn_jax.ops.mlstm import inputs
from linattn_jax.ops.mlstm.chunked import run_chunks
from linattn_jax.ops.mlstm.state import State, as_internal
from linattn_jax.typing import Array, Float


def sequence_parallel(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    i: Float[Array, "b t h"],
    f: Float[Array, "b t h"],
    *,
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    forget_gate: str = "sigmoid",
    scale: float | None = None,
    eps: float = 1e-6,
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
):
    """``causal`` with the length sharded over mesh axis ``axis_name``.

    Args:
      q: queries ``[b, t, h, d]`` (a global array); t must be divisible by the size of
        ``axis_name``.
      k: keys ``[b, t, h, d]``.
      v: values ``[b, t, h, v]``.
      i: input gate pre-activations ``[b, t, h]``.
      f: forget gate pre-activations ``[b, t, h]``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis (or axes) that splits the batch too.
      forget_gate: as in ``causal``.
      scale: as in ``causal``.
      eps: as in ``causal``.
      chunk_size: as in ``causal``.
      initial_state: as in ``causal``.
      return_state: as in ``causal``.

    Returns:
      ``out [b, t, h, v]``, or ``(out, state)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not divide, or
        any error of ``causal``.
    """
    b, t, h, d = inputs.check(q, k, v, i, f, step=False, forget_gate=forget_gate, scale=scale,
                              eps=eps)  # fmt: skip
    checks.check_bool("return_state", return_state)
    mesh = checks.check_mesh(mesh, axis_name, batch_axis, t)
    checks.check_batch_axis(mesh, axis_name, batch_axis, b)
    checks.check_chunk_size(chunk_size)
    shards = mesh.shape[axis_name]
    q, k, v32, log_i, log_f, _, _ = inputs.operands(
        q, k, v, i, f, None, forget_gate=forget_gate, scale=scale
    )
    state = as_internal(initial_state, b, h, d, v.shape[-1], q.dtype)

    def local(q, k, v, log_i, log_f, state):
        b_local, t_local = q.shape[:2]
        none = (
            jnp.zeros((b_local, h, d, v.shape[-1]), q.dtype),
            jnp.zeros((b_local, h, d), q.dtype),
            jnp.full((b_local, h), -jnp.inf, q.dtype),
        )
        live = jnp.ones((b_local, t_local, 1), bool)
        xs = (q, k, v, log_i, log_f, live, None)
        (num, den, m), (c_s, n_s, m_s) = run_chunks(
            xs, none, chunk_size, dtype=chunking.operand_dtype(v.dtype)
        )
        into = jnp.cumsum(log_f, axis=1)  # [b, t, h]: the forget gates from the shard's start
        total = into[:, -1]
        gather = lambda x: jax.lax.all_gather(x, axis_name)
        cs, ns, ms, totals = gather(c_s), gather(n_s), gather(m_s), gather(total)
        prefix = [state]
        for s in range(shards):
            c_in, n_in, m_in = prefix[-1]
            m_out, (c_out, n_out) = chunking.log_join(
                totals[s] + m_in, (c_in, n_in), ms[s], (cs[s], ns[s])
            )
            prefix.append((c_out, n_out, m_out))
        index = jax.lax.axis_index(axis_name)
        c_in, n_in, m_in = (jnp.stack(x)[index] for x in zip(*prefix[:-1], strict=True))
        from_in = (
            jnp.einsum("bthd,bhdv->bthv", q, c_in),
            jnp.einsum("bthd,bhd->bth", q, n_in),
        )
        m_tok, (num, den) = chunking.log_join(into + m_in[:, None], from_in, m, (num, den))
        return inputs.finish(num, den, m_tok, eps, v.dtype), prefix[-1]

    seq = P(batch_axis, axis_name)
    out, final = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(seq, seq, seq, seq, seq, P(batch_axis)),
        out_specs=(seq, P(batch_axis)),
        check_vma=False,  # the local scans start from a device-invariant state
    )(q, k, v32, log_i, log_f, state)
    return (out, State(*final)) if return_state else out
