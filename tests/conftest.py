"""Strict numerics for every test: no silent rank or dtype promotion.

The tests are dominated by XLA compiling many small programs, so LLVM's backend
optimisation is turned down for them (XLA's own graph optimisations still run:
fusion, buffer assignment and so the compiled memory the tests read are the
same); a flag the caller already set wins.
"""

import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
