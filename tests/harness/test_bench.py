"""The CPU benchmark's own pieces: its FLOP count, its plain-PyTorch alternatives, and its reports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_script, make_inputs
from reference import multiplicity, reference_attention

from dilated_attention.flops import attention_flops, attention_pairs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = mod
    spec.loader.exec_module(mod)
    return mod


CASES = [(37, 4, [8, 16], [1, 2]), (100, 3, [7, 30, 64], [1, 3, 4]), (50, 6, [5, 10, 20, 40], [1, 2, 3, 4])]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_pair_count_matches_the_reference(is_causal):
    for N, H, segs, rates in CASES:
        assert attention_pairs(N, H, segs, rates, is_causal) == int(
            multiplicity(N, H, segs, rates, is_causal).sum()
        )


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "N,H,Hkv,segs,rates", [(64, 4, 4, [16, 32], [1, 2]), (50, 6, 3, [5, 10, 20, 40], [1, 2, 3, 4])]
)
def test_alternatives_compute_dilated_attention(bench, N, H, Hkv, segs, rates, is_causal):
    """gather_sdpa and dense_mask_sdpa are written apart from the package: check them against float64."""
    q, k, v = make_inputs(1, N, H, Hkv, 16, torch.float32, requires_grad=False)
    ref = reference_attention(q.double(), k.double(), v.double(), segs, rates, is_causal)[0]
    gathered = bench.gather_sdpa(q, k, v, segs, rates, is_causal)
    torch.testing.assert_close(gathered.double(), ref, rtol=1e-4, atol=1e-5)
    mask = bench.dense_mask(N, H, segs, rates, is_causal, q.device)
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(bench._to_bhnd(t) for t in (q, k, v)), attn_mask=mask, enable_gqa=H != Hkv
    ).transpose(1, 2)
    covered = multiplicity(N, H, segs, rates, is_causal).sum(-1) > 0  # (H, N): rows some branch reads
    torch.testing.assert_close(dense.double()[0][covered.T], ref[0][covered.T], rtol=1e-4, atol=1e-5)


def _row(bench, method, N, mode, ms, peak, suite="sweep"):
    pairs = attention_pairs(N, 2, [64], [1], False)
    return {
        "suite": suite,
        "method": method,
        "kind": "x",
        "N": N,
        "mode": mode,
        "device": "cpu",
        "dtype": "float32",
        "B": 1,
        "H": 2,
        "Hkv": 2,
        "D": 16,
        "causal": False,
        "segments": "64",
        "rates": "1",
        "status": "ok",
        "reason": "",
        "ms_median": ms,
        "ms_min": ms,
        "ms_max": ms,
        "repeats": 1,
        "rounds": 1,
        "pairs": pairs,
        "tokens_per_s": N / ms * 1e3,
        "useful_tflops": attention_flops(pairs, 16, backward=mode != "fwd") / (ms / 1e3) / 1e12,
        "peak_bytes": peak,
        "bytes_per_token": peak / N,
        "load1": 0.0,
    }


def test_report_of_a_saved_run(bench, tmp_path, capsys):
    rows = []
    for N in (8192, 16384, 262144):
        rows += [
            _row(bench, "native", N, "fwd", N / 100, 10 * N),
            _row(bench, "native", N, "fwdbwd", N / 40, 40 * N),
        ]
        rows += [
            _row(bench, "sdpa", N, "fwd", N / 50, 20 * N),
            _row(bench, "sdpa", N, "fwdbwd", N / 10, 80 * N),
        ]
    meta = {
        "device": "cpu",
        "cpu": "Test CPU",
        "torch": torch.__version__,
        "date": "2026-01-01T00:00:00+00:00",
        "cpu_count": 2,
        "cpu_isa": "avx2,fma",
        "mm_gflops_start": 100.0,
        "mm_gflops_end": 100.0,
        "config": {"dtype": "float32", "B": 1, "H": 2, "D": 16, "segs": [64], "rates": [1], "causal": False},
    }
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"meta": meta, "rows": rows, "checks": None}))
    assert bench.main(["--from-json", str(saved), "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "speedup over the fastest alternative: min 4.00x (target >= 2x: met)" in text
    assert "ratio 1.00 (target <= 1.2: met)" in text
    data = json.loads((tmp_path / "out" / "cpu-test-2core-avx2.json").read_text())
    assert [s["speedup"] for s in data["checks"]["speed"]] == pytest.approx([4.0, 4.0])
    assert (tmp_path / "out" / "cpu-test-2core-avx2.csv").exists()
    # A second report of the same name goes beside the first, unless --overwrite says otherwise.
    first = (tmp_path / "out" / "cpu-test-2core-avx2.json").read_text()
    assert bench.main(["--from-json", str(saved), "--out", str(tmp_path / "out")]) == 0
    assert "writing cpu-test-2core-avx2-" in capsys.readouterr().out
    assert (tmp_path / "out" / "cpu-test-2core-avx2.json").read_text() == first
    beside = sorted((tmp_path / "out").glob("cpu-test-2core-avx2-*.json"))
    assert len(beside) == 1
    beside[0].unlink()
    (tmp_path / "out" / "cpu-test-2core-avx2.json").write_text("{}")
    assert bench.main(["--from-json", str(saved), "--out", str(tmp_path / "out"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "out" / "cpu-test-2core-avx2.json").read_text())["rows"]
    assert not list((tmp_path / "out").glob("cpu-test-2core-avx2-*.json"))


def test_saved_run_that_is_not_one_is_named(bench, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    with pytest.raises(SystemExit, match=r"bad\.json"):
        bench.main(["--from-json", str(bad)])
    with pytest.raises(SystemExit, match=r"missing\.json"):
        bench.main(["--from-json", str(tmp_path / "missing.json")])


def test_shared_counting_rules():
    """attention_flops is SPEC section 3's rule; accumulation_dtype the float64-else-float32 rule;
    matmul_flops measures something positive."""
    from dilated_attention.flops import accumulation_dtype, matmul_flops

    assert attention_flops(10, 64) == 4 * 64 * 10
    assert attention_flops(10, 64, backward=True) == 3.5 * 4 * 64 * 10
    assert accumulation_dtype(torch.float64) == torch.float64
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert accumulation_dtype(dt) == torch.float32
    assert matmul_flops("cpu", n=64, repeats=3) > 0


def test_decode_benchmark_runs_and_writes_its_results(tmp_path):
    """bench_decode.py end to end at toy sizes: its own check against SDPA passes, and it writes
    one row per method and length, with the keys the decode step gathers."""
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "bench_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = "--lengths 64,256 --segments 16,64 --rates 1,4 --heads 4 --kv-heads 2 --dim 8"
    assert (
        mod.main([*argv.split(), "--repeats", "1", "--warmup", "0", "--out", str(tmp_path), "--tag", "t"])
        == 0
    )
    data = json.loads((tmp_path / "t.json").read_text())
    rows = {(r["method"], r["L"]): r for r in data["rows"]}
    assert set(rows) == {(m, L) for m in ("bounded", "dilated", "dense_sdpa") for L in (64, 256)}
    assert rows[("dilated", 256)]["keys_read"] == 16 + 16  # w / r slots per branch
    assert rows[("dense_sdpa", 256)]["keys_read"] == 256
    assert data["meta"]["check_max_abs_diff"] < 1e-4
    assert data["meta"]["check_bounded_max_abs_diff"] < 1e-4
    assert rows[("bounded", 256)]["cache_bytes"] < rows[("dense_sdpa", 256)]["cache_bytes"]


def _script(name: str):
    """A benchmark script as a module, loaded once per test session."""
    if getattr(sys.modules.get(name), "__file__", None) == str(ROOT / "benchmarks" / f"{name}.py"):
        return sys.modules[name]
    return load_script(ROOT / "benchmarks" / f"{name}.py")


BAD_ARGUMENTS = [
    # (script, arguments, the option the error names, the value it shows): the shared rules
    # (benchlib) once each, then each script's own checks of several options together
    ("bench", "--n 0", "--n", "0"),
    ("bench", "--n 4k,abc", "--n", "abc"),
    ("bench", "--segments 4 --rates 8", "--rates", "8"),
    ("bench", "--segments 4,8 --rates 1", "--rates", "1"),
    ("bench", "--heads 4 --kv-heads 3", "--kv-heads", "3"),
    ("bench", "--dim 512", "--dim", "512"),
    ("bench", "--device banana", "--device", "banana"),
    ("bench", "--methods native,nope", "--methods", "nope"),
    ("bench", "--mem-fraction 1.5", "--mem-fraction", "1.5"),
    ("bench", "--max-seconds nan", "--max-seconds", "nan"),
    ("bench_decode", "--lengths 0", "--lengths", "0"),
    ("bench_decode", "--heads 8 --kv-heads 3", "--kv-heads", "3"),
    ("bench_decode", "--generate 0", "--generate", "0"),
    ("bench_decode", "--generate 8 --segments 8 --rates 16", "--rates", "16"),
    ("bench_decode", "--generate 100 --every 200", "--every", "200"),
    ("bench_varlen", "--backend nope", "--backend", "nope"),
    ("bench_varlen", "--tokens 2 --docs 3", "--docs", "3"),
    ("bench_varlen", "--causal 2", "--causal", "2"),
    ("bench_ring", "--procs 0", "--procs", "0"),
    ("bench_ring", "--n 1000 --procs 3", "--procs", "1000"),
    ("bench_ring", "--layouts diagonal", "--layouts", "diagonal"),
    ("bench_sdpa_views", "--baseline /nonexistent", "--baseline", "/nonexistent"),
    ("bench_sdpa_views", "--variants before", "--baseline", "before"),
    ("bench_cuda", "--seq-lens 0", "--seq-lens", "0"),
    ("bench_gpt", "--backends dense,nope", "--backends", "nope"),
    ("bench_gpt", "--compile maybe", "--compile", "maybe"),
    ("bench_gpt", "--embd 100", "--embd", "100"),
    ("bench_gpt", "--embd 6144 --heads 12", "--embd", "6144"),
    ("bench_gpt", "--dtype float8", "--dtype", "float8"),
    ("bench_gpt", "--profile native", "--profile", "native"),
    ("bench_gpt", "--profile native:16k:fast", "--profile", "native:16k:fast"),
    ("bench_dispatch", "--backends native,nope", "--backends", "nope"),
    ("bench_dispatch", "--out /nonexistent/d.md", "--out", "/nonexistent/d.md"),
]


@pytest.mark.parametrize(
    "script,args,option,value", BAD_ARGUMENTS, ids=[f"{s}:{a}" for s, a, _, _ in BAD_ARGUMENTS]
)
def test_bad_arguments_are_usage_errors(bench, script, args, option, value, capsys):
    """Each bad value is argparse's usage error (exit status 2) naming the option and the value,
    found while parsing: nothing is measured."""
    parse = _script(script).parse_args
    with pytest.raises(SystemExit) as exc:
        parse(args.split())
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: " in err and "Traceback" not in err, err
    assert option in err and value in err, err


@pytest.mark.parametrize(
    "script,args",
    [
        ("bench", "--n 4k,8k --segments 512,1k --rates 1,2 --heads 4 --kv-heads 2 --device cpu"),
        ("bench_decode", "--lengths 64,256 --segments 16,64 --rates 1,4"),
        ("bench_decode", "--generate 8 --every 4 --segments 4 --rates 2"),
        ("bench_varlen", "--docs 3 --tokens 3 --segments 8 --rates 1 --causal 0"),
        ("bench_ring", "--n 1024 --segments 512 --rates 1 --procs 4 --layouts zigzag"),
        ("bench_sdpa_views", "--n 1024 --variants after after-op-bwd"),
        ("bench_gpt", "--blocks 16k,64k --backends dense,native --compile both --profile sdpa:64k:compile"),
        ("bench_dispatch", "--n 16k --backends native,sdpa,manual --device cpu"),
    ],
)
def test_good_arguments_parse(bench, script, args):
    parsed = _script(script).parse_args(args.split())
    assert parsed is not None


def test_a_bad_argument_on_the_command_line_is_one_error_line():
    """As a command: exit status 2, the usage and one error line, no traceback, no result file."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--n", "0", "--out", "/nonexistent/out"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert (
        r.stderr.strip().splitlines()[-1]
        == "bench.py: error: argument --n: every value must be >= 1, got '0'"
    )


BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench*.py") if p.stem != "benchlib")


# Each benchmark run as `python -m benchmarks.NAME --help` (runpy, as -m does), in one process: its
# usage on stdout and exit status 0, or a line naming what went wrong.
_HELP_ALL = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
        print(f"{name}: returned without exiting")
    except SystemExit as e:
        ok = e.code in (0, None) and out.getvalue().startswith("usage: ")
        print(f"{name}: {'ok' if ok else f'exit {e.code!r}, output {out.getvalue()[:200]!r}'}")
"""


def test_every_benchmark_answers_help_as_a_module():
    """``python -m benchmarks.NAME --help`` from the checkout, for every benchmark: the usage,
    exit status 0."""
    r = subprocess.run(
        [sys.executable, "-c", _HELP_ALL, *BENCHMARKS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{name}: ok" for name in BENCHMARKS], r.stdout + r.stderr
