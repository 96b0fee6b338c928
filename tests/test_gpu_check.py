"""scripts/gpu_check.sh and scripts/gpu_smoke.py, the one command that verifies the CUDA kernels on a
GPU: what can be checked without one (arguments, the skip without a GPU, the commands of each
step, how statuses, time limits and the summary come out, and the smoke run's comparisons on CPU
tensors)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

needs_bash = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash"
)


def gpu_check(*args, env=None, timeout=120):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "OUT"))}
    full.update(env or {})
    return subprocess.run(
        ["bash", str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
        check=False,
    )


@needs_bash
def test_help_and_usage_errors(tmp_path):
    res = gpu_check("--help")
    assert res.returncode == 0 and "--steps" in res.stdout and "compute-sanitizer" in res.stdout
    for args, env, message in [
        ((tmp_path, "--steps", "build,nope"), {}, "unknown step 'nope'"),
        ((tmp_path, "--steps", ","), {}, "--steps names no step"),
        ((tmp_path, "--deadline", "soon"), {}, "got 'soon'"),
        ((tmp_path, tmp_path / "b"), {}, "one output folder only"),
        ((tmp_path, "--fast"), {}, "unknown option '--fast'"),
        (
            (tmp_path,),
            {"GPU_CHECK_BUDGET_TESTS": "0"},
            "GPU_CHECK_BUDGET_TESTS must be a whole number of seconds >= 1",
        ),
    ]:
        res = gpu_check(*args, env=env)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert message in res.stderr and "usage:" in res.stderr


@needs_bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_skips_cleanly_without_a_gpu(tmp_path):
    res = gpu_check(tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert "no CUDA GPU here" in res.stdout and "skipping" in res.stdout
    assert "skipped" in (tmp_path / "out" / "summary.md").read_text()
    # Without a folder argument the output goes to $OUT.
    res = gpu_check(env={"OUT": str(tmp_path / "from-env")})
    assert res.returncode == 0 and (tmp_path / "from-env" / "summary.md").exists()


@needs_bash
def test_dry_run_names_every_command(tmp_path):
    res = gpu_check(tmp_path, "--dry-run", env={"GPU_CHECK_ARCH": "9.0"})
    assert res.returncode == 0, res.stderr
    lines = {line.split(" ", 1)[0]: line for line in res.stdout.splitlines()[1:]}
    assert (
        "TORCH_CUDA_ARCH_LIST=9.0 " in lines["build"]
        and r"DILATED_ATTENTION_NVCC_FLAGS=-Xptxas\ -v" in lines["build"]
    )
    assert "setup.py build_ext --inplace" in lines["build"]
    assert (
        "pytest" in lines["tests"]
        and "tests/test_cuda.py tests/test_ring_pieces.py -m cuda" in lines["tests"]
    )
    assert "gpu_smoke.py --cases small large" in lines["smoke"]
    assert "bench_cuda.py --tokens 262144 --out" in lines["bench"]
    tools = [line for line in res.stdout.splitlines() if line.startswith("sanitize")]
    assert [t.split("--tool ")[1].split()[0] for t in tools] == ["memcheck", "racecheck", "synccheck"]
    assert all("gpu_smoke.py --cases sanitize" in t for t in tools)
    res = gpu_check(tmp_path, "--dry-run", "--steps", "smoke bench")
    assert [line.split()[0] for line in res.stdout.splitlines()[1:]] == ["smoke", "bench"]


# A stand-in for python3 (and compute-sanitizer): FAKE_<STEP> says what each step does.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
  -c*) [ "${FAKE_KERNELS:-yes}" = yes ] ;;
  *setup.py*) echo "ptxas info    : Compiling entry function 'tc_fwd' for 'sm_90'"
              echo "ptxas info    : Used 128 registers"; [ "${FAKE_BUILD:-ok}" = ok ] ;;
  *"gpu_smoke.py --cases sanitize"*) echo "PASS tiny" ;;
  *gpu_smoke.py*) echo "PASS large-batch-bf16"; [ "${FAKE_SMOKE:-ok}" = ok ] ;;
  *bench_cuda.py*) [ "${FAKE_BENCH:-ok}" = sleep ] && exec sleep 60
                   echo "speedup table"; [ "${FAKE_BENCH:-ok}" = ok ] ;;
  "-m pytest"*) echo "12 passed in 1.0s"; [ "${FAKE_TESTS:-ok}" = ok ] ;;
esac
"""
FAKE_SANITIZER = r"""#!/usr/bin/env bash
if [ "${FAKE_SANITIZER:-ok}" = unsupported ]; then echo "========= Error: Device not supported"; exit 1; fi
shift 6  # --tool T --error-exitcode 3 --print-limit 30
"$@"; rc=$?
if [ "${FAKE_SANITIZER:-ok}" = race ]; then echo "========= ERROR SUMMARY: 1 error"; exit 3; fi
echo "========= ERROR SUMMARY: 0 errors"; exit $rc
"""


