"""An independent, naive reference: the masked quadratic form, written for clarity.

It shares no code with ``linattn_jax.attention``: every weight is built
explicitly as ``phi(q_i) . phi(k_j) * prod_{j < l <= i} a_l * [same segment]``,
with the decay product taken from an explicit indicator tensor, not a cumsum.
O(t^3) memory; for small test shapes only.
"""

from __future__ import annotations

import jax.numpy as jnp


def _per_token_log_decay(b, t, h, decay, gate):
    """log a_l as ``[b, h, t]`` (zeros when there is no decay)."""
    g = jnp.zeros((b, h, t), jnp.float32)
    if decay is not None:
        g = g + jnp.log(jnp.broadcast_to(jnp.asarray(decay, jnp.float32), (h,)))[None, :, None]
    if gate is not None:
        g = g + jnp.transpose(gate.astype(jnp.float32), (0, 2, 1))
    return g


def _same_run(segment_ids, t):
    """``[b, t, t]``: True where every token from min(i, j) to max(i, j) has the same id."""
    if segment_ids is None:
        return jnp.ones((1, t, t), bool)
    idx = jnp.arange(t)
    lo = jnp.minimum(idx[:, None], idx[None, :])
    hi = jnp.maximum(idx[:, None], idx[None, :])
    between = (idx[None, None, :] >= lo[:, :, None]) & (idx[None, None, :] <= hi[:, :, None])
    seg = segment_ids
    equal_to_i = seg[:, None, :] == seg[:, :, None]  # [b, i, l]
    ok = jnp.where(between[None], equal_to_i[:, :, None, :], True)  # [b, i, j, l]
    return jnp.all(ok, axis=-1)


def reference_attention(
    q,
    k,
    v,
    *,
    phi,
    causal,
    key_mask=None,
    query_mask=None,
    decay=None,
    gate=None,
    segment_ids=None,
    initial_state=None,
    normalize=True,
    eps=1e-6,
):
    """Returns ``(out [b, t, h, v] float32, (s [b,h,f,v], z [b,h,f]) final state)``."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    b, t, h, _ = q.shape
    s_len = k.shape[1]
    if getattr(phi, "needs_positions", False):  # position-aware maps see 0, 1, 2, ...
        pq = phi(q, jnp.broadcast_to(jnp.arange(t), (b, t))).astype(jnp.float32)
        pk = phi(k, jnp.broadcast_to(jnp.arange(s_len), (b, s_len))).astype(jnp.float32)
    else:
        pq = phi(q).astype(jnp.float32)  # [b, t, h, f]
        pk = phi(k).astype(jnp.float32)  # [b, s, h, f]
    weights = jnp.einsum("bthf,bshf->bhts", pq, pk)
    allowed = jnp.ones((b, 1, t, s_len), bool)
    if query_mask is None and key_mask is not None and t == s_len:
        query_mask = key_mask  # self-attention: a padded token's own output is 0
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    if segment_ids is not None:
        allowed = allowed & _same_run(segment_ids, t)[:, None]
    if causal:
        i = jnp.arange(t)
        allowed = allowed & (i[None, None, :, None] >= i[None, None, None, :])
        g = _per_token_log_decay(b, t, h, decay, gate)
        if key_mask is not None:  # a padded token does not decay the state either
            g = jnp.where(key_mask[:, None, :], g, 0.0)
        # log prod_{j < l <= i} a_l, from an explicit indicator [i, j, l].
        ind = (i[None, None, :] > i[None, :, None]) & (i[None, None, :] <= i[:, None, None])
        log_prod = jnp.einsum("ijl,bhl->bhij", ind.astype(jnp.float32), g)
        weights = weights * jnp.exp(jnp.where(allowed, log_prod, -jnp.inf))
        # The initial state reaches token i through a_0 ... a_i, within token 0's run.
        from_start = jnp.exp(
            jnp.einsum("il,bhl->bhi", (i[None, :] <= i[:, None]).astype(jnp.float32), g)
        )
        if segment_ids is not None:
            from_start = jnp.where(_same_run(segment_ids, t)[:, None, :, 0], from_start, 0.0)
    # The final state reads the last row before any query is masked.
    last_row = allowed[:, :, -1, :]
    if query_mask is not None:
        allowed = allowed & query_mask[:, None, :, None]
    weights = jnp.where(allowed, weights, 0.0)
    num = jnp.einsum("bhts,bshv->bhtv", weights, v)
    den = jnp.sum(weights, axis=-1)
    if causal and initial_state is not None:
        s0, z0 = initial_state
        reach = from_start if query_mask is None else jnp.where(query_mask[:, None], from_start, 0)
        num = num + reach[..., None] * jnp.einsum("bthf,bhfv->bhtv", pq, s0)
        den = den + reach * jnp.einsum("bthf,bhf->bht", pq, z0)
    out = num / (den[..., None] + eps) if normalize else num
    out = jnp.transpose(out, (0, 2, 1, 3))
    state = None
    if causal:
        # Final state: the decayed, masked weights of every key as seen from the last token.
        last = jnp.where(last_row, jnp.exp(log_prod[:, :, -1, :]), 0.0)
        s = jnp.einsum("bhs,bshf,bshv->bhfv", last, pk, v)
        z = jnp.einsum("bhs,bshf->bhf", last, pk)
        if initial_state is not None:
            s = s + from_start[:, :, -1, None, None] * s0
            z = z + from_start[:, :, -1, None] * z0
        state = (s, z)
    return out, state
