"""Sequence-parallel causal linear attention (LASP; Sun et al. 2024).

A sequence too long for one device is split along its length over a mesh
axis. Linear attention needs only one thing from the devices before it: their
(S, Z) state, a fixed f x (v+1) matrix per head, not their keys and values.
Each device runs the chunked form on its shard from a zero state; the shards'
final states and total decays are all-gathered (n small matrices) and folded
into the state entering each shard, an exclusive prefix that respects decay
and gating; each shard then adds ``phi(q_i)^T (decay to i) S_in``. The result
equals the single-device output; gradients flow through by autodiff (the
all-gather's transpose is a reduce-scatter).

Communication per layer: an all-gather of ``n * b * h * f * (v+1)`` floats,
against ``t * b * h * (d + v)`` for gathering keys and values, which is what
softmax sequence parallelism needs.

The delta rule (``sequence_parallel_delta_rule``) gathers each shard's affine
map of the state instead, ``(M, S_local)``: ``n * b * h * dk * (dk + dv)`` floats.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linattn_jax import attention as attn
from linattn_jax import checks, chunking, feature_maps
from linattn_jax.delta_rule import DeltaRuleState, delta_rule
from linattn_jax.typing import Array, FeatureMap, Float


def sequence_parallel_causal_linear_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    *,
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | None = None,
    feature_map: str | FeatureMap = "elu",
    chunk_size: int = 64,
    initial_state: attn.LinearAttentionState | None = None,
    return_state: bool = False,
    decay: Any = None,
    gate: Array | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
):
    """Causal linear attention with the length sharded over mesh axis ``axis_name``.

    Args:
      q, k, v: ``[b, t, h, d]``, ``[b, t, h, d]``, ``[b, t, h, v]`` (global arrays);
        t must be divisible by the size of ``axis_name``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis that splits the batch too (a 2-D mesh).
      feature_map, chunk_size, initial_state, return_state, decay, gate, normalize,
        eps: as in ``causal_linear_attention`` (position-aware maps see global
        positions).

    Returns:
      ``out [b, t, h, v]``, or ``(out, state)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not
        divide, or any error of ``causal_linear_attention``.
    """
    b, t, h, _ = checks.check_qkv(q, k, v, causal=True)
    mesh = _check_mesh(mesh, axis_name, batch_axis, t)
    shards = mesh.shape[axis_name]
    checks.check_chunk_size(chunk_size)
    attn.check_normalize(feature_map, normalize)
    phi = feature_maps.get(feature_map)
    f = feature_maps.feature_dim(phi, q.shape[-1], h)
    dtype = feature_maps.accumulation_dtype(q.dtype)
    # Validates decay and gate before tracing the shards.
    checks.log_decay(decay, gate, b, t, h, dtype, channels=f)
    state = attn.state_in(initial_state, b, h, f, v.shape[-1], dtype)

    def local(q, k, v, state, extras):
        b_local, t_local = q.shape[:2]
        index = jax.lax.axis_index(axis_name)
        positions = index * t_local + jnp.arange(t_local)
        positions = jnp.broadcast_to(positions, q.shape[:2])
        phi_q, phi_k, v32 = attn.features(q, k, v, phi, positions=(positions, positions))
        g = checks.log_decay(
            extras.get("decay"), extras.get("gate"), b_local, t_local, h, dtype, channels=f
        )
        zero = attn.state_in(None, b_local, h, f, v.shape[-1], dtype)
        (num, den), (s_local, z_local) = attn.chunked(
            phi_q, phi_k, v32, g, None, zero, chunk_size, diagonal=True
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
    out = attn.finish(num, den, normalize, eps, v.dtype)
    if return_state:
        return out, attn.LinearAttentionState(s=final[..., :-1], z=final[..., -1])
    return out


def sequence_parallel_delta_rule(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t h d"],
    v: Float[Array, "b t h v"],
    beta: Float[Array, "b t h"],
    *,
    axis_name: str,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | None = None,
    gate: Array | None = None,
    chunk_size: int | None = None,
    initial_state: DeltaRuleState | None = None,
    return_state: bool = False,
    scale: float = 1.0,
):
    """The delta rule (DeltaNet, Gated DeltaNet, KDA) with the length sharded over an axis.

    A shard's effect on the state is affine, ``S_out = M S_in + S_local``, with
    ``M = prod_t alpha_t (I - beta_t k_t k_t^T)`` (``dk x dk`` per head). The
    recurrence is linear in (state, values), so one chunked pass with values
    ``[v | 0]`` from the state ``[0 | I]`` ends in ``[S_local | M]``. Each device
    all-gathers these (``n * b * h * dk * (dk + dv)`` floats, never keys or
    values), folds the exclusive prefix into the state entering its shard, and
    reruns its shard from that state for the outputs. Equal to ``delta_rule`` on
    one device; gradients by autodiff.

    Args:
      q, k, v, beta: ``[b, t, h, dk]``, ``[b, t, h, dk]``, ``[b, t, h, dv]``, ``[b, t, h]``
        (global arrays); t must be divisible by the size of ``axis_name``.
      axis_name: the mesh axis that splits the sequence.
      mesh: the mesh; the current one (``jax.set_mesh``) when None.
      batch_axis: an optional mesh axis that splits the batch too (a 2-D mesh).
      gate, chunk_size, initial_state, return_state, scale: as in ``delta_rule``.

    Returns:
      ``out [b, t, h, dv]``, or ``(out, DeltaRuleState)`` when ``return_state``.

    Raises:
      ValueError: an axis not in the mesh, a length the axis size does not
        divide, or any error of ``delta_rule``.
    """
    b, t, h, dk = checks.check_qkv(q, k, v, causal=True)
    dv = v.shape[-1]
    mesh = _check_mesh(mesh, axis_name, batch_axis, t)
    shards = mesh.shape[axis_name]
    # Validates everything else on the global arrays before tracing the shards.
    jax.eval_shape(
        lambda *a: delta_rule(*a, gate=gate, chunk_size=chunk_size, scale=scale),
        q, k, v, beta,
    )  # fmt: skip
    dtype = feature_maps.accumulation_dtype(q.dtype)
    s0 = jnp.zeros((b, h, dk, dv), dtype) if initial_state is None else initial_state.s
    run = functools.partial(delta_rule, chunk_size=chunk_size, scale=scale)

    def local(q, k, v, beta, s0, extras):
        gate = extras.get("gate")
        b_local, t_local = q.shape[:2]
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=dtype), (b_local, h, dk, dk))
        start = DeltaRuleState(jnp.concatenate([jnp.zeros_like(s0), eye], axis=-1))
        values = jnp.concatenate([v, jnp.zeros((b_local, t_local, h, dk), v.dtype)], axis=-1)
        _, end = run(q, k, values, beta, gate=gate, initial_state=start, return_state=True)
        ends = jax.lax.all_gather(end.s, axis_name)  # [n, b, h, dk, dv + dk]: S_local | M
        prefix = [s0]
        for i in range(shards):
            prefix.append(ends[i, ..., dv:] @ prefix[-1] + ends[i, ..., :dv])
        s_in = jnp.stack(prefix[:-1])[jax.lax.axis_index(axis_name)]
        out = run(q, k, v, beta, gate=gate, initial_state=DeltaRuleState(s_in))
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
    return (out, DeltaRuleState(final)) if return_state else out


def _check_mesh(mesh, axis_name: str, batch_axis: str | None, t: int):
    """The mesh (the current one when None), checked against the axes and the length."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    for name, axis in [("axis_name", axis_name), ("batch_axis", batch_axis)]:
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}")
    shards = mesh.shape[axis_name]
    if t % shards:
        raise ValueError(
            f"length t={t} must be divisible by the {shards} devices of axis {axis_name!r}"
        )
    return mesh


