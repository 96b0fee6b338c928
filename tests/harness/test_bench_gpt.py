"""benchmarks/bench_gpt.py (training speed of the example GPT by backend) and
benchmarks/bench_dispatch.py (operations dispatched per call), end to end at tiny sizes on the CPU."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from common import load_script, one_thread  # noqa: F401  (one_thread: a fixture)

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("dense", "auto", "native", "sdpa")


@pytest.fixture(scope="module")
def bench_gpt():
    return load_script(ROOT / "benchmarks" / "bench_gpt.py")


@pytest.fixture(scope="module")
def bench_dispatch():
    return load_script(ROOT / "benchmarks" / "bench_dispatch.py")


def test_dry_run_writes_a_row_per_backend_and_compile_setting(bench_gpt, tmp_path, capsys):
    """Every backend, compiled and not, trains and is reported (tok/s, MFU, the ratio to dense),
    in the printed table, the markdown and the CSV, with the device, torch version and commit.
    Compiled with the ``eager`` backend here (Dynamo only), to keep the test short."""
    import torch

    argv = ["--dry-run", "--out", str(tmp_path), "--tag", "t", "--compile-backend", "eager"]
    assert bench_gpt.main(argv) == 0
    printed = capsys.readouterr().out
    md = (tmp_path / "t.md").read_text()
    with open(tmp_path / "t.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["backend"], r["compiled"]) for r in rows] == [
        (b, c) for c in ("False", "True") for b in BACKENDS
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["block"] == "256" and r["segments"] == "64,128,256" and r["rates"] == "1,2,4"
        assert float(r["tokens_per_s"]) > 0 and float(r["mfu"]) > 0
        assert r["torch"] == torch.__version__ and r["commit"]
        assert f"| 256 | {r['backend']} |" in md and f"| 256 | {r['backend']} |" in printed
    assert all(float(r["vs_dense"]) == 1.0 for r in rows if r["backend"] == "dense")
    assert f"torch {torch.__version__}" in md and "commit " in md and "- device: " in md
    assert md.count("| ok |") == 8


def test_a_failing_configuration_is_a_row_that_says_why(bench_gpt, tmp_path, monkeypatch):
    """One configuration raising (as out of memory would) leaves a row with the reason; the rest run."""
    real = bench_gpt.measure

    def measure(args, device, dtype, row, peak):
        if row.backend == "sdpa":
            raise RuntimeError("no room\nmore detail")
        real(args, device, dtype, row, peak)

    monkeypatch.setattr(bench_gpt, "measure", measure)
    argv = ["--dry-run", "--out", str(tmp_path), "--tag", "f", "--compile", "off", "--backends", "dense,sdpa"]
    assert bench_gpt.main(argv) == 0
    with open(tmp_path / "f.csv", newline="") as f:
        rows = {r["backend"]: r for r in csv.DictReader(f)}
    assert rows["dense"]["status"] == "ok"
    assert rows["sdpa"]["status"] == "failed: RuntimeError: no room"
    assert "| failed: RuntimeError: no room |" in (tmp_path / "f.md").read_text()


def test_a_spent_budget_leaves_rows_that_say_so(bench_gpt, tmp_path, monkeypatch):
    """With --budget, no configuration starts once the time is spent: a row each says so (a device
    command has a time limit; what did not run must not vanish from the table)."""
    clock = iter(float(t) for t in range(0, 1000, 10))  # every reading 10 s after the last
    monkeypatch.setattr(bench_gpt.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(bench_gpt, "measure", lambda args, device, dtype, row, peak: None)
    monkeypatch.setattr(bench_gpt, "peak_flops", lambda device, dtype, given: (1e12, "given"))
    argv = [
        "--dry-run",
        "--out",
        str(tmp_path),
        "--tag",
        "b",
        "--compile",
        "off",
        "--backends",
        "dense,sdpa,manual",
    ]
    assert bench_gpt.main([*argv, "--budget", "15"]) == 0
    with open(tmp_path / "b.csv", newline="") as f:
        status = {r["backend"]: r["status"] for r in csv.DictReader(f)}
    assert status["dense"] == "ok"  # started at 10 s
    assert status["sdpa"].startswith("not run: the budget of 15 s was spent (20 s)")
    assert status["manual"].startswith("not run: the budget of 15 s was spent")


def test_profile_writes_the_top_operations_and_the_call_counts(bench_gpt, tmp_path):
    assert bench_gpt.main(["--dry-run", "--out", str(tmp_path), "--profile", "native:16k"]) == 0
    (path,) = tmp_path.glob("gpt-profile-native-256-eager-*.txt")
    text = path.read_text()
    assert "by self_cpu_time_total" in text and "aten::" in text
    aten = int(text.split("ATen calls (aten::*, nested ones included): ")[1].split()[0])
    assert aten > 0


def test_dry_run_stays_out_of_the_results_folder(bench_gpt):
    args = bench_gpt.parse_args(["--dry-run"])
    assert args.device == "cpu" and args.blocks == [256] and args.compile_backend == "aot_eager"
    assert bench_gpt.parse_args([]).compile_backend == "inductor"


def test_a_bad_argument_is_a_usage_error_on_the_command_line():
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpt.py"), "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "bench_gpt.py: error: argument --steps: every value must be >= 1, got '0'"
    )


def test_dispatch_counts_forward_and_backward(bench_dispatch, tmp_path, capsys):
    """native and sdpa at a tiny size: both passes dispatch something; the table is printed and
    written with --out."""
    out = tmp_path / "dispatch.md"
    argv = "--n 256 --heads 2 --dim 8 --segments 32,64,128,256 --rates 1,2,4,8 --backends native,sdpa"
    args = bench_dispatch.parse_args(argv.split())
    rows = {r["backend"]: r for r in bench_dispatch.count_backends(args)}
    for name in ("native", "sdpa"):
        assert not rows[name]["error"], rows[name]
        assert rows[name]["forward"] > 0 and rows[name]["backward"] > 0, rows[name]
    assert bench_dispatch.main([*argv.split(), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("native", "sdpa"):
        r = rows[name]
        line = (
            f"| {name} | {r['ran_as']} | {r['forward']} | {r['backward']} | {r['forward'] + r['backward']} |"
        )
        assert line in printed and line in out.read_text()


def test_dispatch_counter_counts_each_call(bench_dispatch):
    import torch

    x = torch.ones(3)
    with bench_dispatch.DispatchCounter() as c:
        (x + 1).mul(2).sum()
    assert c.counts == {"aten.add": 1, "aten.mul": 1, "aten.sum": 1} and c.total == 3


def test_a_variant_trains_its_backend_under_its_environment(bench_gpt, tmp_path, monkeypatch):
    """``native-sm90`` is a row of its own that trains ``native`` with DILATED_ATTENTION_CUDA_SM90=1
    set for that row only (restored after it, also when it fails)."""
    import os

    monkeypatch.delenv("DILATED_ATTENTION_CUDA_SM90", raising=False)
    seen = []
    real = bench_gpt.build

    def build(args, device, dtype, conf, compiled):
        seen.append((conf.attention_backend, os.environ.get("DILATED_ATTENTION_CUDA_SM90")))
        return real(args, device, dtype, conf, compiled)

    monkeypatch.setattr(bench_gpt, "build", build)
    argv = ["--dry-run", "--out", str(tmp_path), "--tag", "v", "--compile", "off"]
    assert bench_gpt.main([*argv, "--backends", "native,native-sm90"]) == 0
    assert seen == [("native", None), ("native", "1")]
    assert "DILATED_ATTENTION_CUDA_SM90" not in os.environ
    with open(tmp_path / "v.csv", newline="") as f:
        assert [(r["backend"], r["runs_as"], r["status"]) for r in csv.DictReader(f)] == [
            ("native", "native", "ok"),
            ("native-sm90", "native", "ok"),
        ]
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_SM90", "0")
    with pytest.raises(RuntimeError, match="boom"), bench_gpt.variant_env("native-sm90") as backend:
        assert backend == "native" and os.environ["DILATED_ATTENTION_CUDA_SM90"] == "1"
        raise RuntimeError("boom")
    assert os.environ["DILATED_ATTENTION_CUDA_SM90"] == "0"
