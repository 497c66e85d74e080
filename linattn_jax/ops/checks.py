"""Input checks and parsing shared by every family of recurrences.

Each check raises a ``ValueError`` that names the argument, the layout it
expects and what it received. Parsers turn the user-facing options (``decay``,
``gate``, ``segment_ids``, ``key_mask``) into the internal heads-first layout
that ``linattn_jax.ops.chunking`` runs over:

* log-decays ``[b, h, t, g]`` with ``g`` 1 (one gate per head) or the feature
  width (one gate per channel: GLA, KDA), <= 0; ``-inf`` zeroes the state (the
  chunked forms turn it into a reset, ``chunking.decays``);
* segment resets ``[b, 1, t, 1]``, 1.0 where a new segment starts: wherever the id
  changes (a segment is a run of equal ids, ``segment_runs``; a repeated id later in
  the row starts a new segment).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from linattn_jax.typing import Array


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if not hasattr(x, "shape") or len(x.shape) != rank:
        shape = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {shape}")


def check_shape(name: str, x, shape: tuple[int, ...], layout: str) -> None:
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(shape):
        got = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have shape {layout}={tuple(shape)}, got {got}")


def check_same(*named, axes: tuple[int, ...], what: str) -> None:
    shapes = {name: tuple(x.shape[a] for a in axes) for name, x in named}
    if len(set(shapes.values())) > 1:
        got = ", ".join(f"{name} {x.shape}" for name, x in named)
        raise ValueError(f"{' and '.join(shapes)} must agree in {what}; got {got}")


def check_float(*named) -> None:
    """Integer or bool inputs would make integer outputs: refuse them."""
    for name, x in named:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def check_qkv(q, k, v, *, causal: bool) -> tuple[int, int, int, int]:
    """Validates ``[b, t, h, d]`` queries against keys and values; returns ``q.shape``."""
    for name, x in [("q", q), ("k", k), ("v", v)]:
        check_rank(name, x, 4, "[batch, length, heads, dim]")
    check_float(("q", q), ("k", k), ("v", v))
    check_same(("q", q), ("k", k), ("v", v), axes=(0, 2), what="batch and heads")
    check_same(("k", k), ("v", v), axes=(1,), what="key length")
    check_same(("q", q), ("k", k), axes=(3,), what="head dimension")
    if causal:
        check_same(("q", q), ("k", k), axes=(1,), what="length (causal attention)")
    return q.shape


def check_step_qkv(q, k, v) -> tuple[int, int, int]:
    """Validates one token's ``[b, h, d]`` query, key and value; returns ``q.shape``."""
    for name, x in [("q", q), ("k", k), ("v", v)]:
        check_rank(name, x, 3, "[batch, heads, dim]")
    check_float(("q", q), ("k", k), ("v", v))
    check_same(("q", q), ("k", k), ("v", v), axes=(0, 1), what="batch and heads")
    check_same(("q", q), ("k", k), axes=(2,), what="head dimension")
    return q.shape


