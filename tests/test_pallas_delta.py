"""The delta rule's Pallas kernel (``method="pallas"``), interpreted on CPU, against the XLA
chunked form: outputs, states, gradients, padding, resets; and its lowering for GPU and TPU."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linattn_jax.layers import DeltaRuleAttention
from linattn_jax.ops import delta
from linattn_jax.ops.delta import pallas
from tests.helpers import assert_close_normwise

B, T, H, HV, D, DV = (
    2,
    40,
    1,
    2,
    16,
    32,
)  # t not a multiple of the chunk; 2 value heads per key head
CHUNK = 16


def _inputs(seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, H, D))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, HV, DV))
    beta = jax.random.uniform(ks[3], (B, T, HV), minval=0.1, maxval=1.0)
    gate = -jax.random.uniform(ks[4], (B, T, HV), maxval=0.5)
    gate = gate.at[0, 21, 1].set(-jnp.inf)  # a full reset inside a chunk
    s0 = 0.3 * jax.random.normal(ks[5], (B, HV, D, DV))
    # Row 1 pads its last 9 tokens with NaN and inf in every input: they must reach nothing.
    key_mask = jnp.ones((B, T), bool).at[1, T - 9 :].set(False)
    pad = key_mask[:, :, None, None]
    q = jnp.where(pad, q, jnp.nan)
    k = jnp.where(pad, k, jnp.inf)
    v = jnp.where(pad, v, -jnp.inf)
    beta = jnp.where(key_mask[:, :, None], beta, jnp.nan)
    gate = jnp.where(key_mask[:, :, None], gate, jnp.inf)
    segment_ids = jnp.zeros((B, T), jnp.int32).at[0, 27:].set(1).at[1, 5:].set(2)
    return q, k, v, beta, gate, s0, key_mask, segment_ids


def _causal(method, q, k, v, beta, gate, s0, key_mask, segment_ids):
    out, state = delta.causal(
        q,
        k,
        v,
        beta,
        gate=gate,
        method=method,
        chunk_size=CHUNK,
        initial_state=delta.State(s0),
        return_state=True,
        key_mask=key_mask,
        segment_ids=segment_ids,
        scale=D**-0.5,
    )
    return out, state.s


def _value_and_grads(method):
    """``((out, final state), gradients of a loss w.r.t. q, k, v, beta, gate, s0)``."""

    def loss(*args):
        out, state = _causal(method, *args)
        real = args[-2][:, :, None, None]
        weight = jnp.linspace(-1.0, 1.0, DV)[None, None, None]
        return jnp.sum(jnp.where(real, out, 0.0) * weight) + jnp.sum(state**2), (out, state)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))


@pytest.fixture(scope="module")
def gated():
    """Gated DeltaNet with an initial state, grouped value heads, a -inf gate, segment
    resets, key-mask padding holding NaN and inf, a length of 2.5 chunks and the value
    columns split over two kernel programs per head: ``(inputs, ((out, state), grads) of
    the kernels, the same of the chunked form)``."""
    x = _inputs()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pallas, "VALUE_BLOCK", DV // 2)  # two value blocks per head
        pallas_run = _value_and_grads("pallas")(*x)
    chunked_run = _value_and_grads("chunked")(*x)
    return x, (pallas_run[0][1], pallas_run[1]), (chunked_run[0][1], chunked_run[1])


def test_gated_forward_matches_chunked(gated):
    x, ((out, state), _), ((ref_out, ref_state), _) = gated
    key_mask = x[-2]
    assert np.all(np.asarray(out)[~np.asarray(key_mask)] == 0.0)  # padding outputs 0
    assert_close_normwise(out, ref_out)
    assert_close_normwise(state, ref_state)


def test_gated_gradients_match_chunked(gated):
    _, (_, grads), (_, ref_grads) = gated
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert_close_normwise(grads, ref_grads)


def test_tpu_kernels_match_chunked(gated):
    # TPU's kernels (a grid over heads and chunks, the state in VMEM scratch), interpreted.
    x, _, ((ref_out, ref_state), ref_grads) = gated
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pallas, "CPU_BACKEND", "interpret-tpu")
        (_, (out, state)), grads = _value_and_grads("pallas")(*x)
    assert_close_normwise((out, state), (ref_out, ref_state))
    assert_close_normwise(grads, ref_grads)


def test_plain_delta_rule_and_a_non_finite_value():
    q, k, v, beta, _, s0, key_mask, segment_ids = _inputs(1)
    v = v.at[0, 30, 1, 3].set(jnp.nan)  # a real token's value: that channel is NaN from there on
    run = jax.jit(lambda m, *x: _causal(m, *x), static_argnums=0)
    args = (q, k, v, beta, None, s0, key_mask, segment_ids)
    out, state = run("pallas", *args)
    ref_out, ref_state = run("chunked", *args)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    assert np.isnan(out[0, 30:, 1, 3]).all() and not np.isnan(out[0, :30]).any()
    finite = ~np.isnan(np.asarray(ref_out))
    assert_close_normwise(np.asarray(out)[finite], np.asarray(ref_out)[finite])
    np.testing.assert_array_equal(np.isnan(state), np.isnan(ref_state))
    assert_close_normwise(state[1], ref_state[1])


def test_unsupported_options_raise():
    q, k, v = jnp.ones((B, T, H, D)), jnp.ones((B, T, H, D)), jnp.ones((B, T, HV, DV))
    beta = jnp.full((B, T, HV), 0.5)
    with pytest.raises(ValueError, match="per key channel"):
        delta.causal(q, k, v, beta, method="pallas", gate=jnp.zeros((B, T, HV, D)))
    with pytest.raises(ValueError, match="chunk_size"):
        delta.causal(q, k, v, beta, method="pallas", chunk_size=24)
    with pytest.raises(ValueError, match="key head width"):
        delta.causal(q[..., :8], k[..., :8], v, beta, method="pallas")


def _target(platform: str):
    """Where a device is needed to lower for ``platform`` without one (JAX 0.11's Triton
    lowering asks for the GPU's kind): an abstract mesh naming one."""
    if platform != "cuda" or not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    explicit = (jax.sharding.AxisType.Explicit,)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), explicit, abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


