"""A mixture of SwiGLU (or squared-ReLU) experts (Shazeer et al. 2017; Switch, DeepSeek-V3,
Qwen3-Next; Nemotron-H's squared ReLU): a router picks ``top_k`` experts per token, the
tokens are sorted by expert and each expert's matmuls run as one grouped matmul over its
contiguous rows (``layers.grouped``: ``jax.lax.ragged_dot`` on GPUs and TPUs; on CPU, whose
``ragged_dot`` computes every expert on every row, each expert's rows in whole tiles):
dropless (every token reaches its ``top_k`` experts, no capacity), and no ``[tokens,
experts, width]`` tensor.

The pure functions (``route``, ``dispatch``, ``grouped_swiglu``, ``grouped_relu2``,
``combine_experts``, ``load_balancing_loss``, ``router_z_loss``) take arrays and return
arrays; ``MoE`` owns the parameters. Tokens are the rows of ``x [n, width]`` (``n = batch *
length``); ``e`` is the number of routed experts, ``k`` the experts per token.

Padding: a token with ``key_mask`` False routes nowhere (no expert row, no share of a
loss) and its output is zero; its input never reaches a matmul (``where``, not a product),
so NaN or inf there changes nothing, forward or backward.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linattn_jax import sharding
from linattn_jax.layers import grouped
from linattn_jax.layers.mlp import ReLU2MLP, SwiGLU
from linattn_jax.ops import checks

SCORES = ("softmax", "sigmoid")
# The experts' MLPs: SwiGLU (gate, up, down) or squared ReLU (up, down; no gate).
ACTIVATIONS = ("swiglu", "relu2")
# The losses a MoE layer records (``MoE.losses``), in this order.
LOSSES = ("load_balancing", "router_z")


class RouterLosses(nnx.Variable):
    """A MoE layer's auxiliary losses from its last full-sequence forward pass: float32
    ``[2]``, ``(load_balancing_loss, router_z_loss)`` (``LOSSES``). Not a ``Param``: the
    optimiser leaves it alone; a training loss reads it (``collect_losses``)."""


class RouterBias(nnx.Variable):
    """The score-correction bias ``[e]`` added to the scores to choose experts, never to
    weight them (DeepSeek-V3's ``e_score_correction_bias``): not a ``Param``, so not
    trained by the gradient (auxiliary-loss-free balancing updates it outside)."""


class Routing(NamedTuple):
    """What ``route`` chose.

    Attributes:
      weights: float32 ``[n, k]``, each chosen expert's weight in the token's output.
      experts: int32 ``[n, k]``, the chosen experts.
      probs: float32 ``[n, e]``, the router's probabilities over all experts (softmax, or
        the sigmoid scores over their sum): the load-balancing loss's ``P``.
    """

    weights: jax.Array
    experts: jax.Array
    probs: jax.Array


# The pure steps below are each one program when called eagerly (the MoE layer's call was
# a hundred), and inlined into a caller's jitted program.
@functools.partial(
    jax.jit,
    static_argnames=(
        "top_k",
        "score",
        "normalize",
        "normalize_eps",
        "scaling",
        "num_groups",
        "top_k_groups",
    ),
)
def route(
    logits: jax.Array,
    top_k: int,
    *,
    score: str = "softmax",
    normalize: bool = False,
    normalize_eps: float = 1e-20,
    scaling: float = 1.0,
    bias: jax.Array | None = None,
    num_groups: int = 1,
    top_k_groups: int = 1,
) -> Routing:
    """The ``top_k`` experts of each token and their weights.

    Scores are ``softmax(logits)`` (Mixtral, Qwen) or ``sigmoid(logits)`` (DeepSeek-V3,
    Kimi, MiniMax). Experts are chosen on ``scores + bias``; with ``num_groups > 1`` the
    experts form that many equal groups, each group scored by the sum of its two best
    choice scores, and only the ``top_k_groups`` best groups are chosen from
    (DeepSeek-V3's ``n_group``/``topk_group``). The weights are the chosen experts' scores
    (without ``bias``), over their sum when ``normalize``, times ``scaling``.

    Args:
      logits: ``[n, e]`` router logits (computed in float32).
      top_k: experts per token, in ``[1, e]``.
      score: ``"softmax"`` or ``"sigmoid"``.
      normalize: the weights over their sum (``norm_topk_prob``).
      normalize_eps: added to that sum (LFM2-MoE's 1e-6; by default 1e-20, which only keeps
        all-zero sigmoid scores, an underflow, from a 0 / 0).
      scaling: the weights times this (``routed_scaling_factor``).
      bias: ``[e]`` added to the scores for the choice only, or None.
      num_groups: groups of experts (1: no grouping); must divide ``e``.
      top_k_groups: groups chosen from, in ``[1, num_groups]``.

    Returns:
      ``Routing`` (float32 weights, int32 experts, float32 probabilities).
    """
    n, e = logits.shape
    logits = logits.astype(_router_dtype(logits.dtype))
    if score == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    choice = scores if bias is None else scores + bias.astype(scores.dtype)[None]
    if num_groups > 1:
        grouped = choice.reshape(n, num_groups, e // num_groups)
        best = jax.lax.top_k(grouped, min(2, e // num_groups))[0]
        _, groups = jax.lax.top_k(jnp.sum(best, axis=-1), top_k_groups)
        kept = jnp.any(
            groups[:, :, None] == jnp.arange(num_groups, dtype=groups.dtype)[None, None], axis=1
        )  # [n, groups]
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(n, e)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + normalize_eps)
    return Routing(weights * scaling, experts.astype(jnp.int32), probs)


class Dispatch(NamedTuple):
    """The ``n * k`` (token, choice) rows sorted by expert, padding last.

    Attributes:
      order: int32 ``[n * k]``: sorted row ``i`` is flat choice ``order[i]`` (token
        ``order[i] // k``).
      inverse: int32 ``[n * k]``: flat choice ``j`` is sorted row ``inverse[j]``.
      group_sizes: int32 ``[e]``: rows per expert, in order; they sum to ``k`` times the
        real tokens (the rows after them are padding, routed nowhere).
    """

    order: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array


def dispatch(experts: jax.Array, valid: jax.Array | None, num_experts: int) -> Dispatch:
    """The sort of ``experts [n, k]`` (int) by expert; tokens with ``valid [n]`` False (and
    experts outside ``[0, num_experts)``: another device's, under expert parallelism) sort
    after every expert's and count in no group."""
    n, k = experts.shape
    flat = experts.reshape(n * k)
    real = (flat >= 0) & (flat < num_experts)
    if valid is not None:
        real = real & jnp.repeat(valid, k)
    key = jnp.where(real, flat, num_experts).astype(
        jnp.int32
    )  # padding: a group past the last expert's
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order).astype(jnp.int32)
    group_sizes = jnp.zeros(num_experts, jnp.int32).at[key].add(1, mode="drop")
    return Dispatch(order, inverse, group_sizes)


def grouped_swiglu(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    group_sizes: jax.Array,
    *,
    method: str = "auto",
) -> jax.Array:
    """Each expert's SwiGLU, ``down_e(silu(x gate_e) * (x up_e))``, on its rows of ``x``.

    Args:
      x: ``[m, width]`` rows sorted by expert (``group_sizes[e]`` rows of expert ``e`` in
        turn; rows past their sum give zeros).
      gate: ``[e, width, hidden]``.
      up: ``[e, width, hidden]``.
      down: ``[e, hidden, width]``.
      group_sizes: int32 ``[e]``.
      method: ``"auto"``, ``"ragged"`` or ``"tiled"`` (``layers.grouped``: ``"auto"`` tiles
        on CPU, where ``ragged_dot`` computes every expert on every row).

    Returns:
      ``[m, width]``.
    """
    swiglu = lambda dot, x: dot(jax.nn.silu(dot(x, gate)) * dot(x, up), down)
    return grouped.apply(swiglu, x, group_sizes, method=method)


def grouped_relu2(
    x: jax.Array, up: jax.Array, down: jax.Array, group_sizes: jax.Array, *, method: str = "auto"
) -> jax.Array:
    """Each expert's squared-ReLU MLP, ``down_e(relu(x up_e)^2)``, on its rows of ``x``
    (``grouped_swiglu``'s rows, shapes and ``method``, no gate)."""
    relu2 = lambda dot, x: dot(jnp.square(jax.nn.relu(dot(x, up))), down)
    return grouped.apply(relu2, x, group_sizes, method=method)


@functools.partial(jax.jit, static_argnames=("method",))
def combine_experts(
    x: jax.Array,
    routing: Routing,
    valid: jax.Array | None,
    gate: jax.Array | None,
    up: jax.Array,
    down: jax.Array,
    *,
    first_expert: int | jax.Array = 0,
    method: str = "auto",
) -> jax.Array:
    """``sum_j weights[:, j] * expert_{experts[:, j]}(x)`` for each token of ``x [n, width]``:
    sorted by expert, ``grouped_swiglu`` (``grouped_relu2`` where ``gate`` is None), and back.

    ``gate``/``up``/``down`` hold experts ``first_expert, ...`` only (expert parallelism: a
    device's share); choices of other experts contribute zero here. ``method``: as in
    ``grouped_swiglu``.

    Returns:
      ``[n, width]`` in ``x``'s dtype; zero for tokens with ``valid`` False.
    """
    n, k = routing.experts.shape
    local = routing.experts - first_expert
    plan = dispatch(local, valid, up.shape[0])
    rows = jnp.take(x, plan.order // k, axis=0)
    if gate is None:
        out = grouped_relu2(rows, up, down, plan.group_sizes, method=method)
    else:
        out = grouped_swiglu(rows, gate, up, down, plan.group_sizes, method=method)
    used = jnp.arange(n * k, dtype=jnp.int32) < jnp.sum(plan.group_sizes, dtype=jnp.int32)
    weights = jnp.take(routing.weights.reshape(n * k), plan.order)
    out = jnp.where(used[:, None], out * weights[:, None].astype(out.dtype), 0)
    out = jnp.take(out, plan.inverse, axis=0).reshape(n, k, out.shape[-1])  # n may be 0
    return out.sum(1).astype(x.dtype)


def _router_dtype(dtype) -> jnp.dtype:
    """float32, or the input's dtype when wider (float64 tests)."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def _count(valid: jax.Array | None, n: int, dtype) -> jax.Array:
    """The real tokens (at least 1) in ``dtype``."""
    return jnp.asarray(max(n, 1) if valid is None else jnp.maximum(jnp.sum(valid), 1), dtype)


@jax.jit
def load_balancing_loss(
    probs: jax.Array, experts: jax.Array, valid: jax.Array | None = None
) -> jax.Array:
    """Switch Transformer's auxiliary loss, ``e * sum_i f_i P_i``: ``f_i`` the share of the
    real tokens that chose expert ``i`` (over ``k`` choices each: the ``f_i`` sum to ``k``),
    ``P_i`` their mean router probability of ``i``. 1 per choice when balanced (``k`` in
    all); only ``P`` carries a gradient.

    Args:
      probs: float32 ``[n, e]`` (``Routing.probs``).
      experts: int ``[n, k]`` (``Routing.experts``).
      valid: bool ``[n]`` (True = real) or None.

    Returns:
      A float32 scalar (0 with no real token).
    """
    n, e = probs.shape
    weight = jnp.ones(n, probs.dtype) if valid is None else valid.astype(probs.dtype)
    chosen = (
        jnp.zeros(e, probs.dtype).at[experts.reshape(-1)].add(jnp.repeat(weight, experts.shape[1]))
    )
    count = _count(valid, n, probs.dtype)
    mean_probs = jnp.sum(jnp.where(weight[:, None] > 0, probs, 0.0), axis=0) / count
    return e * jnp.sum(jax.lax.stop_gradient(chosen / count) * mean_probs)


@jax.jit
def router_z_loss(logits: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: the mean over real tokens of ``logsumexp(logits)^2``.

    Args:
      logits: ``[n, e]`` router logits.
      valid: bool ``[n]`` (True = real) or None.

    Returns:
      A float32 scalar (0 with no real token).
    """
    z = jax.nn.logsumexp(logits.astype(_router_dtype(logits.dtype)), axis=-1)
    z = z * z if valid is None else jnp.where(valid, z * z, 0.0)
    return jnp.sum(z) / _count(valid, logits.shape[0], z.dtype)


def collect_losses(model: nnx.Module) -> jax.Array:
    """The mean over ``model``'s MoE layers of their recorded ``RouterLosses``: float32
    ``[2]`` (``LOSSES``), zeros without MoE layers. Read after a full forward pass in the
    same trace (stacked layers of ``scan_layers`` count one each)."""
    leaves = jax.tree.leaves(nnx.state(model, RouterLosses))
    if not leaves:
        return jnp.zeros(2, jnp.float32)
    total = sum(jnp.sum(x.reshape(-1, 2), axis=0) for x in leaves)
    return total / sum(x.size // 2 for x in leaves)


class MoE(nnx.Module):
    """Routed SwiGLU (or squared-ReLU) experts plus optional shared ones: ``x [..., width]
    -> [..., width]``.

    Args:
      width: model width.
      num_experts: routed experts ``e``.
      top_k: experts per token ``k`` (``num_experts_per_tok``).
      hidden: each routed expert's hidden width (``moe_intermediate_size``).
      score: ``"softmax"`` or ``"sigmoid"`` (``route``).
      normalize: the top-k weights over their sum (``norm_topk_prob``).
      normalize_eps: added to that sum (``route``).
      scaling: the routed output's factor (``routed_scaling_factor``).
      score_bias: a ``RouterBias [e]`` (zeros) for the choice only.
      num_groups: groups of experts for grouped top-k (``n_group``; 1: none).
      top_k_groups: the groups chosen from (``topk_group``).
      shared_hidden: hidden width of one shared SwiGLU every token goes through (0: none;
        DeepSeek's ``n_shared_experts * moe_intermediate_size``); a ``ReLU2MLP`` with
        ``activation="relu2"`` (Nemotron-H's ``moe_shared_expert_intermediate_size``).
      activation: the experts' MLP, ``"swiglu"`` or ``"relu2"`` (``down(relu(x up)^2)``,
        no ``gate``: Nemotron-H's), the shared expert's too.
      latent: the routed experts run in a ``latent``-wide space between ``latent_in``
        ``[width, latent]`` and ``latent_out`` ``[latent, width]`` (no biases; the router
        and the shared expert read ``x``: Nemotron-H's ``moe_latent_size``); 0: none.
      shared_gate: the shared output times ``sigmoid(x w)``, ``w [width, 1]`` (Qwen3-Next's
        ``shared_expert_gate``).
      method: the grouped matmuls' form, ``"auto"``, ``"ragged"`` or ``"tiled"``
        (``grouped_swiglu``; ``"auto"``: tiled on CPU, ``ragged_dot`` elsewhere).
      rngs: as in Flax.
      dtype: the computation dtype (None: the input's); the router runs in float32 whatever
        it is.
      param_dtype: the parameters' dtype, as in Flax.

    Parameters: ``router`` ``[width, e]``; ``gate`` (None for ``"relu2"``), ``up``
    ``[e, width, hidden]`` and
    ``down`` ``[e, hidden, width]``, named ``("expert", "embed", "mlp")`` and
    ``("expert", "mlp", "embed")`` (``linattn_jax.sharding``). Under a mesh with an
    ``expert`` axis of more than one device (``jax.set_mesh``), each device holds
    ``e / devices`` experts and computes their rows of every token of its ``expert``
    group (the tokens all-gathered over the axis, the outputs reduce-scattered back).

    Raises:
      ValueError: a bad size, an unknown ``score`` or ``activation``, or groups that do
        not divide ``e``.
    """

    def __init__(
        self,
        width: int,
        num_experts: int,
        top_k: int,
        hidden: int,
        *,
        score: str = "softmax",
        normalize: bool = False,
        normalize_eps: float = 1e-20,
        scaling: float = 1.0,
        score_bias: bool = False,
        num_groups: int = 1,
        top_k_groups: int = 1,
        shared_hidden: int = 0,
        shared_gate: bool = False,
        activation: str = "swiglu",
        latent: int = 0,
        method: str = "auto",
        rngs: nnx.Rngs,
        dtype=None,
        param_dtype=jnp.float32,
    ):
        checks.check_sizes(width=width, num_experts=num_experts, top_k=top_k, hidden=hidden)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        checks.check_bool("normalize", normalize)
        checks.check_bool("score_bias", score_bias)
        checks.check_bool("shared_gate", shared_gate)
        checks.check_number("scaling", scaling)
        if not (isinstance(normalize_eps, int | float) and 0 < normalize_eps < 1):
            raise ValueError(f"normalize_eps must be a number in (0, 1), got {normalize_eps!r}")
        self.normalize_eps = float(normalize_eps)
        checks.check_sizes(num_groups=num_groups, top_k_groups=top_k_groups)
        if num_experts % num_groups:
            raise ValueError(f"num_groups must divide num_experts={num_experts}, got {num_groups}")
        if top_k_groups > num_groups:
            raise ValueError(f"top_k_groups must be <= num_groups={num_groups}, got {top_k_groups}")
        if top_k > top_k_groups * (num_experts // num_groups):
            raise ValueError(
                f"top_k={top_k} exceeds the experts of top_k_groups={top_k_groups} groups of "
                f"{num_experts // num_groups}"
            )
        checks.check_int("shared_hidden", shared_hidden, 0)
        checks.check_int("latent", latent, 0)
        grouped.resolve(method)  # a bad name fails here, not at the first call
        if shared_gate and not shared_hidden:
            raise ValueError("shared_gate gates the shared expert: give shared_hidden > 0")
        self.num_experts, self.top_k = num_experts, top_k
        self.score, self.normalize, self.scaling = score, normalize, float(scaling)
        self.num_groups, self.top_k_groups = num_groups, top_k_groups
        self.dtype, self.method = dtype, method
        e, em, ml = sharding.EXPERT, sharding.EMBED, sharding.MLP
        self.router = nnx.Param(
            sharding.kernel(em, None)(rngs.params(), (width, num_experts), param_dtype)
        )
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        expert = lambda shape, *names: nnx.Param(
            sharding.with_axes(init, *names)(rngs.params(), shape, param_dtype)
        )
        gated, inner = activation == "swiglu", latent or width
        self.gate = nnx.data(expert((num_experts, inner, hidden), e, em, ml) if gated else None)
        self.up = expert((num_experts, inner, hidden), e, em, ml)
        self.down = expert((num_experts, hidden, inner), e, ml, em)
        linear = lambda n_in, n_out: nnx.Linear(
            n_in, n_out, use_bias=False, kernel_init=sharding.kernel(em, None), dtype=dtype,
            param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.latent_in = nnx.data(linear(width, latent) if latent else None)
        self.latent_out = nnx.data(linear(latent, width) if latent else None)
        self.bias = nnx.data(
            RouterBias(jnp.zeros(num_experts, jnp.float32)) if score_bias else None
        )
        if shared_hidden:
            shared = SwiGLU if gated else ReLU2MLP
            self.shared = nnx.data(
                shared(width, shared_hidden, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
            )
        else:
            self.shared = nnx.data(None)
        self.shared_gate = nnx.data(
            nnx.Linear(
                width,
                1,
                use_bias=False,
                kernel_init=sharding.kernel(em, None),
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )  # fmt: skip
            if shared_gate
            else None
        )
        self.losses = RouterLosses(jnp.zeros(2, jnp.float32))

    def route(self, x: jax.Array) -> tuple[Routing, jax.Array]:
        """``(route(...), the float32 logits [n, e])`` of the tokens ``x [n, width]``."""
        dtype = _router_dtype(x.dtype)
        logits = x.astype(dtype) @ self.router[...].astype(dtype)
        routing = route(
            logits, self.top_k, score=self.score, normalize=self.normalize,
            normalize_eps=self.normalize_eps,
            scaling=self.scaling, bias=None if self.bias is None else self.bias[...],
            num_groups=self.num_groups, top_k_groups=self.top_k_groups,
        )  # fmt: skip
        return routing, logits

    def __call__(
        self, x: jax.Array, *, key_mask: jax.Array | None = None, record: bool = True
    ) -> jax.Array:
        """``x [b, t, width] -> [b, t, width]`` (any leading dims with ``key_mask`` of them).

        ``key_mask`` (True = real): padded tokens route nowhere, add nothing to the losses,
        and give zeros. ``record``: store this call's losses in ``self.losses`` (skipped
        where the layer cannot be updated, as inside a loop over a module it closes over).
        """
        if x.ndim < 1 or x.shape[-1] != self.router.shape[0]:
            raise ValueError(f"x must have shape [..., {self.router.shape[0]}], got {x.shape}")
        lead, width = x.shape[:-1], x.shape[-1]
        dtype = x.dtype if self.dtype is None else self.dtype
        if key_mask is not None and key_mask.shape != lead:
            raise ValueError(f"key_mask must have shape {lead}, got {key_mask.shape}")
        valid = None if key_mask is None else key_mask.reshape(-1)
        flat = x.reshape(-1, width).astype(dtype)
        if valid is not None:
            flat = jnp.where(valid[:, None], flat, jnp.zeros((), dtype))
        routing, logits = self.route(flat)
        if record and getattr(self.losses, "_can_update", True):
            balance = load_balancing_loss(routing.probs, routing.experts, valid)
            z = router_z_loss(logits, valid)
            self.losses[...] = jnp.stack([balance, z]).astype(jnp.float32)
        weights = [
            None if w is None else w[...].astype(dtype) for w in (self.gate, self.up, self.down)
        ]
        inner = flat if self.latent_in is None else self.latent_in(flat)
        out = _experts(inner, routing, valid, *weights, method=self.method)
        if self.latent_out is not None:
            out = self.latent_out(out)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = shared * jax.nn.sigmoid(self.shared_gate(flat))
            out = out + shared
        if valid is not None:
            out = jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))
        return out.reshape(*lead, width)


def _experts(x, routing: Routing, valid, gate, up, down, *, method: str) -> jax.Array:
    """``combine_experts``, its experts split over the current mesh's ``expert`` axis when
    it has more than one device (``jax.shard_map``, manual over that axis only)."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = sharding.EXPERT_AXIS
    devices = 0 if mesh.empty or axis not in mesh.shape else mesh.shape[axis]
    if devices <= 1 or up.shape[0] % devices:
        return combine_experts(x, routing, valid, gate, up, down, method=method)
    P = jax.sharding.PartitionSpec
    split = x.shape[0] % devices == 0  # tokens split over the axis: gather, then scatter back
    rows = P(axis) if split else P()
    valid = jnp.ones(x.shape[0], bool) if valid is None else valid

    experts_weights = (up, down) if gate is None else (gate, up, down)  # no None through

    def local(x, weights, experts, valid, *experts_weights):
        gate, up, down = (None, *experts_weights)[-3:]
        if split:
            gather = lambda a: jax.lax.all_gather(a, axis, tiled=True)
            x, weights, experts, valid = map(gather, (x, weights, experts, valid))
        first = jax.lax.axis_index(axis) * up.shape[0]
        own = Routing(weights, experts, None)
        out = combine_experts(x, own, valid, gate, up, down, first_expert=first, method=method)
        if split:
            return jax.lax.psum_scatter(out, axis, tiled=True)
        return jax.lax.psum(out, axis)

    run = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows,) * 4 + (P(axis),) * len(experts_weights),
        out_specs=rows,
        axis_names={axis},
        check_vma=False,
    )
    return run(x, routing.weights, routing.experts, valid, *experts_weights)
