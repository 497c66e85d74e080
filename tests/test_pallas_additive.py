"""``causal_linear_attention(..., method="pallas")``: the Pallas kernels (interpreted on
CPU) against the XLA chunked form: outputs, final states and the gradients with respect
to q, k, v, the gate and the initial state, with padding holding NaN and inf, segment
resets, lengths that are no multiple of the chunk; and their lowering for ``cuda``
(Triton) as ``jax.export`` does it, no device needed.

Each case is one jitted program computing both forms' outputs, states and gradients:
interpret mode is slow, so the shapes are tiny and the cases a covering set rather than a
product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import linattn_jax as la
from linattn_jax.layers import LinearAttention
from linattn_jax.ops.additive import KERNEL_METHODS, METHODS, State
from tests.helpers import assert_close_normwise

# 36 tokens: the kernels' chunks of 16 (8 rounded up) leave the third one ragged, and widths
# of 8 are padded to 16.
B, T, H, D = 1, 36, 2, 8
CHUNK = 8


def _inputs(seed: int, *, per_channel: bool, padded: bool):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(3))
    gate_shape = (B, T, H, D) if per_channel else (B, T, H)
    gate = -rng.uniform(0.0, 1.5, size=gate_shape).astype(np.float32)
    mask = np.ones((B, T), bool)
    if padded:  # the row ends in padding holding NaN and inf, in q, k, v and gate
        mask[0, 21:] = False
        for x in (q, k, v):
            x[0, 21:23] = np.nan
            x[0, 23:25] = np.inf
            x[0, 25:] = -np.inf
        gate[0, 21:] = np.nan
    state = State(
        rng.normal(size=(B, H, D, D)).astype(np.float32),
        rng.uniform(0.5, 2.0, size=(B, H, D)).astype(np.float32),
    )
    return q, k, v, gate, mask, state


def _both(options: dict, with_state: bool = True):
    """A jitted ``(q, k, v, gate, state) -> {method: (out, final state, grads)}``; without
    ``with_state`` no initial state goes in and none comes out (final state None)."""

    def run(method, q, k, v, gate, state):
        def loss(q, k, v, gate, state):
            res = la.causal_linear_attention(
                q,
                k,
                v,
                gate=gate,
                initial_state=state if with_state else None,
                return_state=with_state,
                method=method,
                chunk_size=CHUNK,
                **options,
            )
            out, final = res if with_state else (res, None)
            # Weights that differ per token and channel, so that no gradient is a plain sum.
            w = jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))
            if final is None:
                return jnp.sum(w * out), (out, final)
            total = jnp.sum(w * out) + jnp.sum(jnp.sin(final.s))
            if final.z is not None:
                total = total + jnp.sum(jnp.cos(final.z))
            return total, (out, final)

        grads, (out, final) = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
            q, k, v, gate, state
        )
        return out, final, grads

    return jax.jit(lambda *xs: {m: run(m, *xs) for m in ("chunked", "pallas")})


def _close(got, want, name: str, tol: float = 2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, name
    assert np.all(np.isfinite(got)), f"{name}: not finite"
    scale = max(np.linalg.norm(want), 1.0)
    assert np.linalg.norm(got - want) <= tol * scale, (name, np.linalg.norm(got - want), scale)


def _check(res, with_state: bool = True):
    (out_c, fin_c, grads_c), (out_p, fin_p, grads_p) = res["chunked"], res["pallas"]
    _close(out_p, out_c, "out")
    if with_state:
        _close(fin_p.s, fin_c.s, "final S")
        if fin_c.z is not None:
            _close(fin_p.z, fin_c.z, "final Z")
    names = ("dq", "dk", "dv", "dgate", "dstate")
    for name, gp, gc in zip(names, grads_p, grads_c, strict=True):
        leaves_p, leaves_c = jax.tree.leaves(gp), jax.tree.leaves(gc)
        assert len(leaves_p) == len(leaves_c), name
        for x, y in zip(leaves_p, leaves_c, strict=True):
            _close(x, y, name)


# One case per concern, together covering per-head and per-channel gates, normalised and
# not, padding with NaN and inf, segment resets, an initial state and a ragged length.
CASES = {
    "head_gate_normalised_padded_segments": (
        dict(per_channel=False, padded=True),
        dict(feature_map="elu", segments=True),
    ),
    "channel_gate_unnormalised_padded": (
        dict(per_channel=True, padded=True),
        dict(feature_map="identity", normalize=False),
    ),
    "channel_gate_normalised_segments": (
        dict(per_channel=True, padded=False),
        dict(feature_map="elu", segments=True),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pallas_matches_chunked(case):
    input_options, options = CASES[case]
    q, k, v, gate, mask, state = _inputs(len(case), **input_options)
    options = dict(options)
    if options.pop("segments", False):
        options["segment_ids"] = jnp.asarray(np.repeat([[0] * 5 + [1] * 14 + [2] * 17], B, 0))
    if input_options["padded"]:
        options["key_mask"] = jnp.asarray(mask)
    res = _both(options)(q, k, v, gate, state)
    _check(res)


def test_pallas_without_state_or_gate():
    """No gate, no state in or out, no denominator: kernels without decays, resets or Z."""
    q, k, v, _, _, state = _inputs(3, per_channel=False, padded=False)
    options = dict(feature_map="identity", normalize=False)
    _check(_both(options, with_state=False)(q, k, v, None, state), False)


def test_pallas_is_opt_in():
    assert "pallas" in KERNEL_METHODS and "pallas" not in METHODS
    x = jnp.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match=r"method must be one of .* or 'pallas', got 'triton'"):
        la.causal_linear_attention(x, x, x, method="triton")


# jax 0.11 deprecates Pallas' Triton backend (a warning when a kernel is lowered).
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("per_channel", [False, True])
def test_pallas_lowers_for_cuda(per_channel):
    """Forward and gradient lower for ``cuda`` (Triton kernels): widths and a length that are
    no power of two (padded to one for Triton's products)."""
    x = jax.ShapeDtypeStruct((1, 40, 1, 12), jnp.float32)
    gate = jax.ShapeDtypeStruct((1, 40, 1, 12) if per_channel else (1, 40, 1), jnp.float32)
    fwd = lambda q, k, v, g: la.causal_linear_attention(
        q, k, v, gate=g, method="pallas", chunk_size=16
    )
    grad = jax.grad(lambda *xs: jnp.sum(fwd(*xs)), argnums=(0, 1, 2, 3))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    # jax 0.11 reads the target GPU's compute capability from the (abstract) device.
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=auto, abstract_device=gpu)
    for fn, kernels in ((fwd, 1), (grad, 2)):
        with jax.sharding.use_abstract_mesh(mesh):
            exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])(
                x, x, x, gate
            )
        text = exported.mlir_module()
        assert text.count("__gpu$xla.gpu.triton") == kernels