@pytest.fixture
def fake_tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("python", FAKE_PYTHON), ("compute-sanitizer", FAKE_SANITIZER)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def run(out, *args, **fake):
        env = {
            "GPU_CHECK_ASSUME_GPU": "1",
            "GPU_CHECK_PYTHON": str(bin_dir / "python"),
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
        }
        env.update({k: str(v) for k, v in fake.items()})
        res = gpu_check(out, *args, env=env)
        summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
        rows = {}
        for line in summary.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 3 and cells[0] in ("build", "tests", "smoke", "sanitize", "bench"):
                rows[cells[0]] = cells[1]
        return res, rows, summary

    return run


@needs_bash
def test_every_step_passing(tmp_path, fake_tools):
    res, rows, summary = fake_tools(tmp_path / "out")
    assert res.returncode == 0, res.stdout + res.stderr
    assert rows == dict.fromkeys(("build", "tests", "smoke", "sanitize", "bench"), "pass")
    assert "Used 128 registers" in summary and "12 passed" in summary and "PASS large-batch-bf16" in summary
    assert summary.count("ERROR SUMMARY: 0 errors") == 3 and "speedup table" in summary
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["build.log", "sanitize.log", "smoke.log", "summary.md", "tests.log"]
    assert len(files) <= 8  # what a device run brings back


@needs_bash
def test_failures_time_limits_and_the_deadline(tmp_path, fake_tools):
    res, rows, _ = fake_tools(
        tmp_path / "a", FAKE_SMOKE="fail", FAKE_BENCH="sleep", GPU_CHECK_BUDGET_BENCH=2, FAKE_SANITIZER="race"
    )
    assert res.returncode == 1
    assert rows["build"] == "pass" and rows["tests"] == "pass"
    assert rows["smoke"] == "FAIL (exit status 1)"
    assert rows["sanitize"] == "FAIL (exit status 3)"
    assert rows["bench"] == "FAIL: out of time (2 s)"
    # compute-sanitizer that cannot use the device is not a kernel failure, but not a pass either.
    res, rows, _ = fake_tools(tmp_path / "b", "--steps", "sanitize", FAKE_SANITIZER="unsupported")
    assert res.returncode == 1 and rows == {
        "sanitize": "unavailable: compute-sanitizer cannot run here (see sanitize.log)"
    }
    # A failed build stops the steps that need it; without CUDA kernels nothing runs.
    res, rows, _ = fake_tools(tmp_path / "c", "--steps", "build,tests", FAKE_BUILD="fail")
    assert (
        res.returncode == 1
        and rows["build"] == "FAIL (exit status 1)"
        and rows["tests"].startswith("not run")
    )
    res, rows, _ = fake_tools(tmp_path / "d", "--steps", "tests", FAKE_KERNELS="no")
    assert res.returncode == 1 and "has no CUDA kernels" in rows["tests"]
    # Past the deadline a step is not started.
    res, rows, _ = fake_tools(tmp_path / "e", "--deadline", "0")
    assert res.returncode == 1 and all(v.startswith("not run: deadline") for v in rows.values()), rows


# ----------------------------------------------------------------------------------------------
# scripts/gpu_smoke.py on CPU tensors
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke():
    yield load_script(ROOT / "scripts" / "gpu_smoke.py")
    del sys.modules["gpu_smoke"]


def test_smoke_cases_cover_what_the_check_promises(smoke):
    large = smoke.large_cases()
    assert {c.dtype for c in large} == {torch.bfloat16, torch.float32, torch.float64}
    for c in large:
        assert c.elements > 2**31, c.name
        assert c.slices and all(n1 - n0 >= math.lcm(*c.segs) for _, _, n0, n1 in c.slices)
        # A slice reaches the far end, where 32-bit offsets would have overflowed.
        assert max(((b1 - 1) * c.N + n1) * c.Hq * c.D for _, b1, _, n1 in c.slices) == c.elements
    assert any(c.B == 64 for c in large) and any(
        c.B == 64 and c.dtype == torch.float64 for c in smoke.small_cases()
    )
    tc = [c for c in smoke.sanitize_cases() if c.dtype in (torch.float16, torch.bfloat16) and not c.env]
    simt = [c for c in smoke.sanitize_cases() if c.dtype in (torch.float32, torch.float64) or c.env]
    assert any(32 <= c.D <= 256 and c.D % 8 == 0 for c in tc) and any(c.D == 256 for c in tc)  # smem opt-in
    assert {torch.float32, torch.float64} <= {c.dtype for c in simt}
    assert any(c.env.get("DILATED_ATTENTION_CUDA_SIMT") == "1" for c in simt)
    assert all(c.backward for c in smoke.sanitize_cases())


