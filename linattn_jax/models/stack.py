"""The models' stack of blocks: one attention kind per layer (a layout), each kind with its
own options, run layer by layer or as a scan over the depth, with optional remat.

Unrolled (default), ``blocks`` is an ``nnx.List`` of ``depth`` ``TransformerBlock``s. With
``scan_layers=True`` the layout's period ``p`` (1 for one kind; 4 for ``"3 gated_deltanet
: 1 softmax"``) sets the scan's step: ``blocks`` holds ``p`` blocks whose parameters are
stacked ``depth / p`` deep (``nnx.split_rngs`` and ``nnx.vmap`` make them, a
``jax.lax.scan`` over their split state runs them), so the program holds ``p`` blocks
whatever the depth. Block ``j`` of the scanned
stack at index ``i`` is layer ``i * p + j`` of the unrolled one. Decoding states follow the
same layout: one per layer, or ``p`` states stacked ``depth / p`` deep.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers import TransformerBlock, moe, registry
from linattn_jax.layers.mlp import mlp_layout
from linattn_jax.layers.ngram import NGramBlock
from linattn_jax.ops import checks

REMAT = ("none", "full", "dots_saveable")
_POLICIES = {"full": None, "dots_saveable": jax.checkpoint_policies.dots_saveable}


def check_options(
    kind_options: Mapping[str, Mapping] | None, remat: str = "none", scan_layers: bool = False
) -> dict[str, dict]:
    """``kind_options`` as a dict per kind, checked with ``remat`` and ``scan_layers``."""
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {REMAT}, got {remat!r}")
    if not isinstance(scan_layers, bool):
        raise ValueError(f"scan_layers must be True or False, got {scan_layers!r}")
    if kind_options is not None and not isinstance(kind_options, Mapping):
        raise ValueError(f"kind_options must be a dict of kind -> options, got {kind_options!r}")
    options = dict(kind_options or {})
    for kind, value in options.items():
        registry.get(kind)
        if not isinstance(value, Mapping):
            raise ValueError(f"kind_options[{kind!r}] must be a dict of options, got {value!r}")
    return {kind: dict(value) for kind, value in options.items()}


def make_blocks(
    depth: int,
    width: int,
    num_heads: int,
    *,
    attention: str | Sequence[str] = "linear",
    kind_options: Mapping[str, Mapping] | None = None,
    scan_layers: bool = False,
    remat: str = "none",
    rngs: nnx.Rngs,
    **kwargs: Any,
) -> tuple[nnx.List, tuple[str, ...], int | None]:
    """``(blocks, the kind of each layer, the scan's period or None unrolled)``.

    ``kwargs`` go to every block; ``kind_options[kind]`` to that kind's blocks over them (a
    ``num_heads`` there overrides the model's for that kind). ``kwargs["mlp"]`` may list
    each layer's MLP kind (``layers.mlp.mlp_layout``); a scan's period then repeats
    both layouts; an ``mlp`` in ``kind_options[kind]`` overrides it for that kind.
    ``kwargs["ngrams"]`` may list, per layer, None or ``layers.ngram.PerLayerNGrams``'
    options: those layers are ``NGramBlock``s (Qwen4-Exp's PLE; unrolled only).

    Raises:
      ValueError: a bad depth, layout (``registry.parse_layout``), ``kind_options`` or
        ``remat``.
    """
    checks.check_int("depth", depth, 1)
    kinds = registry.parse_layout(attention, depth)
    options = check_options(kind_options, remat, scan_layers)
    mlps = mlp_layout(kwargs.pop("mlp", "gelu"), depth)
    ngrams = kwargs.pop("ngrams", None) or (None,) * depth
    if len(ngrams) != depth:
        raise ValueError(f"ngrams must list one dict or None per layer ({depth}), got {ngrams!r}")

    def block(kind: str, mlp: str, rngs: nnx.Rngs, index: int = 0) -> TransformerBlock:
        own = {**kwargs, **options.get(kind, {})}
        if registry.get(kind).takes_layer_index:  # Lightning's decays: its place in the depth
            own.update(layer_index=index, num_layers=depth)
        heads = own.pop("num_heads", num_heads)
        mlp = own.pop("mlp", mlp)  # a kind's own (kind_options: Nemotron-H's mixer-only)
        if ngrams[index] is not None:  # its layer's n-gram embeddings (Qwen4-Exp's PLE)
            own.update(ngrams=ngrams[index])
            return NGramBlock(width, heads, attention=kind, mlp=mlp, rngs=rngs, **own)
        return TransformerBlock(width, heads, attention=kind, mlp=mlp, rngs=rngs, **own)

    if not scan_layers:
        layers = [
            block(kind, mlp, rngs, i) for i, (kind, mlp) in enumerate(zip(kinds, mlps, strict=True))
        ]
        return nnx.List(layers), kinds, None
    fixed = sorted({k for k in kinds if registry.get(k).takes_layer_index})
    if any(n is not None for n in ngrams):
        raise ValueError("scan_layers stacks identical layers, but ngrams differ by layer")
    if fixed:
        raise ValueError(
            f"scan_layers stacks identical layers, but {fixed}'s layers differ by depth "
            "(fixed per-layer decays): use scan_layers=False"
        )
    period = registry.layout_period(list(zip(kinds, mlps, strict=True)))
    stacked = []
    for kind, mlp in zip(kinds[:period], mlps[:period], strict=True):
        make = nnx.vmap(
            functools.partial(block, kind, mlp),
            in_axes=(0,),
            out_axes=0,
            transform_metadata={nnx.PARTITION_NAME: sharding.LAYERS},  # the names gain "layers"
        )
        stacked.append(nnx.split_rngs(splits=depth // period)(make)(rngs))
    return nnx.List(stacked), kinds, period


def stack_layers(unrolled, scanned) -> None:
    """Puts the unrolled stack ``unrolled``'s layers into the scanned stack ``scanned`` of
    the same layout (``p`` blocks): layer ``i * p + j`` at index ``i`` of block ``j``."""
    p = len(scanned)
    for j, block in enumerate(scanned):
        layers = [nnx.state(unrolled[i]) for i in range(j, len(unrolled), p)]
        nnx.update(block, jax.tree.map(lambda *xs: jnp.stack(xs), *layers))


def init_states(blocks, depth: int, period: int | None, batch: int, max_length: int | None):
    """One decoding state per layer (unrolled), or per block of the period, stacked
    ``depth / period`` deep (scanned)."""
    states = [block.init_state(batch, max_length) for block in blocks]
    if period is None:
        return states
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (depth // period, *x.shape)), states)


def run_blocks(
    blocks,
    x: jax.Array,
    *,
    period: int | None,
    remat: str = "none",
    key_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    state: list | None = None,
    return_state: bool = False,
    tokens: jax.Array | None = None,
):
    """``x [b, t, width]`` through every layer: ``x`` (and the new states when
    ``return_state``). ``state``: ``init_states``' layout, or None; ``tokens [b, t]``: for
    the layers that read them (``layers.ngram.NGramBlock``)."""

    def call(block, x, s):
        reads = dict(tokens=tokens) if isinstance(block, NGramBlock) else {}
        if s is None and not return_state:
            return block(x, key_mask=key_mask, segment_ids=segment_ids, **reads), None
        return block(
            x, key_mask=key_mask, segment_ids=segment_ids, state=s, return_state=True, **reads
        )

    if remat != "none":
        # Inside a scan, CSE cannot merge the recomputation away (JAX's advice).
        checkpoint = functools.partial(
            jax.checkpoint, policy=_POLICIES[remat], prevent_cse=period is None
        )
        call = functools.partial(_checkpointed, call, checkpoint)

    def through(blocks, x, states):
        new = []
        for block, s in zip(blocks, states, strict=True):
            x, s = call(block, x, s)
            new.append(s)
        return x, new

    states = [None] * len(blocks) if state is None else list(state)
    run = through if period is None else functools.partial(_scanned, through)
    x, new = run(blocks, x, states)
    return (x, new) if return_state else x


# Not nnx.remat / nnx.scan: they refuse modules made at another trace level, as in
# generate's decoding while_loop, which calls the model it closes over. These run the pure
# function of the modules' state (nnx.split / nnx.merge) and write back the variables that
# are not parameters and that the call changed (dropout's RNG counts, a MoE's router losses),
# never the constants it only read (random projections, a router's bias): those, written
# from inside the decoding loop, would mutate modules made outside it.


def _split(module):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    merged = lambda params, rest: nnx.merge(graphdef, params, rest)
    return merged, params, rest


def _values(state: nnx.State) -> dict:
    """The arrays of ``state`` by path, taken now (a merged module may hold and change its
    very variables)."""
    return {path: v.get_value() for path, v in nnx.to_flat_state(state)}


def _changed(given: dict, merged) -> nnx.State:
    """The non-parameter variables of ``merged`` that its call replaced, ``given`` the
    arrays it was merged from (``_values``): one left alone still holds the very array."""
    after = nnx.to_flat_state(nnx.state(merged, nnx.Not(nnx.Param)))
    return nnx.from_flat_state([(p, v) for p, v in after if v.get_value() is not given.get(p)])


def _write_back(module, changed: nnx.State) -> None:
    """``changed`` into ``module``, but for records that cannot be written at this trace
    level (a MoE's losses inside a decoding loop: unrolled, the MoE skips them there too);
    anything else (dropout's RNG counts there) raises as an unrolled layer does."""
    if not jax.tree.leaves(changed):
        return
    targets = {tuple(p): n for p, n in nnx.iter_graph(module) if isinstance(n, nnx.Variable)}
    keep = [
        (path, v)
        for path, v in nnx.to_flat_state(changed)
        if getattr(targets[tuple(path)], "_can_update", True) or not isinstance(v, moe.RouterLosses)
    ]
    if keep:
        nnx.update(module, nnx.from_flat_state(keep))


def _checkpointed(call, checkpoint, block, x, s):
    """``call(block, x, s)`` under ``checkpoint`` (``jax.checkpoint`` with a policy)."""
    merge, params, rest = _split(block)

    def pure(params, rest, x, s):
        given, merged = _values(rest), merge(params, rest)
        return call(merged, x, s), _changed(given, merged)

    out, changed = checkpoint(pure)(params, rest, x, s)
    _write_back(block, changed)
    return out


def _scanned(through, blocks, x, states):
    """``through`` over the stacked blocks by ``jax.lax.scan``, carrying ``x`` and the
    stacked decoding states: step ``i`` reads its layer's slice of each and writes the new
    one in its place (``dynamic_update_index_in_dim``), so XLA updates the states in place
    rather than stack a copy of each as the scan's output. A block given no state
    (``None``) returns its new one, if any, as the scan's output."""
    merge, params, rest = _split(blocks)
    carried = [s is not None for s in states]
    at = lambda i: lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
    put = lambda i: lambda a, new: jax.lax.dynamic_update_index_in_dim(a, new, i, 0)

    def body(carry, layer):
        i, x, stacked = carry
        params, rest = layer
        given, merged = _values(rest), merge(params, rest)
        read = lambda stacked: [jax.tree.map(at(i), s) for s in stacked]
        # Read through a conditional XLA cannot see through: the slice is made once, so the
        # update below is the stacked state's only other user and runs in place. Read
        # directly, XLA:CPU fuses the slice into each of its consumers and then copies the
        # whole stacked state twice per layer (depth squared per token).
        own = jax.lax.cond(i >= 0, read, read, stacked) if any(carried) else stacked
        x, new = through(merged, x, own)
        stacked = [
            jax.tree.map(put(i), s, n) if c else s
            for s, n, c in zip(stacked, new, carried, strict=True)
        ]
        fresh = [None if c else n for n, c in zip(new, carried, strict=True)]
        return (i + 1, x, stacked), (fresh, _changed(given, merged))

    start = (jnp.int32(0), x, states)
    (_, x, stacked), (fresh, changed) = jax.lax.scan(body, start, (params, rest))
    _write_back(blocks, changed)
    return x, [s if c else f for s, f, c in zip(stacked, fresh, carried, strict=True)]
