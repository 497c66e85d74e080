"""Strict numerics for every test: no silent rank or dtype promotion.

The tests are dominated by XLA compiling many small programs, so LLVM's backend
optimisation is turned down for them (XLA's own graph optimisations still run:
fusion, buffer assignment and so the compiled memory the tests read are the
same); a flag the caller already set wins. And every compiled program goes to a
compilation cache on disk that lives for one pytest run: the two xdist workers, the
subprocesses (which inherit the environment) and test files after
``jax.clear_caches()`` then load a program compiled before instead of compiling it
again, which took about a quarter off the suite's CPU time; a cache the caller set
(``JAX_COMPILATION_CACHE_DIR``) is used instead.
"""

import os
import shutil
import tempfile

import pytest

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

# Set by the first process (the xdist controller, before it starts the workers).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="linattn_jax-tests-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

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


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
