"""Training mixtures of experts: the router losses in the objective and the logs, gradient
accumulation, and expert parallelism on forced CPU devices equal to one device."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import data, trainer
from linattn_jax.layers import moe
from tests import helpers
from tests.test_experiments import tiny_config

MOE = [
    "seq_len=32",
    "model.depth=2",
    "model.mlp=moe",
    "model.moe.num_experts=4",
    "model.moe.hidden=8",
    "model.moe.first_dense=1",
    "optim.load_balancing_loss=0.01",
    "optim.router_z_loss=0.001",
]


@pytest.fixture(autouse=True)
def _standard_promotion():
    """optax's Adam mixes int and float scalars (as in tests/test_experiments.py)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.slow
def test_the_trainer_logs_the_router_losses_each_step(tmp_path):
    config = tiny_config("configs/mqar.py:small", *MOE, "steps=2", "log_every=1")
    model = trainer.build_model(config)
    assert isinstance(model.blocks[1].mlp, moe.MoE) and not isinstance(model.blocks[0].mlp, moe.MoE)
    trainer.train(config, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for row in train:
        # One MoE layer of 4 experts, 2 per token: the balance loss is 2 when balanced.
        assert 1.5 < row["load_balancing_loss"] < 4 and row["router_z_loss"] > 0, row


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.expert=2"], "model.mlp='moe'"),
        ([*MOE, "model.moe.top_k=5"], "top_k=5"),
        ([*MOE, "model.moe.first_dense=2"], "first_dense=2"),
        ([*MOE, "optim.router_z_loss=-1.0"], "optim.router_z_loss"),
    ],
)
def test_bad_moe_configs_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        trainer.validate(tiny_config("configs/mqar.py:small", *overrides))


@pytest.mark.slow
def test_the_step_adds_the_weighted_losses_and_accumulates_their_mean():
    config = tiny_config("configs/mqar.py:small", *MOE)
    task = trainer.build_task(config)
    batch = task.batch(0, "train")
    inputs, labels, key_mask = (
        jnp.asarray(x) for x in (batch.inputs, batch.labels, batch.key_mask)
    )
    weights = (0.5, 0.25)

    def fresh():
        model = trainer.build_model(config)
        return model, nnx.Optimizer(model, trainer.build_optimizer(config), wrt=nnx.Param)

    # The objective, written here: the mean cross-entropy plus the weighted mean losses.
    model, _ = fresh()

    def objective(model, inputs, labels):
        logits = model(inputs)
        valid = labels != data.IGNORE
        safe = jnp.where(valid, labels, 0)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), safe[..., None], -1)[..., 0]
        losses = moe.collect_losses(model)
        ce = jnp.sum(jnp.where(valid, nll, 0)) / jnp.sum(valid)
        return ce + weights[0] * losses[0] + weights[1] * losses[1], (ce, losses)

    grad = nnx.jit(nnx.value_and_grad(objective, has_aux=True))
    (_, (ce, losses)), grads = grad(model, inputs, labels)
    halves = [grad(model, inputs[i::2], labels[i::2])[0][1] for i in range(2)]
    for accumulate in (1, 2):
        model, optimizer = fresh()
        metrics = trainer.train_step(
            model, optimizer, inputs, labels, key_mask, task.kind, accumulate, weights
        )
        np.testing.assert_allclose(metrics["loss"], ce, rtol=1e-5)
        expected = losses if accumulate == 1 else sum(h[1] for h in halves) / 2
        got = [metrics[f"{name}_loss"] for name in moe.LOSSES]
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        if accumulate == 1:
            np.testing.assert_allclose(metrics["grad_norm"], trainer._global_norm(grads), rtol=1e-5)


_EP_SCRIPT = """
import json, re, sys
import jax
from flax import nnx
from experiments import data, trainer
from linattn_jax import sharding
from tests.test_experiments import tiny_config
from tests.test_moe_training import MOE
from tests.test_sharding import _train_steps

assert jax.device_count() == 4
with jax.numpy_dtype_promotion("standard"):
    config = tiny_config("configs/mqar.py:small", *MOE, "batch_size=8", "mesh.expert=2")
    trainer.validate(config)
    with nnx.logical_axis_rules(sharding.RULES):
        losses, model, optimizer, sharder, task = _train_steps(config)
        gate = model.blocks[1].mlp.gate[...]
        batch = sharder.put_batch(task.batch(0, "train"))
        with jax.set_mesh(sharder.mesh):
            step = trainer.train_step.lower(model, optimizer, *batch, task.kind, 1, (0.01, 0.001))
            hlo = step.compile().as_text()
print(json.dumps({
    "losses": losses,
    "mesh": dict(sharder.mesh.shape),
    "gate": [list(gate.shape), sorted({tuple(s.data.shape) for s in gate.addressable_shards})],
    "ops": {op: len(re.findall(" " + op + r"\\(", hlo))
            for op in ("all-gather", "reduce-scatter")},
}))
"""


@pytest.mark.slow
def test_expert_parallel_training_equals_one_device():
    assert jax.device_count() == 1
    config = tiny_config("configs/mqar.py:small", *MOE, "batch_size=8")
    from tests.test_sharding import _train_steps

    single = _train_steps(config)[0]
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EP_SCRIPT)],
        env=helpers.device_env(4),
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    many = json.loads(out.stdout.strip().splitlines()[-1])
    assert many["mesh"]["expert"] == 2 and many["mesh"]["data"] == 2
    np.testing.assert_allclose(many["losses"], single, rtol=1e-5)
    # Each device holds half of the 4 experts (and of their Adam moments, placed alike).
    assert many["gate"] == [[4, 16, 8], [[2, 16, 8]]]
    # The dispatch's collectives: the tokens gathered over the expert axis, the experts'
    # outputs reduce-scattered back.
    ops = many["ops"]
    assert ops["all-gather"] > 0 and ops["reduce-scatter"] > 0, ops