def check_int(name: str, value, minimum: int) -> None:
    """An int (not a bool) of at least ``minimum``, or a ValueError naming ``name``: the one
    integer validator of the library (sizes, chunk sizes, layer options)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_sizes(**sizes) -> None:
    """Each named size an int >= 1 (``check_int``)."""
    for name, n in sizes.items():
        check_int(name, n, 1)


# Tokens per chunk where the caller gives none: ``chunk_size=None`` in the library, and a
# config's ``model.chunk_size=0``, which ``experiments.builders`` reads as None. Resolved
# here only (``default_chunk_size``), for every family and form.
CHUNK_SIZE = 64  # the accelerators' usual tile
# Per-channel log-decays need a ``[c, c, f]`` relative decay inside each chunk (in
# sub-chunks of 16 above that size), so their cost grows with c; measured on CPU, c = 16
# beat c = 64 by 2-3x (``python -m experiments.benchmark --recurrences``).
CHUNK_SIZE_PER_CHANNEL = 16
# The delta rule's and the mLSTM's chunked forms compiled for CPU (docs/benchmarks.md): at
# t=8192 DeltaNet's forward+backward 14% and Gated DeltaNet's 4% faster than at 64, for 1.2x
# the scratch; the mLSTM's forward 10-11% and its forward+backward 7-12% faster at t=2048
# and 8192.
CHUNK_SIZE_CPU = 32


def check_chunk_size(chunk_size) -> None:
    """``chunk_size``: None (the default) or an int >= 1, or a ValueError naming it."""
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, 1)


FORM_OPTIONS = ("method", "chunk_size", "return_state")


def one_program(*options: str):
    """A decorator: the function jitted with ``FORM_OPTIONS`` and ``options`` static. A
    family's ``causal`` calls such a function after its checks, for the whole computation:
    called eagerly it is one XLA program (op by op it was tens, and an eager ``lax.scan``
    compiled again at every call); under a caller's ``jit`` it is inlined and traced once
    per shape. Build no constant inside it that only the options decide, such as an all-true
    mask: under a caller's ``jit`` and ``grad`` RWKV's was left unfolded (35 more operations)."""
    return functools.partial(jax.jit, static_argnames=FORM_OPTIONS + options)


def default_chunk_size(
    chunk_size: int | None, g: Array | None = None, *, on_cpu: bool = False
) -> int:
    """``chunk_size``, or when None the default: ``CHUNK_SIZE_PER_CHANNEL`` (16) for
    per-channel log-decays ``g [b, h, t, f > 1]`` (or ``[b, t, h, f > 1]``), else
    ``CHUNK_SIZE_CPU`` (32) for a chunked form compiled for CPU that asks for it
    (``on_cpu``: the delta rule's and the mLSTM's), else ``CHUNK_SIZE`` (64).
    """
    if chunk_size is not None:
        return chunk_size
    if g is not None and g.shape[-1] > 1:
        return CHUNK_SIZE_PER_CHANNEL
    return CHUNK_SIZE_CPU if on_cpu else CHUNK_SIZE


def is_concrete(x) -> bool:
    """True when ``x`` holds values now (not a tracer): only then can its range be checked.

    An array closed over by a jitted function (``nnx.jit(lambda m: m(tokens))(model)``) is
    concrete, but what JAX computes from it while tracing is not: ``int(jnp.min(x))`` there
    raises ``ConcretizationTypeError``. Read a concrete array's values with ``np.asarray``
    or ``concrete_range``, never with ``jnp`` under a possible trace.
    """
    return not isinstance(x, jax.core.Tracer)


def concrete_range(x) -> tuple | None:
    """``(min, max)`` of a concrete, non-empty array as Python scalars, else None (a tracer,
    whose values only exist when the program runs, or an empty array).

    The reductions run eagerly even while a function that closes over ``x`` is being
    traced (``jax.ensure_compile_time_eval``), on the devices that hold ``x``: only two
    scalars reach the host, whatever its sharding.
    """
    if not is_concrete(x) or x.size == 0:
        return None
    with jax.ensure_compile_time_eval():
        return jnp.min(x).item(), jnp.max(x).item()


def check_steps(name: str, dt, key_mask=None) -> None:
    """Concrete steps ``dt`` (``[b, t, ...]``, or ``[b, ...]`` with ``key_mask`` None) must
    be >= 0 at real tokens (a softplus; padding may hold anything): a negative step is a
    decay above one, which no form here is exact for. NaN passes (it spoils its channel as
    the per-token recurrence would)."""
    if is_concrete(dt) and is_concrete(key_mask) and dt.size:
        real = np.asarray(dt)
        if key_mask is not None:
            mask = np.asarray(key_mask).reshape(key_mask.shape + (1,) * (real.ndim - 2))
            real = np.where(mask, real, 0.0)
        if np.any(real < 0):
            raise ValueError(f"{name} must be >= 0 (a softplus), got a minimum of {np.min(real)}")


def token_mask(name: str, mask, b: int, t: int) -> Array | None:
    """A bool ``[b, t]`` mask (True = real token), checked; None passes through."""
    if mask is None:
        return None
    check_shape(name, mask, (b, t), "[batch, length]")
    if mask.dtype != jnp.bool_:
        raise ValueError(f"{name} must be bool (True = real token), got {mask.dtype}")
    return mask


def where_token(mask: Array | None, x: Array) -> Array:
    """``x [b, t, ...]`` with masked tokens replaced by zeros.

    ``where``, not a product: a NaN or inf in a padded token must not reach the
    real ones, in the forward pass or the gradient (0 * NaN is NaN).
    """
    if mask is None:
        return x
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


def log_decay(
    decay, gate, b: int, t: int, h: int, dtype, *, channels: int | None = None, key_mask=None
):
    """``log(decay) + gate`` as the internal log-decay ``[b, h, t, g]``, or None.

    Args:
      decay: None, or a fixed decay in [0, 1], a scalar or one per head ``[h]``.
      gate: None, or log-decays ``[b, t, h]`` (per head) or, when ``channels`` is
        given, ``[b, t, h, channels]`` (per channel), values <= 0.
      channels: the width a per-channel gate must have (None: per-head gates only).
      key_mask: optional bool ``[b, t]``; a masked (padding) token neither decays
        nor resets the state, whatever its gate holds.

    Returns:
      ``g`` <= 0, or None when neither option is given. ``-inf`` (a decay of 0) is a
      full reset: the per-token forms take ``exp(-inf) = 0`` as it is, the chunked
      ones turn it into a reset (``chunking.decays``) and never subtract infinities.

    Out-of-range values that can only be seen under ``jit`` (traced) are clamped:
    a positive gate counts as 0 (no decay), a decay outside [0, 1] as the nearest
    end. Every form does the same, so they never disagree. Concrete values out of
    range raise.
    """
    if decay is None and gate is None:
        return None
    if decay is not None:
        if jnp.shape(decay) not in ((), (h,)):
            raise ValueError(
                f"decay must be a scalar or [heads]=({h},), got shape {jnp.shape(decay)}"
            )
        if is_concrete(decay):
            bad = np.asarray(decay).astype(dtype)
            if np.any(~((bad > 0) & (bad <= 1))):
                raise ValueError(f"decay must lie in (0, 1], got {bad}")
    if gate is not None:
        shapes = {(b, t, h): "[batch, length, heads]"}
        if channels is not None:
            shapes[(b, t, h, channels)] = "[batch, length, heads, channels]"
        if not hasattr(gate, "shape") or tuple(gate.shape) not in shapes:
            raise ValueError(
                f"gate must have shape {' or '.join(f'{v}={k}' for k, v in shapes.items())}, "
                f"got {getattr(gate, 'shape', type(gate).__name__)}"
            )
        if not jnp.issubdtype(gate.dtype, jnp.floating):
            raise ValueError(f"gate must be floating-point log-decays, got dtype {gate.dtype}")
        if is_concrete(gate) and is_concrete(key_mask) and gate.size:
            real = np.asarray(gate)  # padding is never validated: it may hold anything
            if key_mask is not None:
                mask = np.asarray(key_mask).reshape(key_mask.shape + (1,) * (real.ndim - 2))
                real = np.where(mask, real, 0.0)
            if np.max(real) > 0:
                raise ValueError(f"gate must be log-decays <= 0, got a maximum of {np.max(real)}")
    return _log_decay(decay, gate, key_mask, b=b, t=t, h=h, dtype=jnp.dtype(dtype))


# The checked arrays' sum: one program when called eagerly, inlined under a caller's jit.
@functools.partial(jax.jit, static_argnames=("b", "t", "h", "dtype"))
def _log_decay(decay, gate, key_mask, *, b: int, t: int, h: int, dtype):
    total = jnp.zeros((b, h, t, 1), dtype)
    if decay is not None:
        decay = jnp.asarray(decay).astype(dtype)
        # where, not clip: clip passes on half the gradient at a decay of exactly 1.
        decay = jnp.where(decay > 1, 1.0, jnp.where(decay < 0, 0.0, decay))
        decay = jnp.broadcast_to(decay, (h,))
        total = total + jnp.log(decay)[None, :, None, None]
    if gate is not None:
        g = gate.astype(dtype)
        # Not jnp.minimum: at a tie it would pass on half the gradient of a gate of exactly 0.
        g = jnp.where(g > 0, 0.0, g)
        g = g[..., None] if g.ndim == 3 else g
        total = total + jnp.swapaxes(g, 1, 2)
    return where_heads_first(key_mask, total)


def step_log_decay(decay, gate, b: int, h: int, dtype, *, channels: int, channel_name: str):
    """One decoding step's ``log(decay) + gate`` as ``[b, h, 1, g]`` (``log_decay``'s layout
    for a one-token sequence), or None; ``gate`` is ``[b, h]`` or ``[b, h, channels]``."""
    if gate is not None:
        if not hasattr(gate, "shape") or tuple(gate.shape) not in ((b, h), (b, h, channels)):
            raise ValueError(
                f"gate must have shape [batch, heads]={(b, h)} or [batch, heads, {channel_name}]="
                f"{(b, h, channels)}, got {getattr(gate, 'shape', type(gate).__name__)}"
            )
        gate = gate[:, None]
    return log_decay(decay, gate, b, 1, h, dtype, channels=channels)


def where_heads_first(mask: Array | None, x: Array) -> Array:
    """``x [b, h, t, ...]`` with masked tokens (bool ``[b, t]``) replaced by zeros."""
    if mask is None:
        return x
    mask = mask.reshape((mask.shape[0], 1, mask.shape[1]) + (1,) * (x.ndim - 3))
    return jnp.where(mask, x, jnp.zeros((), x.dtype))


def check_segment_ids(segment_ids, b: int, t: int) -> None:
    """Integer ``[b, t]`` segment ids, or a ValueError naming ``segment_ids``."""
    check_shape("segment_ids", segment_ids, (b, t), "[batch, length]")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")


def segment_resets(segment_ids, b: int, t: int, dtype) -> Array:
    """1.0 at tokens whose id differs from the previous token's, as ``[b, 1, t, 1]``."""
    check_segment_ids(segment_ids, b, t)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    change = jnp.concatenate([jnp.zeros((b, 1), bool), change], axis=1)
    return change.astype(dtype)[:, None, :, None]