def communication_bytes(
    b: int,
    t: int,
    h: int,
    d: int,
    dv: int,
    f: int,
    shards: int,
    decayed: bool = False,
    itemsize: int = 4,
) -> dict[str, int]:
    """Bytes each device receives per layer: this state all-gather vs a K/V all-gather.

    Each device receives the other ``shards - 1`` shards' states, ``f x (v+1)`` per
    (b, h), plus their total decay (one number per (b, h)) when ``decayed``; for the
    delta rule, their ``(M, S_local)``, ``d x (d + v)`` per (b, h).
    """
    per_shard = b * h * (f * (dv + 1) + (1 if decayed else 0))
    return {
        "linear_state_allgather": (shards - 1) * per_shard * itemsize,
        "delta_state_allgather": (shards - 1) * b * h * d * (d + dv) * itemsize,
        "kv_allgather": (shards - 1) * (t // shards) * b * h * (d + dv) * itemsize,
    }


_ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def allgather_bytes(hlo_text: str) -> int:
    """Total bytes of the all-gather results in a compiled HLO module's text."""
    total = 0
    for line in hlo_text.splitlines():
        match = re.search(r"=\s*\(?(\w+)\[([\d,]*)\][^=]*\ball-gather(?:-start)?\(", line)
        if match and match.group(1) in _ITEMSIZE:
            dims = [int(x) for x in match.group(2).split(",") if x]
            total += _ITEMSIZE[match.group(1)] * math.prod(dims)
    return total