# JAX 0.11 deprecates Pallas' Triton backend (for Mosaic GPU): it warns when lowering.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_gpu_and_tpu(platform):
    # The kernels lower (Triton on GPU, Mosaic on TPU): the forward; the gradient runs the
    # forward (saving the chunk states) and the backward kernel.
    shapes = [x.shape for x in _inputs()[:6]]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    mask = jax.ShapeDtypeStruct((B, T), jnp.bool_)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
    target = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
    unchecked = [jax.export.DisabledSafetyCheck.custom_call(target)]
    forward, gradient = (lambda *x: _causal("pallas", *x)), _value_and_grads("pallas")
    for f, kernels in ((forward, 1), (gradient, 2)):
        exported = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=unchecked)
        with _target(platform):
            text = exported(*args, mask, ids).mlir_module()
        assert re.findall(r"custom_call @([\w$.]+)", text).count(target) == kernels
        assert ("delta_rule_chunked_bwd" in text) == (kernels == 2)


def test_the_kernel_is_opt_in():
    assert "pallas" in delta.KERNEL_METHODS and "pallas" not in delta.METHODS
    x = jnp.zeros((1, 4, 1, 16))
    with pytest.raises(ValueError, match=r"method must be one of .* or 'pallas', got 'triton'"):
        delta.causal(x, x, x, jnp.ones((1, 4, 1)), method="triton")


def test_a_layer_takes_the_kernel():
    """``DeltaRuleAttention(method="pallas")`` (Gated DeltaNet), against the same layer with
    ``method="chunked"`` (the same parameters): outputs, decoding states and the gradients
    with respect to every parameter, with padding holding NaN and inf (the layer's input
    there, so in q, k, v and the gates)."""

    def make(method):
        return DeltaRuleAttention(32, 2, method=method, chunk_size=CHUNK, rngs=nnx.Rngs(0))

    x = np.random.default_rng(0).normal(size=(2, 24, 32)).astype(np.float32)
    mask = np.ones((2, 24), bool)
    mask[1, 17:] = False
    x[1, 17:19], x[1, 19:] = np.nan, np.inf

    def run(method):
        graphdef, params = nnx.split(make(method))

        def loss(params):
            y, cache = nnx.merge(graphdef, params)(x, key_mask=mask, return_state=True)
            y = jnp.where(mask[..., None], y, 0.0)
            return jnp.sum(y * jnp.linspace(-1, 1, 32)[None, None]), (y, cache)

        grad = jax.grad(loss, has_aux=True)
        kernels = str(jax.make_jaxpr(grad)(params)).count("pallas_call")
        return jax.jit(grad)(params), kernels

    (got, kernels), (want, none) = run("pallas"), run("chunked")
    assert kernels > 0 and none == 0  # pallas_calls in the program
    assert_close_normwise(got, want, 1e-5)
