"""Shared test inputs and the one table of tolerances per dtype."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import linattn_jax as la

# Forward outputs, compared with the float32 reference on the same (rounded) inputs.
# float32: sums are reordered (chunks, scans), so a few ulps of the largest term.
# bfloat16: the output is rounded to 8 bits of mantissa (relative 2^-8 = 4e-3).
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.bfloat16): dict(atol=1e-2, rtol=1e-2),
}
# Gradients accumulate over the sequence twice (forward and reverse), float32 only:
# compared normwise (``assert_close_normwise``), so the bound scales with the gradient's
# size and does not hinge on one element's rounding (which depends on the CPU's vector
# width).
GRAD_RTOL = 1e-5


def assert_close_normwise(actual, expected, rtol: float = GRAD_RTOL) -> None:
    """Each leaf's ``||actual - expected|| <= rtol * ||expected||`` (Frobenius norms; a zero
    ``expected`` needs an exact zero), with shapes equal."""
    jax.tree.map(lambda a, e: _check_normwise(a, e, rtol), actual, expected)


def _check_normwise(a, e, rtol: float) -> None:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape, f"shapes differ: {a.shape} vs {e.shape}"
    error, size = np.linalg.norm(a - e), np.linalg.norm(e)
    assert np.isfinite(error) and error <= rtol * size, (
        f"normwise relative error {error / max(size, 1e-300):.3g} > {rtol:g} "
        f"(|error| {error:.3g}, |expected| {size:.3g}, shape {e.shape})"
    )


def tol(dtype) -> dict:
    return TOLERANCES[jnp.dtype(dtype)]


def qkv(
    seed: int, b: int, t: int, h: int, d: int, dv: int, s: int | None = None, dtype=jnp.float32
):
    """Random q ``[b,t,h,d]``, k ``[b,s,h,d]``, v ``[b,s,h,dv]`` (s defaults to t)."""
    s = t if s is None else s
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, h, dv), jnp.float32).astype(dtype)
    return q, k, v


def random_state(seed: int, b: int, h: int, f: int, dv: int) -> la.LinearAttentionState:
    """A non-trivial state with a positive denominator (as positive feature maps give)."""
    ks, kz = jax.random.split(jax.random.PRNGKey(seed))
    return la.LinearAttentionState(
        s=jax.random.normal(ks, (b, h, f, dv), jnp.float32),
        z=jax.random.uniform(kz, (b, h, f), jnp.float32, 0.5, 2.0),
    )


def key_mask(seed: int, b: int, s: int, p: float = 0.75):
    """Random bool ``[b, s]`` with at least the first key kept."""
    m = jax.random.bernoulli(jax.random.PRNGKey(seed), p, (b, s))
    return m.at[:, 0].set(True)


def gate(seed: int, b: int, t: int, h: int):
    """Log-decay ``[b, t, h]`` in (-inf, 0)."""
    return -jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(seed), (b, t, h)))


def segment_ids(seed: int, b: int, t: int, p: float = 0.15):
    """Non-decreasing int32 ids ``[b, t]``: a new segment starts with probability p."""
    starts = jax.random.bernoulli(jax.random.PRNGKey(seed), p, (b, t))
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def device_env(devices: int) -> dict:
    """This process's environment for a new one whose CPU has ``devices`` devices: the XLA
    flags tests/conftest.py set (compile speed) kept, the device count added."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return os.environ | {"XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}


def pytest_with_devices(devices: int, *args: str) -> str:
    """Runs ``pytest *args`` in a new process whose CPU has ``devices`` devices (one
    process, ``-n 0``: two xdist workers there would each start JAX and compile the shared
    programs again, on the cores the calling run's other worker also uses); asserts it
    passed and returns its stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *args],
        env=device_env(devices),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return result.stdout
