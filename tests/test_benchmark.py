"""One tiny run of the benchmark code (speed itself is never asserted in tests)."""

import csv
import json
import re

import pytest

from experiments import benchmark
from experiments.bench import cli, comm, fsdp, train_step


def test_benchmark_smoke(tmp_path):
    benchmark.main(
        ["--lengths", "64", "--chunk-sizes", "16", "--repeats", "1", "--out", str(tmp_path)]
    )
    with open(tmp_path / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    forms = {r["form"] for r in rows}
    assert {
        "noncausal",
        "scan",
        "chunked",
        "softmax",
        "softmax_causal",
        "scan_plain_autodiff",
    } <= forms
    assert all(float(r["fwd_bwd_scratch_mib"]) > 0 for r in rows)
    assert (tmp_path / "results.png").stat().st_size > 0
    assert "non-causal fwd+bwd" in (tmp_path / "results.md").read_text()


TINY_MQAR = """
from configs import mqar

def get_config(arg=None):
    c = mqar.get_config("small")
    c.unlock()
    c.model.depth, c.model.width, c.batch_size, c.seq_len, c.mqar.num_pairs = 1, 16, 4, 16, 4
    return c
"""


def test_train_steps_time_every_variant(tmp_path):
    config = tmp_path / "tiny.py"
    config.write_text(TINY_MQAR)
    benchmark.main(["--train-steps", str(config), "--repeats", "1", "--out", str(tmp_path)])
    table = (tmp_path / "train_steps.md").read_text().splitlines()
    assert table[0] == f"| {config} train step | ms | / elu |"
    names = [line.split(" | ")[0].strip("| ") for line in table[2:]]
    assert names == list(train_step.VARIANTS)
    assert table[2].endswith("| 1.00x |")


@pytest.mark.parametrize(
    "flat, subcommand, fields",
    [
        (
            ["--lengths", "64", "--chunk-sizes", "16", "--repeats", "1", "--forward-only"],
            ["forms", "--lengths", "64", "--chunk-sizes", "16", "--repeats", "1", "--forward-only"],
            ["lengths", "chunk_sizes", "repeats", "softmax_max", "scan_max", "forward_only", "out"],
        ),
        (
            ["--recurrences", "--lengths", "16384,65536", "--scan-max", "16384", "--repeats", "3"],
            ["recurrences", "--lengths", "16384,65536", "--scan-max", "16384", "--repeats", "3"],
            ["lengths", "repeats", "scan_max", "out"],
        ),
        (
            ["--decode", "--decode-batches", "1", "--out", "x"],
            ["decode", "--decode-batches", "1", "--out", "x"],
            ["decode_contexts", "decode_batches", "out"],
        ),
        (["--comm"], ["comm"], ["out"]),
        (["--train-steps", "--repeats", "10"], ["train-step", "--repeats", "10"], ["config"]),
        (["--train-steps", "c.py:v"], ["train-step", "--config", "c.py:v"], ["config", "repeats"]),
    ],
)
def test_a_subcommand_runs_what_the_flat_command_line_runs(flat, subcommand, fields):
    (suite, flat_args), (name, sub_args) = cli.parse(flat), cli.parse(subcommand)
    assert suite == name == subcommand[0]
    assert {f: getattr(flat_args, f) for f in fields} == {f: getattr(sub_args, f) for f in fields}


def test_help_lists_the_suites_and_a_suite_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^    {name}\b", out, flags=re.M) for name in cli.SUITES), out
    with pytest.raises(SystemExit) as exit_:
        benchmark.main(["recurrences", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--scan-max" in out and "--softmax-max" not in out


def test_the_fsdp_table_gives_each_mesh_its_bytes_against_data_parallel():
    row = dict(config="c.py", parameters=1000, optimizer_bytes=8000, ms=5.0)
    rows = [
        row | dict(mesh="data parallel", param_bytes=4000),
        row | dict(mesh="fsdp", param_bytes=500),
    ]
    lines = fsdp.table(rows).splitlines()
    assert lines[2] == "| c.py | 1,000 | data parallel | 4,000 | 8,000 | 1.000 | 5 |"
    assert lines[3] == "| c.py | 1,000 | fsdp | 500 | 8,000 | 0.125 | 5 |"
    assert cli.parse(["fsdp", "--repeats", "2"])[0] == "fsdp"


def test_flags_before_the_subcommand_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["--repeats", "3", "forms"])
    assert exit_.value.code == 2
    assert "the suite comes first" in capsys.readouterr().err


def test_all_gathered_bytes_are_read_from_hlo_text():
    hlo = "\n".join(
        [
            "  %ag = f32[8,2,16,17]{3,2,1,0} all-gather(f32[1,2,16,17]{3,2,1,0} %s), dimensions={0}",
            "  %ag.1 = bf16[4]{0} all-gather(bf16[1]{0} %y), dimensions={0}",
            "  %sum = f32[8,2]{1,0} add(f32[8,2]{1,0} %a, f32[8,2]{1,0} %b)",
        ]
    )
    assert comm.allgather_bytes(hlo) == 4 * 8 * 2 * 16 * 17 + 2 * 4
    expected = comm.communication_bytes(1, 4096, 2, 16, 16, 16, 8)
    assert expected == {
        "linear_state_allgather": 7 * 2 * 16 * 17 * 4,
        "delta_state_allgather": 7 * 2 * 16 * 32 * 4,
        "kv_allgather": 7 * 512 * 2 * 32 * 4,
    }
    assert (
        comm.communication_bytes(1, 4096, 2, 16, 16, 16, 8, decayed=True)["linear_state_allgather"]
        == 7 * 2 * (16 * 17 + 1) * 4
    )


def test_the_moe_benchmark_compares_equal_active_parameters():
    from experiments.bench import moe

    row = moe.measure(16, 32, 1)
    experts = row["moe_params"] - 16 * moe.EXPERTS  # the router apart
    assert experts * moe.TOP_K // moe.EXPERTS == row["dense_params"]  # the active ones
    assert 0 < row["dispatch_share"] and row["moe_ms"] > 0 and row["moe_scratch_mib"] >= 0
    assert moe.table([row]).splitlines()[-1].startswith("| 16 | 32 |")
    suite, args = cli.parse(["moe", "--moe-widths", "16", "--tokens", "32"])
    assert (suite, args.moe_widths, args.tokens) == ("moe", "16", 32)


def test_recurrences_time_the_ssd_beside_the_additive_form():
    from experiments.bench import recurrences

    rows = recurrences.measure([32], 1, 32, names=("ssd",), chunk_sizes=(16,))
    assert [(r["recurrence"], r["method"]) for r in rows] == [
        ("noncausal", ""),
        ("ssd", "chunked C=16"),
        ("ssd", "scan"),
    ]
    assert all(r["fwd_bwd_scratch_mib"] > 0 for r in rows)


PEER = """
import linattn_jax as la

def additive_scan(q, k, v, gate):
    return la.causal_linear_attention(
        q, k, v, gate=gate, method="scan", feature_map="identity", normalize=False
    )
"""


@pytest.mark.slow
def test_the_device_suite_runs_its_smallest_setting_and_keeps_to_its_budget(tmp_path, monkeypatch):
    from experiments.bench import device

    (tmp_path / "device_peer.py").write_text(PEER)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["device", "--smallest", "--families", "additive_decay,moe", "--out", str(tmp_path)]
    benchmark.main([*argv, "--peers", "additive_decay=device_peer:additive_scan"])
    summary = json.loads((tmp_path / "device.json").read_text())
    rows = summary["rows"]
    ours = [r for r in rows if r["method"] == "ours, XLA chunked"]
    assert [(r["family"], r["dtype"], r["t"]) for r in ours] == [("additive_decay", "float32", 64)]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in ours)
    # The peer on our inputs, against our output: the per-token scan, the same maths.
    (peer,) = [r for r in rows if r["method"] == "peer device_peer:additive_scan"]
    assert peer["family"] == "additive_decay" and peer["rel_err"] < 1e-5
    # The MoE's two dispatches compute the same; the dense SwiGLU other maths (no distance).
    moe = {r["method"]: r for r in rows if r["family"] == "moe"}
    assert list(moe) == ["ours, method='auto'", "ours, method='ragged'", device.DENSE]
    assert moe["ours, method='ragged'"]["rel_err"] < 1e-5 and "rel_err" not in moe[device.DENSE]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in moe.values())
    assert any(n.startswith("moe (8 experts") and "forward+backward" in n for n in summary["notes"])
    prefill, decode = rows[-2:]
    assert prefill["method"] == "prefill" and decode["method"] == "greedy decode, 4 steps"
    assert prefill["family"].startswith("Qwen3.5-shaped") and decode["tokens"] == 4
    table = (tmp_path / "device.md").read_text()
    assert "| additive_decay | ours, XLA chunked | float32 | 64 |" in table
    # Only the forms asked for are probed: a Pallas row where accepted, else a note.
    has_row = "| additive_decay | ours, Pallas | float32 | 64 |" in table
    assert has_row if device.accepts_pallas("additive")[0] else "Pallas (additive): absent" in table
    assert "(delta)" not in table
    # Over the budget at once: every case skipped, and said so.
    benchmark.main([*argv[:-2], "--budget-s", "0", "--prefill", "0", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "device.json").read_text())
    assert summary["rows"] == []
    assert any(
        "skipped: additive_decay ours, XLA chunked float32 t=64" in n for n in summary["notes"]
    )
    assert any("the model's decoding" in n for n in summary["notes"])