def test_smoke_runs_on_cpu_tensors(smoke, capsys):
    cases = [c for c in smoke.small_cases() if c.name in ("b64-gqa-f64", "uncovered-f64")]
    cases += smoke.large_cases(min_elements=2**16, heads=2, kv_heads=1, head_dim=16)
    for c in cases:
        errors = smoke.check_case(c, device="cpu")
        assert set(errors) == {"out", "lse", "dq", "dk", "dv"}
        assert all(e < smoke.TOLERANCE[c.dtype][1] for e in errors.values()), (c.name, errors)
    assert smoke.run_cases(cases[:1], "cpu") == (0, 0)
    assert "PASS b64-gqa-f64" in capsys.readouterr().out


def test_smoke_catches_a_wrong_result(smoke):
    """A wrong gradient in one place, or a wrong output in the last batch element only, fails."""
    case = smoke.small_cases()[0]

    def off_dk(*args):
        out, lse, dq, dk, dv, dlse = smoke.run_op(*args)
        dk = dk.clone()
        dk[1, 5, 0, 3] += 1e-6
        return out, lse, dq, dk, dv, dlse

    with pytest.raises(AssertionError, match=r"dk differs from the float64 CPU op .* index \(1, 5, 0, 3\)"):
        smoke.check_case(case, device="cpu", op=off_dk)

    big = smoke.large_cases(min_elements=2**16, heads=2, kv_heads=1, head_dim=16)[0]

    def off_last(*args):
        out, *rest = smoke.run_op(*args)
        out = out.clone()
        out[-1, -1] += 0.5
        return (out, *rest)

    with pytest.raises(AssertionError, match=rf"out differs .* batch \[{big.B - 1}, {big.B}\) positions"):
        smoke.check_case(big, device="cpu", op=off_last)
    misaligned = smoke.Case("bad", 1, 64, 1, 1, 8, [16], [1], False, torch.float64, [(0, 1, 8, 64)])
    with pytest.raises(ValueError, match=r"slice \[8, 64\) is not aligned"):
        smoke.check_case(misaligned, device="cpu")


# ----------------------------------------------------------------------------------------------
# The GPU tests that the tests step selects (-m cuda)
# ----------------------------------------------------------------------------------------------

# A pytest plugin that writes, for every collected test, its marks and the reasons of its skipif
# marks: pytest's own view of the tests, parametrised ones included.
_MARKS_PLUGIN = r"""
import json, os

def pytest_collection_finish(session):
    rows = []
    for item in session.items:
        marks = [m.name for m in item.iter_markers()]
        reasons = [str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")]
        rows.append({"id": item.nodeid, "marks": marks, "skip_reasons": reasons})
    with open(os.environ["DA_MARKS_OUT"], "w") as f:
        json.dump(rows, f)
"""


@pytest.mark.parametrize("test_file", ["tests/test_cuda.py", "tests/test_ring_pieces.py"])
def test_every_gpu_test_is_marked_cuda(tmp_path, test_file):
    """gpu_check.sh runs ``-m cuda``: a GPU test without the mark would never run on the GPU. A
    test needs the GPU when it carries the skip of ``common.needs_cuda_kernels``."""
    import json

    (tmp_path / "da_marks_plugin.py").write_text(_MARKS_PLUGIN)
    out = tmp_path / "marks.json"
    env = dict(os.environ, DA_MARKS_OUT=str(out))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "da_marks_plugin",
            "-p",
            "no:cacheprovider",
            test_file,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())
    needs = [r for r in rows if any(s.startswith("needs a CUDA GPU") for s in r["skip_reasons"])]
    assert needs, f"no test of {test_file} is recognised as a GPU test: the check would pass vacuously"
    unmarked = [r["id"] for r in needs if "cuda" not in r["marks"]]
    assert not unmarked, f"GPU tests without @pytest.mark.cuda (gpu_check.sh -m cuda skips them): {unmarked}"
    # and the other way round: a test marked cuda is skipped where there is no GPU
    loose = [r["id"] for r in rows if "cuda" in r["marks"] and r not in needs]
    assert not loose, f"tests marked cuda without the GPU skip of common.needs_cuda_kernels: {loose}"
