"""The training loop: gradient accumulation over micro-batches, metrics read back once per
logging interval, and the plain progress lines of a run off a terminal."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments import data, trainer
from tests.helpers import assert_close_normwise
from tests.test_experiments import tiny_config

MQAR = "configs/mqar.py:small"


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        yield


def _one_step(config, batch, accumulate, tx):
    """The parameters after one step of ``tx`` on ``batch``, and the step's metrics."""
    model = trainer.build_model(config)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    metrics = trainer.train_step(model, optimizer, *batch, "lm", accumulate)
    return nnx.state(model, nnx.Param), jax.device_get(metrics)


def test_accumulated_micro_batches_make_the_whole_batchs_step():
    # No warmup: the first step's learning rate is not 0.
    config = tiny_config(MQAR, "seq_len=32", "batch_size=8", "optim.warmup_steps=0")
    batch = trainer.build_task(config).batch(0, "train")
    labels = np.array(batch.labels)
    labels[0] = labels[1] = data.IGNORE  # micro-batches with 8, 8, 14 and 16 targets
    labels[2, :20] = data.IGNORE
    batch = tuple(map(jnp.asarray, (batch.inputs, labels, batch.key_mask)))
    initial = nnx.state(trainer.build_model(config), nnx.Param)

    # The trainer's AdamW, and plain gradient descent (its update is the gradient).
    for tx in (trainer.build_optimizer(config), optax.sgd(1.0)):
        whole, expected = _one_step(config, batch, 1, tx)
        accumulated, got = _one_step(config, batch, 4, tx)
        assert_close_normwise(accumulated, whole, rtol=1e-6)
        for key in ("loss", "accuracy", "grad_norm"):
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-6)
        moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), whole, initial)
        assert max(jax.tree.leaves(moved)) > 1e-3  # the step did move the parameters

    # Unequal targets per micro-batch: the mean of their means is another loss (by far more
    # than the tolerance above).
    model = trainer.build_model(config)
    micro = [trainer._micro_batches(x, 4) for x in batch]
    loss = nnx.jit(lambda model, *batch: trainer.loss_and_metrics(model, *batch, "lm")[0])
    means = [float(loss(model, *(x[i] for x in micro))) for i in range(4)]
    whole_loss = float(loss(model, *batch))
    assert abs(np.mean(means) - whole_loss) > 1e-3 * whole_loss


def test_accumulate_is_checked_against_the_batch(tmp_path):
    cases = [
        ("optim.accumulate=0", r"optim.accumulate must be an integer >= 1, got 0"),
        (
            "optim.accumulate=3",
            r"batch_size=4 must be divisible by optim.accumulate=3 x the 1 devices of the data",
        ),
    ]
    for assignment, message in cases:
        with pytest.raises(ValueError, match=message):
            trainer.train(tiny_config(MQAR, assignment), tmp_path)
    assert not (tmp_path / "config.json").exists()


# A progress line, elapsed as reporting.elapsed writes it.
LINE = (
    r"step {step}/{end} \| loss \d+\.\d{{4}} \| lr \S+ \| grad_norm \S+ \| tokens/s \d+ \| "
    r"elapsed (?:\d+m\d{{2}}|\d+)s"
)


def test_off_a_terminal_a_run_prints_its_intervals_and_resumes(tmp_path, capsys, monkeypatch):
    fetched = []  # the steps each read-back of the loop's metrics held
    device_get = jax.device_get

    def recording(tree):
        if isinstance(tree, list) and tree and "grad_norm" in tree[0]:
            fetched.append(len(tree))
        return device_get(tree)

    monkeypatch.setattr(jax, "device_get", recording)
    config = lambda *extra: tiny_config(
        MQAR,
        "seq_len=32",
        "steps=30",
        "log_every=10",
        "eval_every=30",
        "checkpoint_every=10",
        "progress=true",
        "optim.accumulate=2",
        *extra,
    )
    trainer.train(config("stop_at=20"), tmp_path)
    out = capsys.readouterr()
    saved = f"saved checkpoint {{}} in {re.escape(str(tmp_path / 'checkpoints'))}"
    expected = [LINE.format(step=10, end=20), saved.format(10)]
    expected += [LINE.format(step=20, end=20), saved.format(20)]
    for line, pattern in zip(out.out.splitlines(), expected, strict=True):
        assert re.fullmatch(pattern, line), out.out
    assert fetched == [10, 10]  # once per interval, not per step

    trainer.train(config(), tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"resuming from step 20 of {tmp_path}"
    assert re.fullmatch(LINE.format(step=30, end=30), lines[1]), lines
    assert lines[2:] == [f"saved checkpoint 30 in {tmp_path / 'checkpoints'}"]

    trainer.train(config("progress=false", "steps=40", "stop_at=31"), tmp_path)
    assert capsys.readouterr().out == ""  # progress=false: nothing