def test_the_device_suite_gives_each_family_its_inputs_and_refuses_bad_peers():
    import jax
    import jax.numpy as jnp

    from experiments.bench import device

    shape = (1, 2, 4)  # b, h, d
    dtypes = lambda family: [x.dtype for x in device.inputs(family, 8, jnp.bfloat16, shape)]
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert dtypes("ssd") == [bf16, f32, f32, bf16, bf16]  # x, dt, A, B, C
    assert dtypes("mlstm") == [bf16, bf16, bf16, f32, f32]  # q, k, v, i, f
    assert dtypes("gated_deltanet") == [bf16, bf16, bf16, f32, f32]  # q, k, v, beta, gate
    cases, notes = device.methods(["ssd", "mlstm", "moe"], on_gpu=False)
    for family, method, fn in cases:  # each traces on its inputs (nothing compiled)
        if family == "moe":
            fn, args = fn(8, jnp.float32, 1, 4)  # b * t tokens of width d
            assert jax.eval_shape(fn, *args).shape == (8, 4), method
        else:
            out = jax.eval_shape(fn, *device.inputs(family, 8, jnp.float32, shape))
            assert out.shape == (1, 8, 2, 4), family
    assert "ours, Pallas (ssd): absent (method must be one of" in notes[0]
    assert device.parse_peers("ssd=a:f,mlstm=b:g,ssd=c:h") == {
        "ssd": ["a:f", "c:h"],
        "mlstm": ["b:g"],
    }
    for bad in ("moe=a:f", "ssd=a", "nope=a:f"):
        with pytest.raises(ValueError, match="--peers must be FAMILY=MODULE:FUNCTION"):
            device.parse_peers(bad)
    with pytest.raises(ValueError, match=r"--peers names \['ssd'\], not among --families"):
        benchmark.main(["device", "--smallest", "--families", "mlstm", "--peers", "ssd=a:f"])


