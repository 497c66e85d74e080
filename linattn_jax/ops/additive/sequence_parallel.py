"""Sequence-parallel causal linear attention (LASP): the length sharded over a mesh axis.

A sequence too long for one device is split along its length over a mesh axis. Linear
attention needs only one thing from the devices before it: their (S, Z) state, a fixed
f x (v+1) matrix per head, not their keys and values. Each device runs the chunked form
on its shard from a zero state; the shards' final states and total decays are
all-gathered (n small matrices) and folded into the state entering each shard, an
exclusive prefix that respects decay and gating; each shard then adds
``phi(q_i)^T (decay to i) S_in``. The result equals the single-device output; gradients
flow through by autodiff (the all-gather's transpose is a reduce-scatter).
Communication per layer: an all-gather of ``n * b * h * f * (v+1)`` floats, against
``t * b * h * (d + v)`` for gathering keys and values (softmax sequence parallelism).

References:
  Sun et al. 2024, "Linear Attention Sequence Parallelism"
  (https://arxiv.org/abs/2404.02882).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linattn_jax.ops import checks, chunking, feature_maps
from linattn_jax.ops.additive import inputs
from linattn_jax.ops.additive.api import causal
from linattn_jax.ops.additive.chunked import run_chunks
from linattn_jax.ops.additive.state import State, as_internal, zeros
from linattn_jax.typing import Array, FeatureMap, Float


def sequence_parallel(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    *,
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    feature_map: str | FeatureMap = "elu",
    chunk_size: int | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    decay: Any = None,
    gate: Array | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
):
    """Causal linear attention with the length sharded over mesh axis ``axis_name``.

    Args:
      q: queries ``[b, t, h, d]`` (a global array); t must be divisible by the size
        of ``axis_name``.
      k: keys ``[b, t, h, d]``.
      v: values ``[b, t, h, v]``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis (or axes) that splits the batch too.
      feature_map: as in ``causal``; position-aware maps see global positions.
      chunk_size: as in ``causal``.
      initial_state: as in ``causal``.
      return_state: as in ``causal``.
      decay: as in ``causal``.
      gate: as in ``causal``.
      normalize: as in ``causal``.
      eps: as in ``causal``.

    Returns:
      ``out [b, t, h, v]``, or ``(out, state)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not
        divide, or any error of ``causal``.
    """
    b, t, h, _ = checks.check_qkv(q, k, v, causal=True)
    inputs.check_options(q, k, normalize=normalize, eps=eps, return_state=return_state, decay=decay)
    mesh = checks.check_mesh(mesh, axis_name, batch_axis, t)
    checks.check_batch_axis(mesh, axis_name, batch_axis, b)
    shards = mesh.shape[axis_name]
    checks.check_chunk_size(chunk_size)
    inputs.check_normalize(feature_map, normalize)
    phi = feature_maps.get(feature_map)
    f = feature_maps.feature_dim(phi, q.shape[-1], h)
    dtype = feature_maps.accumulation_dtype(q.dtype)
    # Validates decay and gate before tracing the shards.
    checks.log_decay(decay, gate, b, t, h, dtype, channels=f)
    if 0 in (b, t, h):
        # Nothing to shard (the output is empty, the state passes through): the one-device
        # form. An empty shard in shard_map also crashes XLA's compiler on jax 0.11.2.
        return causal(
            q, k, v, feature_map=feature_map, chunk_size=chunk_size, initial_state=initial_state,
            return_state=return_state, decay=decay, gate=gate, normalize=normalize, eps=eps,
        )  # fmt: skip
    state = as_internal(initial_state, b, h, f, v.shape[-1], dtype)

    def local(q, k, v, state, extras):
        b_local, t_local = q.shape[:2]
        index = jax.lax.axis_index(axis_name)
        positions = index * t_local + jnp.arange(t_local)
        positions = jnp.broadcast_to(positions, q.shape[:2])
        phi_q, phi_k, v32 = inputs.features(q, k, v, phi, positions=(positions, positions))
        g = checks.log_decay(
            extras.get("decay"), extras.get("gate"), b_local, t_local, h, dtype, channels=f
        )
        zero = zeros(b_local, h, f, v.shape[-1], dtype)
        (num, den), (s_local, z_local) = run_chunks(
            phi_q,
            phi_k,
            v32,
            g,
            None,
            zero,
            checks.default_chunk_size(chunk_size, g),
            diagonal=True,
        )
        # The whole shard as one span of decays: exp(G_i) to each token, and across it.
        dec = chunking.decays(g, None, phi_q.shape[:3], dtype)
        into = jnp.ones(phi_q.shape[:3] + (1,), dtype) if dec is None else dec.into
        across = jnp.ones((b_local, h, 1), dtype) if dec is None else dec.across
        # Every shard's state (S | Z, one gather) and total decay; then the state
        # entering each shard, an exclusive prefix.
        packed = jnp.concatenate([s_local, z_local[..., None]], axis=-1)
        states = jax.lax.all_gather(packed, axis_name)  # [n, b, h, f, v+1]
        totals = jax.lax.all_gather(across, axis_name)  # [n, b, h, 1 or f (GLA)]
        prefix = [jnp.concatenate([state[0], state[1][..., None]], axis=-1)]
        for i in range(shards):
            prefix.append(totals[i][..., None] * prefix[-1] + states[i])
        s_in = jnp.stack(prefix[:-1])[index]
        q_in = phi_q * into
        num = num + jnp.einsum("bhtf,bhfv->bhtv", q_in, s_in[..., :-1])
        den = den + jnp.einsum("bhtf,bhf->bht", q_in, s_in[..., -1])
        return num, den, prefix[-1]

    seq = P(batch_axis, axis_name)
    extras = {}
    extra_specs = {}
    if decay is not None:
        extras["decay"], extra_specs["decay"] = jnp.asarray(decay, dtype), P()
    if gate is not None:
        extras["gate"], extra_specs["gate"] = gate, seq
    num, den, final = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(seq, seq, seq, P(batch_axis), extra_specs),
        out_specs=(P(batch_axis, None, axis_name), P(batch_axis, None, axis_name), P(batch_axis)),
        check_vma=False,  # the local scans start from a zero (device-invariant) state
    )(q, k, v, state, extras)
    out = inputs.finish(num, den, normalize, eps, v.dtype)
    if return_state:
        return out, State(s=final[..., :-1], z=final[..., -1])
    return out
