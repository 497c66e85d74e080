"""Strict numerics for every test: no silent rank or dtype promotion.

The tests are dominated by XLA compiling many small programs, so LLVM's backend
optimisation is turned down for them (XLA's own graph optimisations still run:
fusion, buffer assignment and so the compiled memory the tests read are the
same); a flag the caller already set wins.
"""

import os

import pytest

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops each test file's compiled programs when it ends. Every XLA:CPU executable
    holds a few memory maps of LLVM's; a worker that compiles thousands of programs
    otherwise nears the kernel's limit (``vm.max_map_count``, 65,530) and dies inside
    LLVM ("Unable to allocate section memory") or with a segfault."""
    yield
    jax.clear_caches()