@pytest.mark.parametrize("per_channel", [False, True])
def test_pallas_lowers_for_tpu(per_channel):
    """Forward and gradient lower for ``tpu`` (Mosaic TPU kernels). Mosaic compiles them
    further only on a TPU, which this does not reach."""
    x = jax.ShapeDtypeStruct((1, 32, 1, 16), jnp.float32)
    gate = jax.ShapeDtypeStruct((1, 32, 1, 16) if per_channel else (1, 32, 1), jnp.float32)
    fwd = lambda q, k, v, g: la.causal_linear_attention(
        q, k, v, gate=g, method="pallas", chunk_size=16
    )
    grad = jax.grad(lambda *xs: jnp.sum(fwd(*xs)), argnums=(0, 1, 2, 3))
    for fn, kernels in ((fwd, 1), (grad, 2)):
        text = jax.export.export(jax.jit(fn), platforms=["tpu"])(x, x, x, gate).mlir_module()
        assert text.count("custom_call @tpu_custom_call") == kernels


@pytest.mark.parametrize("gate", [True, "channel"])
def test_a_layer_takes_the_kernel(gate):
    """``LinearAttention(method="pallas")``: the kernel behind the layer, against the same
    layer with ``method="chunked"`` (the same parameters): outputs, decoding states and
    the gradients with respect to every parameter, with padding holding NaN and inf (the
    layer's input there, so in q, k and v)."""

    def make(method):
        return LinearAttention(16, 2, gate=gate, method=method, chunk_size=CHUNK, rngs=nnx.Rngs(0))

    x = np.random.default_rng(0).normal(size=(2, 20, 16)).astype(np.float32)
    mask = np.ones((2, 20), bool)
    mask[1, 13:] = False
    x[1, 13:15], x[1, 15:] = np.nan, np.inf

    def run(method):
        graphdef, params = nnx.split(make(method))

        def loss(params):
            y, cache = nnx.merge(graphdef, params)(x, key_mask=mask, return_state=True)
            y = jnp.where(mask[..., None], y, 0.0)
            return jnp.sum(y * jnp.linspace(-1, 1, 16)[None, None]), (y, cache.state)

        grad = jax.grad(loss, has_aux=True)
        kernels = str(jax.make_jaxpr(grad)(params)).count("pallas_call")
        return jax.jit(grad)(params), kernels

    (got, kernels), (want, none) = run("pallas"), run("chunked")
    assert kernels > 0 and none == 0  # pallas_calls in the program
    assert_close_normwise(got, want, 1e-5)
