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
