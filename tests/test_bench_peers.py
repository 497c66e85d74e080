"""experiments.bench.peers: the attention forms a ``(q, k, v)`` peer is timed against."""

import jax.numpy as jnp
import pytest

from experiments.bench import peers


@pytest.mark.parametrize("family", ["causal", "noncausal"])
def test_attention_forms_run_ours_on_the_peers_inputs(family):
    impl = f"experiments.bench.peers:performer_{family}"
    ((name, ours, theirs, args),) = peers.cases(32, [family], impl, "elu", heads=2)
    assert name == family and args[0].shape == (1, 32, 2, 64)
    want = theirs(*args)
    assert jnp.linalg.norm(ours(*args) - want) <= 1e-5 * jnp.linalg.norm(want)


def test_chunk_products_are_each_chunks_writes_and_reads():
    # One head: each chunk's queries times its own K^T V, twice with the in-chunk
    # (Q K^T) V, which (unmasked) equals it: the same products.
    ((name, ours, _, (q, k, v)),) = peers.cases(
        32, ["all_products_c8"], "experiments.bench.peers:performer_causal", heads=1
    )
    assert name == "all_products_c8"
    chunk = lambda x: x.reshape(4, 8, 64)
    want = jnp.einsum("ncd,nde->nce", chunk(q), jnp.einsum("ncd,nce->nde", chunk(k), chunk(v)))
    got = ours(q, k, v).reshape(4, 8, 64)
    assert jnp.linalg.norm(got - 2 * want) <= 1e-5 * jnp.linalg.norm(want)
