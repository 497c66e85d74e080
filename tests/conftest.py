"""Strict numerics for every test: no silent rank or dtype promotion.

The tests are dominated by XLA compiling many small programs, so XLA:CPU's code
generation is set for compile speed (``COMPILE_FLAGS``): LLVM's backend optimisation
turned down, the elemental IR emitters (XLA:CPU's code generator before its MLIR
fusion emitters) and LLVM's module compiled in one piece (the two xdist workers
already use both cores). XLA's own graph optimisations still run on the same HLO
(fusion, buffer assignment, the SPMD partitioner's collectives; the compiled scratch
memory the tests bound differs by well under a percent), and the numbers are computed
in IEEE float as before (no fast math); the flags cut a compile's CPU time by about
two thirds. A flag the
caller already set wins. And every compiled program goes to a
compilation cache on disk that lives for one pytest run: the two xdist workers, the
subprocesses (which inherit the environment) and test files after
``jax.clear_caches()`` then load a program compiled before instead of compiling it
again, which took about a quarter off the suite's CPU time; a cache the caller set
(``JAX_COMPILATION_CACHE_DIR``) is used instead. JAX writes an entry in place (without a
size limit, so without its file lock): the other worker, compiling the same program at the
same moment, can read it half written, warn and compile it itself (pyproject.toml's
filterwarnings shows that warning rather than failing on it).
"""

import gc
import importlib.metadata
import os
import shutil
import tempfile

import pytest

COMPILE_FLAGS = {"xla_backend_optimization_level": "0"}
# XLA aborts at start on a flag it does not know, and XLA:CPU's emitter flags come and go:
# these two only on the jaxlib they were measured with (0.10; jaxlib 0.11 and 0.12 no longer
# have xla_cpu_use_fusion_emitters, their CPU code generator is the fusion emitters').
if importlib.metadata.version("jaxlib").startswith("0.10."):
    COMPILE_FLAGS |= {
        "xla_cpu_use_fusion_emitters": "false",
        "xla_cpu_parallel_codegen_split_count": "1",
    }
for _flag, _value in COMPILE_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()

# Set by the first process (the xdist controller, before it starts the workers).
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="linattn_jax-tests-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Python's cyclic garbage collector runs a full collection every few tens of thousands of
# allocations, and tracing and lowering allocate millions (jaxprs, MLIR operations) beside
# the hundreds of thousands of objects torch and transformers hold once imported: at the
# default thresholds (700, 10, 10) it took about 7% of a test process's time, at these about
# 1.5% (the same tests, the same objects freed, only fewer passes over them).
gc.set_threshold(10_000, 50, 100)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops each test file's compiled programs when it ends. Every XLA:CPU executable
    holds a few memory maps of LLVM's; a worker that compiles thousands of programs
    otherwise nears the kernel's limit (``vm.max_map_count``, 65,530) and dies inside
    LLVM ("Unable to allocate section memory") or with a segfault."""
    yield
    jax.clear_caches()


# The files whose tests are minutes of CPU in one test (processes of their own, on forced
# devices) run first: xdist's other worker then runs the many short tests beside them,
# rather than waiting idle at the end of the run for one of them to finish.
FIRST = ("test_sequence_parallel.py", "test_multihost.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: otherwise unchanged


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
