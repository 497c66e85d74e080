"""configs/hybrid.py (a Qwen3.5-shaped 3:1 Gated DeltaNet : gated attention hybrid) and the
experiments' layouts: config fields, validation, the sweep shorthand, recall's hybrid kind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import recall, sweep, trainer
from experiments.bench import cli, compile_time
from experiments.configuration import load_config, override
from experiments.tasks import build_task
from experiments.validation import validate


def _config(spec="configs/hybrid.py:small", *overrides):
    config = load_config(spec)
    for assignment in overrides:
        override(config, assignment)
    return config


@pytest.mark.slow
def test_qwen35_shaped_hybrid_builds_trains_a_step_and_generates():
    config = _config("configs/hybrid.py:small", "batch_size=4")
    validate(config)
    model = trainer.build_model(config)
    assert model.layout == ("gated_deltanet",) * 3 + ("softmax",)
    gdn, attention = model.blocks[0].attention, model.blocks[3].attention
    assert (gdn.num_heads, gdn.num_v_heads, gdn.key_dim, gdn.value_dim) == (2, 4, 32, 32)
    assert gdn.conv.size == 4 and gdn.variant == "gated_deltanet"
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (4, 1, 64)
    assert attention.rotary_dim == 16 and attention.rope_theta == 1e7  # partial RoPE 0.25
    assert attention.q_norm.zero_centred and attention.output_gate
    assert model.norm.zero_centred and model.blocks[0].attention_norm.zero_centred
    assert type(model.blocks[0].mlp).__name__ == "SwiGLU"
    assert model.init_state(1, 8)[3].attention.k.shape == (1, 8, 1, 64)  # one KV head

    optimizer = nnx.Optimizer(model, trainer.build_optimizer(config), wrt=nnx.Param)
    batch = build_task(config).batch(0, "train")
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        metrics = trainer.train_step(
            model, optimizer, batch.inputs, batch.labels, batch.key_mask, "lm"
        )
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    out = model.generate(jnp.asarray(batch.inputs[:2, :6]), 4, temperature=0.0)
    assert out.shape == (2, 10) and int(jnp.max(out)) < config.mqar.vocab_size


@pytest.mark.slow
def test_the_mamba_hybrid_config_builds_and_trains_a_step():
    """``configs/hybrid.py:mamba_small``: three Mamba-1 mixers to one softmax layer."""
    config = _config("configs/hybrid.py:mamba_small", "batch_size=2", "seq_len=32")
    validate(config)
    model = trainer.build_model(config)
    assert model.layout == ("mamba",) * 3 + ("softmax",)
    mixer = model.blocks[0].attention
    assert (mixer.inner, mixer.state_dim, mixer.conv.size) == (128, 16, 4)
    optimizer = nnx.Optimizer(model, trainer.build_optimizer(config), wrt=nnx.Param)
    batch = build_task(config).batch(0, "train")
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int and float scalars
        metrics = trainer.train_step(
            model, optimizer, batch.inputs, batch.labels, batch.key_mask, "lm"
        )
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0


def test_hybrid_config_variants_validate_and_the_fields_reach_the_layers():
    for variant in ("", "small", "text", "text_small"):
        validate(_config(f"configs/hybrid.py:{variant}"))
    with pytest.raises(ValueError, match=r"unknown variant 'big' of configs/hybrid.py"):
        load_config("configs/hybrid.py:big")
    config = _config(
        "configs/mqar.py:small",
        "model.attention=gated_deltanet : softmax",
        "model.softmax.sliding_window=5",
        "model.softmax.num_heads=4",
        "model.delta.num_v_heads=4",
        "model.scan_layers=true",
        "model.remat=dots_saveable",
        "model.mlp=swiglu",
        "model.mlp_hidden=24",
    )
    validate(config)
    model = trainer.build_model(config)
    assert model.period == 2 and model.remat == "dots_saveable"
    assert model.blocks[1].attention.sliding_window == 5
    assert model.blocks[1].attention.num_heads == 4 and model.blocks[0].attention.num_v_heads == 4
    assert model.blocks[1].attention.rotary_dim is None  # rope=false: no RoPE options read
    assert model.blocks[0].mlp.up_proj.kernel.shape == (1, 64, 24)  # stacked 1 deep


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.attention=3 gdn : 1 softmax"], r"model.attention must be one of .* or a layout"),
        (["model.softmax.partial_rotary_factor=0"], r"model.softmax.partial_rotary_factor must"),
        (["model.remat=half"], r"model.remat must be one of"),
        (
            ["model.mlp=relu"],
            r"model.mlp must be one of \('gelu', 'swiglu', 'geglu', 'relu2', 'moe', 'none', 'rwkv'\)",
        ),
        (["model.delta.num_heads=3"], r"model.delta.num_heads=3 must divide model.width=64"),
        (["model.softmax.num_heads=3", "model.softmax.head_dim=16"], None),
    ],
)
def test_validation_of_hybrid_fields(overrides, message):
    config = _config("configs/hybrid.py:small", "model.delta.head_dim=0", *overrides)
    if message is None:
        validate(config)
        return
    with pytest.raises(ValueError, match=message):
        validate(config)


def test_sweep_shorthand_takes_a_layout():
    runs = sweep.expand("attention=softmax,3 gated_deltanet : 1 softmax,elu")
    assert runs == [
        ["model.attention=softmax"],
        ["model.attention=3 gated_deltanet : 1 softmax"],
        ["model.attention=linear", "model.feature_map=elu"],
    ]
    assert sweep.run_name(runs[1]) == "3gated_deltanet-1softmax"


def test_recall_has_a_hybrid_kind_whose_state_is_the_mean_over_its_layers():
    config = _config("configs/recall.py:small", "recall.kinds=hybrid", "recall.widths=32")
    (kind, width, _, run), *_ = recall.grid(config)
    assert (kind, width, run.model.attention) == ("hybrid", 32, "gated_deltanet : softmax")
    # One Gated DeltaNet state (1 head, 32 x 32) and one KV cache at the test length 128.
    assert recall.state_floats(run) == (32 * 32 + 2 * 128 * 32) // 2


@pytest.mark.slow
def test_compile_benchmark_times_unrolled_and_scanned_depths(tmp_path):
    suite, args = cli.parse(["compile", "--depths", "2", "--out", str(tmp_path)])
    assert (suite, args.config, args.depths) == ("compile", "configs/hybrid.py:small", "2")
    tiny = ["model.width=16", "model.delta.head_dim=8", "model.delta.value_head_dim=8"]
    tiny += ["model.softmax.head_dim=8", "model.attention=gated_deltanet", "batch_size=2"]
    with jax.numpy_dtype_promotion("standard"):
        rows = compile_time.measure(args.config, [2], tiny)
    assert [(r["depth"], r["scan_layers"], r["layers_in_program"]) for r in rows] == [
        (2, False, 2),
        (2, True, 1),
    ]
    assert all(r["lower_s"] > 0 and r["compile_s"] > 0 for r in rows)
    text = compile_time.write(rows, args.config, tmp_path)
    assert "| 2 | scanned | 1 |" in text and (tmp_path / "compile.csv").exists()