def test_the_device_suite_probes_the_pallas_method_and_keeps_a_failed_row(monkeypatch):
    from experiments.bench import device

    def absent(method):
        def fn(q, k, v, gate):
            raise ValueError(f"method must be one of ('chunked',), got {method!r}")

        return fn

    monkeypatch.setitem(device.OURS, "additive", absent)
    assert device.accepts_pallas("additive") == (
        False,
        "method must be one of ('chunked',), got 'pallas'",
    )
    monkeypatch.setitem(device.OURS, "additive", lambda method: lambda q, k, v, gate: v)
    assert device.accepts_pallas("additive") == (True, "")
    cases, _ = device.methods(["gla"], on_gpu=False)
    assert [method for _, method, _ in cases][:2] == ["ours, XLA chunked", "ours, Pallas"]
    failed = dict(family="gla", method="ours, Pallas", dtype="float32", t=64, error="E: no")
    assert "| gla | ours, Pallas | float32 | 64 | failed: E: no |" in device.table([failed], "", [])


def test_the_compile_sweep_of_the_qwen3_5_layout_runs_at_its_smallest(tmp_path):
    # One Gated DeltaNet layer, width 32, 8 tokens, no generate: the table and CSV appear.
    benchmark.main(
        ["compile", "--hf", "--depths", "1", "--width", "32", "--prefill", "8"]
        + ["--decode-steps", "0", "--out", str(tmp_path)]
    )
    with open(tmp_path / "compile_hf.csv") as fh:
        (row,) = list(csv.DictReader(fh))
    assert row["depth"] == "1"
    assert float(row["forward_compile_s"]) > 0 and float(row["forward_ms"]) > 0
    assert (row["recurrence"], row["scan_layers"]) == ("chunked", "False")
    assert "generate (0 tokens)" in (tmp_path / "compile_hf.md").read_text()


def test_the_compile_sweep_builds_the_bound_and_the_scanned_model():
    # --recurrence scan: every Gated DeltaNet layer runs its per-token scan; --scan-layers:
    # one stacked block per layer of the period. Both as from_pretrained would build them.
    from flax import nnx

    from experiments.bench import compile_time
    from linattn_jax.layers import DeltaRuleAttention

    model = compile_time.hf_model(4, 32, recurrence="scan", scan_layers=True)
    methods = [n.method for _, n in nnx.iter_graph(model) if isinstance(n, DeltaRuleAttention)]
    assert methods == ["scan"] * 3 and model.period == 4  # scanned over the 3:1 period
    plain = compile_time.hf_model(4, 32)
    methods = [n.method for _, n in nnx.iter_graph(plain) if isinstance(n, DeltaRuleAttention)]
    assert methods == ["chunked"] * 3 and plain.period is None  # unrolled


def test_the_scan_layers_suite_prints_a_row_per_layout(tmp_path, capsys):
    benchmark.main(
        ["scan-layers", "--layouts", "linear,gated_deltanet : softmax", "--depth", "2"]
        + ["--width", "16", "--prefill", "8", "--decode-steps", "2", "--repeats", "1"]
        + ["--out", str(tmp_path)]
    )
    printed = capsys.readouterr().out.strip()
    assert printed.splitlines()[0].startswith("| layout | depth | width | period |")
    rows = [line.split(" | ") for line in printed.splitlines()[2:]]
    assert [(r[0], r[3]) for r in rows] == [("| linear", "1"), ("| gated_deltanet : softmax", "2")]
    assert all(r[6].endswith("x") and r[9].endswith("x |") for r in rows)
    assert (tmp_path / "scan_layers.md").read_text().endswith(printed + "\n")