def segment_runs(segment_ids: Array) -> Array:
    """Each token's segment ``[b, t]`` int32: 0 for a row's first run of ids, one more at
    every change of id. The library's one rule for packed rows: a segment is a run, so
    ids ``[0, 0, 1, 1, 0]`` are three segments (the second run of 0 attends to nothing
    before it), as the recurrences' resets (``segment_resets``) and RoPE's positions."""
    change = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    first = jnp.zeros((segment_ids.shape[0], 1), jnp.int32)
    return jnp.concatenate([first, jnp.cumsum(change, axis=1, dtype=jnp.int32)], axis=1)


def check_mesh(mesh, axis_name: str, batch_axis: str | tuple[str, ...] | None, t: int):
    """The mesh (the current one when None), checked against the axes and the length."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    for name, axes in [("axis_name", axis_name), ("batch_axis", batch_axis)]:
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            if axis not in mesh.axis_names:
                raise ValueError(f"{name}={axes!r} is not an axis of the mesh {mesh.axis_names}")
    shards = mesh.shape[axis_name]
    if t % shards:
        raise ValueError(
            f"length t={t} must be divisible by the {shards} devices of axis {axis_name!r}"
        )
    return mesh


def parse_decay(decay, heads: int) -> Array | None:
    """A layer's ``decay=`` option as ``[heads]`` float32 decays in (0, 1], or None.

    ``decay``: None, ``"retnet"`` (``gamma_h = 1 - 2^(-5-h)``, Sun et al. 2023), a float,
    or one float per head.
    """
    if decay is None:
        return None
    if isinstance(decay, str):
        if decay != "retnet":
            raise ValueError(f"decay must be None, 'retnet', a float or [heads], got {decay!r}")
        return 1.0 - 2.0 ** (-5.0 - jnp.arange(heads, dtype=jnp.float32))
    try:
        gamma = np.asarray(decay, np.float32)
    except (TypeError, ValueError):
        gamma = None
    if gamma is None or gamma.shape not in ((), (heads,)):
        raise ValueError(
            f"decay must be None, 'retnet', a float or one per head [num_heads={heads}], "
            f"got {decay!r}"
        )
    if not np.all((gamma > 0) & (gamma <= 1)):
        raise ValueError(f"decay must lie in (0, 1], got {decay!r}")
    return jnp.broadcast_to(jnp.asarray(gamma), (heads,))


# ----------------------------------------------------------------------------
# The public functions' options (issue 29): each check names the argument, what it
# must be and what it got, in one line, before anything is traced.
# ----------------------------------------------------------------------------


def describe(value) -> str:
    """``value`` in a few words for a one-line message: an array (or a tracer, or a
    ``ShapeDtypeStruct``) by its dtype and shape, anything else by its ``repr``, on one
    line and at most 80 characters."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic):
        return f"an array {value.dtype}[{', '.join(map(str, value.shape))}]"
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def check_bool(name: str, value) -> None:
    """A Python (or numpy) bool, or a ValueError naming ``name``: a string such as ``'no'``
    would otherwise count as True."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be True or False, got {describe(value)}")


def _is_number(value) -> bool:
    """A real number, or a 0-d array of one (a tracer included); not a bool."""
    if isinstance(value, bool | np.bool_):
        return False
    if isinstance(value, int | float | np.integer | np.floating):
        return True
    dtype = getattr(value, "dtype", None)
    return (
        getattr(value, "shape", None) == ()
        and dtype is not None
        and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    )


def check_number(name: str, value, minimum: float | None = None) -> None:
    """A finite real number (a Python or numpy scalar, or a 0-d array), at least ``minimum``
    when given and concrete, or a ValueError naming ``name``."""
    ok = _is_number(value)
    if ok and is_concrete(value):
        x = float(np.asarray(value))
        ok = np.isfinite(x) and (minimum is None or x >= minimum)
    if not ok:
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"{name} must be a finite number{bound}, got {describe(value)}")


def check_decay_value(decay) -> None:
    """``decay=``: None, or real numbers (a scalar or one per head); its shape and range are
    ``log_decay``'s to check. Refuses bools and strings, which JAX would take or reject
    with a message of its own."""
    if decay is None:
        return
    dtype = getattr(decay, "dtype", None)
    if dtype is None and not isinstance(decay, str | bytes):
        try:
            dtype = np.asarray(decay).dtype
        except (TypeError, ValueError):
            dtype = None
    numeric = dtype is not None and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )
    if not numeric or isinstance(decay, bool | np.bool_):
        raise ValueError(
            f"decay must be None, a number in (0, 1] or one per head [heads], got {describe(decay)}"
        )


def check_same_dtype(*named) -> None:
    """``(name, array)`` pairs of one dtype (q and k meet in every dot product), or a
    ValueError naming them and their dtypes."""
    dtypes = {name: x.dtype for name, x in named}
    if len(set(dtypes.values())) > 1:
        got = " and ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise ValueError(f"{' and '.join(dtypes)} must have the same dtype, got {got}")


def check_features(out, x) -> None:
    """A feature map's output for input ``x [..., d]``: an array ``[..., f]`` with the same
    leading axes, or a ValueError describing what the map returned."""
    shape = getattr(out, "shape", None)
    if shape is None or not hasattr(out, "dtype") or tuple(shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(
            f"feature_map must map [..., d] to an array [..., f], got {describe(out)} for "
            f"inputs {tuple(x.shape)}"
        )


def check_batch_axis(
    mesh, axis_name: str, batch_axis: str | tuple[str, ...] | None, b: int
) -> None:
    """A sequence-parallel call's ``batch_axis``: another axis (or axes: ``("data",
    "fsdp")``) than ``axis_name``, whose devices divide the batch ``b`` (checked before
    ``shard_map`` would refuse it)."""
    if batch_axis is None:
        return
    axes = (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis)
    if axis_name in axes:
        raise ValueError(
            f"batch_axis={batch_axis!r} must differ from axis_name={axis_name!r} (the axis "
            f"that splits the sequence)"
        )
    devices = math.prod(mesh.shape[a] for a in axes)
    if b % devices:
        raise ValueError(
            f"batch b={b} must be divisible by the {devices} devices of batch_axis {batch_axis!r}"
        )
