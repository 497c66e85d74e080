"""Strict numerics for every test: no silent rank or dtype promotion."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
