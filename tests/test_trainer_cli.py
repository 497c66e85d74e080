"""The trainer's command lines, plots, TensorBoard events and ``experiments.load``."""

import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import experiments
from experiments import cli, reporting, sweep, train, trainer
from experiments.configuration import flatten, load_config
from tests.test_experiments import TINY, tiny_config

MQAR = "configs/mqar.py:small"


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


# -- command lines -------------------------------------------------------------


@pytest.mark.parametrize("main", [train.main, sweep.main], ids=["train", "sweep"])
def test_one_override_syntax_and_print_config(main, capsys):
    argv = ["--config", MQAR, "--print_config", "--config.model.width=32"]
    assert main([*argv, "--config.optim.lr", "0.01"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^model\.width +\= 32$", out, flags=re.M)
    assert re.search(r"^optim\.lr +\= 0\.01$", out, flags=re.M)
    for field in flatten(load_config(MQAR)):  # every field, with its value
        assert re.search(rf"^{re.escape(field)} += \S", out, flags=re.M), field


@pytest.mark.parametrize(
    "main,flags",
    [
        (
            train.main,
            ["--config", "--workdir", "--print_config", "--verbose", "--multihost"]
            + ["--compilation_cache"],
        ),
        (
            sweep.main,
            ["--config", "--workdir", "--print_config", "--verbose", "--sweep"]
            + ["--compilation_cache"],
        ),
    ],
    ids=["train", "sweep"],
)
def test_help_describes_every_flag(main, flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in flags:  # each flag is followed by its description
        assert re.search(rf"^  {flag}\b.*\n?.*\w{{4}}", out, flags=re.M), flag
    assert "--config.<field>=<value>" in out


def test_a_run_writes_the_compilation_cache_by_default(tmp_path):
    """A run without JAX_COMPILATION_CACHE_DIR and without the flag fills the default
    cache (under XDG_CACHE_HOME); ``--compilation_cache ''`` or the caller's
    ``JAX_ENABLE_COMPILATION_CACHE=false`` turns it off."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env |= {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "JAX_PLATFORMS": "cpu"}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program, however quick
    flags = [f"--config.{field}" for field in TINY + ["steps=1", "eval_every=1"]]
    argv = [sys.executable, "-m", "experiments.train", "--config", MQAR, *flags]
    root = Path(__file__).parents[1]
    subprocess.run([*argv, "--workdir", str(tmp_path / "a")], env=env, cwd=root, check=True)
    cache = tmp_path / "xdg" / "linattn_jax" / "jax"
    assert len(list(cache.iterdir())) >= 2  # the train and eval steps at least
    try:
        assert cli.use_compilation_cache("") is None
        assert not jax.config.jax_enable_compilation_cache
        # Turned off by the caller (JAX_ENABLE_COMPILATION_CACHE=false): the default stays off.
        assert cli.use_compilation_cache() is None
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    # And a run whose caller turned it off writes none.
    env |= {"JAX_ENABLE_COMPILATION_CACHE": "false", "XDG_CACHE_HOME": str(tmp_path / "off")}
    subprocess.run([*argv, "--workdir", str(tmp_path / "b")], env=env, cwd=root, check=True)
    off = tmp_path / "off" / "linattn_jax"
    assert not off.exists() or not [f for f in off.rglob("*") if f.is_file()]


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--config.model.widht=3"],
            r"unknown config field 'model.widht' \(did you mean 'model.width'\?\)",
        ),
        (
            ["--config.optim.learning_rate=3"],
            r"unknown config field 'optim.learning_rate' \(did you mean 'optim.lr'\?\)",
        ),
        (["--config.model.width=abc"], r"model.width must be an integer, got 'abc'"),
        (["--config.optim.grad_clip=-1"], r"optim.grad_clip must be a number > 0, got -1.0"),
        (["--config.model.width"], r"--config.model.width needs a value"),
        (["--lr=3"], r"unrecognised argument '--lr=3'"),
    ],
)
@pytest.mark.parametrize("main", [train.main, sweep.main], ids=["train", "sweep"])
def test_command_line_errors_are_one_line(main, argv, message, tmp_path, capsys):
    assert main(["--config", MQAR, "--workdir", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_a_misspelt_sweep_field_is_one_line(tmp_path, capsys):
    argv = ["--config", MQAR, "--workdir", str(tmp_path), "--sweep", "model.widht=16,32"]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "did you mean 'model.width'" in err


@pytest.mark.parametrize("main", [train.main, sweep.main], ids=["train", "sweep"])
def test_verbose_shows_the_traceback_above_the_one_line(main, tmp_path, capsys):
    argv = ["--config", MQAR, "--workdir", str(tmp_path / "run"), "--config.optim.b2=1.5"]
    assert main([*argv, "--verbose"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):" and len(err) > 3, err
    assert re.fullmatch(r".*: error: optim.b2 must be a number in \[0, 1\), got 1.5", err[-1])


def test_a_misspelt_attention_kind_in_a_sweep_is_named(tmp_path, capsys):
    argv = ["--config", MQAR, "--workdir", str(tmp_path), "--sweep", "attention=gla,deltanett"]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert re.search(
        r"--sweep attention=deltanett is neither an attention kind \(.*\) nor a feature map "
        r"\(.*\) \(did you mean 'deltanet'\?\)$",
        err,
    ), err
    assert "model.feature_map" not in err


def test_a_sweeps_table_shows_the_swept_fields(tmp_path, monkeypatch, capsys):
    def fake_train(config, workdir, **_):
        return {"loss": config.optim.lr, "accuracy": 0.5, "step": config.steps}

    monkeypatch.setattr(trainer, "train", fake_train)
    argv = ["--config", MQAR, "--workdir", str(tmp_path), "--config.steps=3"]
    assert sweep.main([*argv, "--sweep", "optim.lr=0.001,0.003", "--sweep", "model.width=16"]) == 0
    header, rule, *rows = (tmp_path / "results.md").read_text().splitlines()
    assert header.startswith("| optim.lr | task | attention |"), header  # width has its column
    assert rule.count("|") == header.count("|")
    assert [row.split(" | ")[0] for row in rows] == ["| 0.001", "| 0.003"]
    assert all("| 16x2 |" in row for row in rows)


# -- plots ---------------------------------------------------------------------


def _rows(n=3):
    rows = []
    for step in range(1, n + 1):
        rows.append({"step": step, "split": "train", "loss": 4.0 / step, "accuracy": 0.1 * step})
        rows.append({"step": step, "split": "eval", "loss": 4.5 / step, "accuracy": 0.1 * step})
    return rows


def test_curves_name_the_run_and_show_text_in_bits_per_byte():
    import matplotlib.pyplot as plt

    config = tiny_config("configs/text_lm.py:small")
    fig = reporting.curves_figure(_rows(), config)
    title = fig._suptitle.get_text()
    assert all(word in title for word in ("text_lm", "linear", "elu", "width 16")), title
    loss_ax, acc_ax = fig.axes
    assert all(ax.get_legend() is not None for ax in fig.axes)
    assert loss_ax.get_ylabel() == "bits per byte"
    np.testing.assert_allclose(loss_ax.lines[0].get_ydata()[0], 4.0 / math.log(2))
    plt.close(fig)


def test_sweep_plot_has_chance_distinct_markers_and_an_outside_legend():
    import matplotlib.pyplot as plt

    config = tiny_config(MQAR)
    perfect = [dict(r, accuracy=1.0) for r in _rows()]  # two runs at 100%: on top of each other
    fig = reporting.results_figure(
        [("softmax", config, perfect), ("linear_taylor", config, perfect)]
    )
    (ax,) = fig.axes
    chance = [line for line in ax.lines if line.get_label() == "chance"]
    assert len(chance) == 1 and chance[0].get_ydata()[0] == pytest.approx(1 / 32)
    runs = [line for line in ax.lines if line.get_label() != "chance"]
    assert len({(line.get_marker(), line.get_markersize()) for line in runs}) == 2
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # outside the data
    plt.close(fig)


# -- TensorBoard events and load -------------------------------------------------


def _events(workdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the workdir's event files (TFRecord framing), by tag."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in workdir.glob("events.out.tfevents.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.slow
def test_tensorboard_events_and_load_a_trained_text_model(tmp_path):
    config = tiny_config(
        "configs/text_lm.py:small", "seq_len=32", "steps=2", "text.sample_length=4"
    )
    trainer.train(config, tmp_path)
    scalars = _events(tmp_path)
    for tag in ["learning_rate", "grad_norm", "tokens_per_s", "loss", "accuracy"]:
        assert [step for step, _ in scalars[f"train/{tag}"]] == [2], tag
    for tag in ["loss", "accuracy", "bits_per_byte"]:
        assert [step for step, _ in scalars[f"eval/{tag}"]] == [2], tag

    model, loaded = experiments.load(tmp_path)
    assert loaded.model.width == 16 and loaded.task == "text_lm"
    with ocp.CheckpointManager(tmp_path / "checkpoints") as manager:
        saved = manager.restore(2, args=ocp.args.StandardRestore())["model"]
    # The same leaves in the same (sorted-key) order; depth 1 keeps "0" and 0 in step.
    chex.assert_trees_all_equal(
        jax.tree.leaves(nnx.to_pure_dict(nnx.state(model))), jax.tree.leaves(saved)
    )
    text = trainer.sample_text(model, loaded, "def ", 5)
    assert text.startswith("def ") and len(text.encode()) >= 9 - 4


def test_the_event_writer_leaves_torch_unimported(tmp_path):
    """tensorboardX imports torch where it is installed (2.5 s at the start of each run)
    only to take torch tensors: the writer hides a torch not imported yet, and shows it
    again after (a fresh process: this one may hold torch already)."""
    pytest.importorskip("torch")  # without it there is nothing to hide
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from experiments import reporting\n"
        "writer = reporting.summary_writer(Path(sys.argv[1]), 0)\n"
        "writer.add_scalar('train/loss', 1.5, 1)\n"
        "writer.close()\n"
        "assert 'torch' not in sys.modules, 'tensorboardX imported torch'\n"
        "import torch\n"
        "assert torch.ones(2).sum().item() == 2.0\n"
    )
    root = Path(__file__).parents[1]
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, cwd=root)
    assert _events(tmp_path) == {"train/loss": [(1, 1.5)]}


def test_load_refuses_a_folder_that_is_not_a_workdir(tmp_path):
    with pytest.raises(ValueError, match=r"has no config.json: not a training workdir"):
        experiments.load(tmp_path)
