"""Where parameters live on a mesh: the layers' logical axis names, the default rules from
them to mesh axes, ``place``, a state's ``NamedSharding`` tree under those rules, and
``constrain``, which pins an activation's batch and length on the current mesh.

The layers name each dimension of their large parameters when they create them (Flax's
``nnx.with_partitioning``: the names sit in the ``Param``'s sharding metadata, so a model
composed of these layers carries them too); nothing is placed until ``place`` maps the
names onto a mesh. The default ``RULES`` give FSDP over ``fsdp`` (every ``embed`` dim)
tensor parallelism over ``tensor`` (heads and the MLP's hidden units) and expert
parallelism over ``expert`` (a mixture's experts; the batch is split over it too)::

    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))
    state = nnx.state(model)
    model_sharded = nnx.merge(nnx.graphdef(model), jax.device_put(state, place(state, mesh)))

A dimension whose size its mesh axes do not divide (a vocabulary of 10 over 4 devices),
and a parameter no layer names, is replicated along it: ``place`` never gives a wrong
answer, only a less split one. Optimizer moments (``nnx.Optimizer``) copy their
parameter's metadata and so are placed like it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The logical axes of the layers' parameters.
EMBED = "embed"  # the model width (the residual stream)
VOCAB = "vocab"  # token embeddings and output logits
HEADS = "heads"  # query (and output) heads times their dimension
KV_HEADS = "kv_heads"  # key and value heads times their dimension (fewer with GQA)
MLP = "mlp"  # an MLP's hidden units
LAYERS = "layers"  # the stacked depth of scanned blocks (``scan_layers``)
EXPERT = "expert"  # a mixture of experts' routed experts (``layers.moe``)
# The logical axes of activations (``constrain``).
BATCH = "batch"
LENGTH = "length"
# The mesh axis of expert parallelism: ``layers.moe.MoE`` splits its experts over it.
EXPERT_AXIS = "expert"

# Logical axis -> mesh axis (or axes, or None: replicated). MaxText's split: FSDP on the
# width, tensor parallelism on heads, the MLP's hidden units and the vocabulary; expert
# parallelism on a mixture's experts, the batch split over its devices too.
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    (EMBED, "fsdp"),
    (VOCAB, "tensor"),
    (HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (MLP, "tensor"),
    (LAYERS, None),
    (EXPERT, EXPERT_AXIS),
    (BATCH, ("data", "fsdp", EXPERT_AXIS)),
    (LENGTH, "sequence"),
)


def with_axes(initializer: Callable, *names: str | None) -> Callable:
    """``initializer`` whose ``Param`` names its dimensions ``names`` (one per dim; None:
    unnamed). Not placed at creation (``eager_sharding=False``): a layer built without a
    mesh is the same as before; ``place`` reads the names."""
    return nnx.with_partitioning(initializer, names, eager_sharding=False)


def kernel(*names: str | None) -> Callable:
    """``nnx.Linear``'s default kernel initializer, its dims named ``names``."""
    return with_axes(nnx.nn.linear.default_kernel_init, *names)


def embedding(*names: str | None) -> Callable:
    """``nnx.Embed``'s default initializer, its dims named ``names``."""
    return with_axes(nnx.nn.linear.default_embed_init, *names)


def _mesh_axes(name, rules: Mapping, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes (those of the mesh, longer than 1) that logical ``name`` maps to (a
    name that is no rule's but a mesh axis maps to itself)."""
    target = rules.get(name, name if name in mesh.shape else None)  # or a mesh axis itself
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    return tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)


def partition_spec(
    names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules=RULES, *, where=""
) -> PartitionSpec:
    """The mesh ``PartitionSpec`` of an array of ``shape`` whose dims are named ``names``.

    A dim whose mesh axes do not divide it, or whose axes an earlier dim took, is
    replicated.

    Raises:
      ValueError: ``names`` and ``shape`` differ in length (a parameter whose dims a
        transform changed without updating its names: pass ``transform_metadata=
        {nnx.PARTITION_NAME: ...}`` to ``nnx.vmap``/``nnx.scan``); ``where`` names it.
    """
    if not names:  # an unnamed array
        return PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(
            f"the parameter {where or ''} has shape {tuple(shape)} but its sharding names "
            f"{tuple(names)} have {len(names)} dims (a stacking transform without "
            f"transform_metadata={{nnx.PARTITION_NAME: ...}}?)"
        )
    rules, taken, spec = dict(rules), set(), []
    for name, size in zip(names, shape, strict=True):
        axes = tuple(a for a in _mesh_axes(name, rules, mesh) if a not in taken)
        devices = 1
        for a in axes:
            devices *= mesh.shape[a]
        if not axes or size % devices:
            spec.append(None)
            continue
        taken.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def place(state, mesh: Mesh, rules=RULES):
    """The ``NamedSharding`` of each array of ``state`` (an ``nnx.State``, or a tuple of
    them) on ``mesh``, from its ``Param``'s names under ``rules`` (``partition_spec``);
    unnamed arrays are replicated. Works on concrete, traced or abstract states
    (``nnx.eval_shape``), so a model can be created already split::

        shardings = place(nnx.state(abstract_model), mesh)

    Args:
      state: the state whose arrays to place.
      mesh: the mesh; axes that ``rules`` name but ``mesh`` lacks are not used.
      rules: (logical name, mesh axis or axes or None) pairs; ``RULES`` by default.
    """
    logical = nnx.get_partition_spec(state)

    def one(path, x, names):
        where = jax.tree_util.keystr(path, simple=True, separator="/")
        return NamedSharding(mesh, partition_spec(names, x.shape, mesh, rules, where=where))

    return jax.tree_util.tree_map_with_path(one, state, logical)


def constrain(x: jax.Array, *names: str | None, rules=RULES) -> jax.Array:
    """``x`` with its dims named ``names`` placed on the current mesh (``jax.set_mesh``)
    under ``rules``, as ``partition_spec`` places parameters; ``x`` as it is without a mesh.

    The models pin their activations' batch and length here: left to itself, the
    partitioner may split them like the FSDP-split embedding table they come from (by
    width), and all-reduce whole activations instead of gathering parameters.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, partition_spec(names, x.shape, mesh, rules))


def shard_bytes(state) -> int:
    """Bytes of ``state``'s arrays held on one device (the most loaded one)."""
    per_device: dict = {}
    for x in jax.tree.leaves(state):
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)
