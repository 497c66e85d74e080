"""Grouped matmuls: ``rows [m, width]`` sorted by group, each group's rows times its own
weight ``w[g] [width, out]``.

Two forms, equal up to float rounding:

* ``"ragged"``: ``jax.lax.ragged_dot``, left to the backend's lowering. XLA:CPU lowers it
  as a dense matmul per group masked to its rows, so every group computes every row (``e``
  times the work); on an H200 with jax 0.11.2 it measured 5.7-8x a dense MLP of the same
  active parameters (docs/benchmarks.md), not yet a grouped matmul either.
* ``"tiled"``: each group's rows padded to whole tiles of ``tile`` rows, so that a tile
  holds one group's rows only, and each tile times its group's weight: ``m + e * tile``
  rows of work in all, whatever the routing.

``"auto"`` is ``"tiled"`` on CPU and ``"ragged"`` elsewhere (on the H200 the tiles were
1.5x faster at width 2048 and 0.76x at 1024: not a clear win, so not the default there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

METHODS = ("auto", "ragged", "tiled")


class Tiles(NamedTuple):
    """Where the sorted rows go in the tiled buffer ``[n_tiles * tile, width]``.

    Attributes:
      positions: int32 ``[m]``: row ``i``'s place; rows past the groups' sum go to
        ``n_tiles * tile`` (out of range: dropped, and read back as zeros).
      groups: int32 ``[n_tiles]``: the group of each tile; ``e`` for a tile past the used
        ones (zeros only, skipped).
      tile: the rows of a tile.
    """

    positions: jax.Array
    groups: jax.Array
    tile: int


def resolve(method: str) -> str:
    """``"ragged"`` or ``"tiled"`` for ``method`` (``"auto"``: tiled on CPU)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        return "tiled" if jax.default_backend() == "cpu" else "ragged"
    return method


def apply(
    body: Callable, x: jax.Array, group_sizes: jax.Array, *, method: str = "auto"
) -> jax.Array:
    """``body(dot, x)`` for rows ``x [m, width]`` sorted by group, where ``dot(rows, w)``
    multiplies each group's rows by its ``w [e, ., .]`` in the form ``method`` gives
    (``body`` may apply elementwise functions between its products: a padding row is
    zeros, and no product reaches across rows).

    Returns:
      ``[m, out]``: zeros for the rows past the groups' sum.
    """
    if resolve(method) == "tiled":
        layout = tiles(group_sizes, x.shape[0])
        dot = lambda rows, w: tiled_dot(rows, w, layout.groups)
        return from_tiles(body(dot, to_tiles(x, layout)), layout)
    return body(lambda rows, w: jax.lax.ragged_dot(rows, w, group_sizes), x)


def tile_rows(rows: int, groups: int) -> int:
    """The tile height for ``rows`` rows in ``groups`` groups: the power of two nearest
    ``rows / (4 * groups)``, at least 8, so that the padding adds at most a quarter of the
    rows (an eighth on average) and a tile's matmul is long enough to run at speed."""
    target = max(rows / (4 * groups), 8.0)
    return 1 << max(round(math.log2(target)), 3)


def tiles(group_sizes: jax.Array, rows: int, tile: int | None = None) -> Tiles:
    """The layout of ``rows`` sorted rows in groups of ``group_sizes`` int ``[e]`` (which
    sum to at most ``rows``), each group padded to whole tiles."""
    e = group_sizes.shape[0]
    tile = tile_rows(rows, e) if tile is None else tile
    n_tiles = rows // tile + e  # the groups' ceil(size / tile) sum to fewer
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    padded = (sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded)
    i = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
    g = jnp.minimum(group, e - 1)
    offset = (padded_ends - padded)[g] + i - (ends - sizes)[g]
    positions = jnp.where(group < e, offset, n_tiles * tile)
    starts = jnp.arange(n_tiles, dtype=jnp.int32) * tile
    owner = jnp.searchsorted(padded_ends, starts, side="right").astype(jnp.int32)
    return Tiles(positions, owner, tile)


def to_tiles(x: jax.Array, layout: Tiles) -> jax.Array:
    """``x [m, width]`` -> ``[n_tiles, tile, width]``, zeros where no row lands (rows past
    the groups never enter: their NaN or inf reaches no matmul)."""
    n_tiles = layout.groups.shape[0]
    buffer = jnp.zeros((n_tiles * layout.tile, x.shape[-1]), x.dtype)
    buffer = buffer.at[layout.positions].set(x, mode="drop")
    return buffer.reshape(n_tiles, layout.tile, x.shape[-1])


@jax.custom_vjp
def tiled_dot(x: jax.Array, w: jax.Array, groups: jax.Array) -> jax.Array:
    """``x [n_tiles, tile, width]`` times each tile's group's ``w [e, width, out]``
    (``groups`` int ``[n_tiles]``; zeros for a tile of group ``e``, unused): a loop over the
    tiles indexing ``w`` in place (a gather of a weight per tile costs more than the
    matmuls on CPU), its gradient written out so that each tile adds into its group's rows
    of a float32 (or wider) ``dw`` (autodiff's would add a whole ``[e, width, out]`` per
    tile)."""
    return _per_tile(lambda xt, g: xt @ w[g], x, groups, w.shape[0], w.shape[2])


def _per_tile(product, x, groups, e: int, out: int):
    """``product(x[t], groups[t])`` for each used tile, zeros ``[tile, out]`` for others."""

    def one(a):
        xt, g = a
        zeros = lambda: jnp.zeros((xt.shape[0], out), xt.dtype)
        return jax.lax.cond(g < e, lambda: product(xt, g).astype(xt.dtype), zeros)

    return jax.lax.map(one, (x, groups))


def _tiled_dot_fwd(x, w, groups):
    return tiled_dot(x, w, groups), (x, w, groups)


def _tiled_dot_bwd(saved, dy):
    x, w, groups = saved
    e = w.shape[0]
    dx = _per_tile(lambda dyt, g: dyt @ w[g].T, dy, groups, e, w.shape[1])
    acc = jnp.float64 if w.dtype == jnp.float64 else jnp.float32

    def add(dw, a):
        xt, dyt, g = a
        grad = lambda: dw.at[g].add(jnp.matmul(xt.T, dyt, preferred_element_type=acc))
        return jax.lax.cond(g < e, grad, lambda: dw), None

    dw, _ = jax.lax.scan(add, jnp.zeros(w.shape, acc), (x, dy, groups))
    return dx, dw.astype(w.dtype), None


tiled_dot.defvjp(_tiled_dot_fwd, _tiled_dot_bwd)


def from_tiles(y: jax.Array, layout: Tiles) -> jax.Array:
    """``y [n_tiles, tile, out]`` -> the rows ``[m, out]`` (zeros past the groups)."""
    flat = y.reshape(-1, y.shape[-1])
    return jnp.take(flat, layout.positions, axis=0, mode="fill", fill_value=0)
