"""One tiny run of the benchmark code (speed itself is never asserted in tests)."""

import csv

from experiments import benchmark


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


def test_train_steps_time_every_variant(tmp_path):
    benchmark.main(["--train-steps", "--repeats", "1", "--out", str(tmp_path)])
    table = (tmp_path / "train_steps.md").read_text().splitlines()
    assert table[0] == "| configs/mqar.py:small train step | ms | / elu |"
    names = [line.split(" | ")[0].strip("| ") for line in table[2:]]
    assert names == list(benchmark.TRAIN_STEP_VARIANTS)
    assert table[2].endswith("| 1.00x |")
