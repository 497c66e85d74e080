"""The additive family's inputs and outputs: feature maps applied, masks, normalisation.

Shared by every form (chunked, scan, quadratic, step, non-causal, sequence-parallel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax.ops import checks, feature_maps
from linattn_jax.typing import Array


def features(
    q, k, v, feature_map, key_mask=None, query_mask=None, positions=None, *, heads_first=True
):
    """phi(q), phi(k) as ``[b, h, t, f]`` and v as ``[b, h, s, v]``, all float32 (or float64);
    with ``heads_first=False`` as given, ``[b, t, h, f]`` and ``[b, s, h, v]``.

    Masked tokens (bool ``[b, t]`` / ``[b, s]`` masks) are replaced by zeros before the
    feature map and their features zeroed after it, so nothing non-finite in them
    reaches an output or a gradient.

    ``positions``: ``(query positions [b, t], key positions [b, s])`` for maps with
    ``needs_positions``; by default each sequence counts from 0.

    A registered (parameter-free) map is rematerialised in the gradient
    (``jax.checkpoint``): its backward recomputes what it needs from q and k in the
    pass that writes their cotangents, rather than storing (and later reading) a
    second array per input. Maps with a projection keep autodiff's residuals (their
    recomputation would repeat a matmul).
    """
    phi = feature_maps.get(feature_map)
    q, k, v = (
        checks.where_token(query_mask, q),
        checks.where_token(key_mask, k),
        checks.where_token(key_mask, v),
    )
    if getattr(phi, "needs_positions", False):
        if positions is None:
            span = max(q.shape[1], k.shape[1]) - 1
            positions = [jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2]) for x in (q, k)]
        elif all(checks.is_concrete(p) and p.size for p in positions):
            # np.asarray first: np.max would call the array's own max, staged under a jit
            # that closes over concrete positions.
            values = [np.asarray(p) for p in positions]
            span = int(max(np.max(p) for p in values) - min(np.min(p) for p in values))
        else:
            span = None
        max_length = getattr(phi, "max_length", None)
        if max_length is not None and span is not None and span > max_length:
            raise ValueError(
                f"this feature_map's reweighting holds for query-key distances up to "
                f"max_length={max_length}, got positions spanning {span}: build it with a "
                f"larger max_length"
            )
        phi_q, phi_k = phi(q, positions[0]), phi(k, positions[1])
    elif getattr(phi, "role_aware", False):
        phi_q, phi_k = phi(q, is_query=True), phi(k, is_query=False)
    else:
        remat = jax.checkpoint(phi) if feature_maps.is_registered(phi) else phi
        phi_q, phi_k = remat(q), remat(k)
    checks.check_features(phi_q, q)
    checks.check_features(phi_k, k)
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"feature_map gave different feature dims for q and k: {phi_q.shape} vs {phi_k.shape}"
        )
    dtype = feature_maps.accumulation_dtype(q.dtype)
    phi_q = checks.where_token(query_mask, phi_q.astype(dtype))
    phi_k = checks.where_token(key_mask, phi_k.astype(dtype))
    v = v.astype(dtype)
    if not heads_first:
        return phi_q, phi_k, v
    return tuple(jnp.swapaxes(x, 1, 2) for x in (phi_q, phi_k, v))


def chunk_kernel(q, k, feature_map, key_mask, g, *, heads_first=True):
    """``chunked.run_chunks``' ``kernel`` argument: ``(phi.kernel_from_dots, q, k, live)``, q and k
    masked and upcast as ``features`` does (and laid out as it does for ``heads_first``),
    for a map that has ``kernel_from_dots`` (``feature_maps.taylor``); None for the
    others, and with per-channel decays (which do not factor out of the kernel)."""
    fn = kernel_from_dots(feature_maps.get(feature_map), g)
    if fn is None:
        return None
    dtype = feature_maps.accumulation_dtype(q.dtype)
    q, k = (checks.where_token(key_mask, x).astype(dtype) for x in (q, k))
    live = None if key_mask is None else key_mask[:, :, None, None]
    if heads_first:
        q, k = jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)
        live = None if live is None else jnp.swapaxes(live, 1, 2)
    return fn, q, k, live


def kernel_from_dots(phi, g):
    """``phi.kernel_from_dots``, or None: for a map without one, and with per-channel
    decays ``g [.., f]`` (which do not factor out of the kernel)."""
    if g is not None and g.shape[-1] != 1:
        return None
    return getattr(phi, "kernel_from_dots", None)


def check_options(q, k, *, normalize, eps, return_state=False, decay=None) -> None:
    """The options the additive forms share: q and k of one dtype, bool ``normalize`` and
    ``return_state``, a number ``eps >= 0`` and a numeric ``decay`` (or None)."""
    checks.check_same_dtype(("q", q), ("k", k))
    checks.check_bool("normalize", normalize)
    checks.check_number("eps", eps, 0)
    checks.check_bool("return_state", return_state)
    checks.check_decay_value(decay)


def check_normalize(feature_map, normalize: bool, *, name: str | None = None) -> None:
    """Refuses the combinations of feature map and ``normalize`` that give wrong answers.

    Raises:
      ValueError: a map that shifts each query's features (FAVOR+) without
        normalisation, or a signed map (identity, random Fourier) with it: its
        denominator can be zero or negative. ``name`` is the map's name in the message.
    """
    phi = feature_maps.get(feature_map)
    if not normalize and getattr(phi, "requires_normalize", False):
        raise ValueError(
            "this feature_map scales each query's features for stability, which only "
            "normalize=True cancels: use normalize=True"
        )
    if normalize and getattr(phi, "signed", False):
        name = feature_map if name is None else name
        # A name as given; a map by its function's or class's name, never its arrays.
        label = (
            f"feature_map={name!r}"
            if isinstance(name, str)
            else f"feature_map {getattr(name, '__name__', None) or type(name).__name__}"
        )
        raise ValueError(
            f"{label} has a signed kernel: the denominator phi(q)^T Z "
            "can be zero or change sign, so normalize=True can divide by about zero; use "
            "normalize=False (an RMSNorm per head then keeps the output's scale)"
        )


def finish(
    num: Array, den: Array | None, normalize: bool, eps: float, dtype, *, time_axis: int = 2
) -> Array:
    """Numerator ``[b, h, t, v]`` (over denominator ``[b, h, t]``) -> ``[b, t, h, v]``;
    with ``time_axis=1`` they are ``[b, t, h, v]`` and ``[b, t, h]`` already."""
    if normalize:
        num = num / divisor(den, eps)[..., None]
    return (num if time_axis == 1 else jnp.swapaxes(num, 1, 2)).astype(dtype)


def divisor(den: Array, eps: float) -> Array:
    """``den + eps``, with 1 where that is 0: an all-zero query (masked, or the padding
    of the last chunk with ``eps=0``) then gives 0, not 0/0, and so does its gradient."""
    den = den + eps
    return jnp.where(den == 0, 1.0, den)
