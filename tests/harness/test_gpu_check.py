"""scripts/gpu_check.sh and scripts/gpu.py, the one command that verifies the CUDA kernels on a
GPU and its Python side: what can be checked without one (arguments, the skip without a GPU, the
commands of each step, how statuses, time limits and the summary come out, that env and testlog run
without torch, and the smoke run's comparisons on CPU tensors)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GPU_PY = ROOT / "scripts" / "gpu.py"

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
    assert "gpu_check.sh tests" in res.stdout and "gpu_check.sh sanitize" in res.stdout
    for args, env, message in [
        ((tmp_path, "--steps", "build,nope"), {}, "unknown step 'nope'"),
        ((tmp_path, "--steps", ","), {}, "--steps names no step"),
        ((tmp_path, "--deadline", "soon"), {}, "got 'soon'"),
        ((tmp_path, tmp_path / "b"), {}, "one output folder only"),
        ((tmp_path, "--fast"), {}, "unknown option '--fast'"),
        ((tmp_path, "tests"), {}, "the phase comes first"),
        (("tests", "sanitize"), {}, "the phase comes first"),
        (
            (tmp_path,),
            {"GPU_CHECK_BUDGET_TESTS": "0"},
            "GPU_CHECK_BUDGET_TESTS must be a whole number of seconds >= 1",
        ),
        ((tmp_path,), {"GPU_CHECK_WORKERS": "x"}, "GPU_CHECK_WORKERS must be a whole number >= 1, got 'x'"),
    ]:
        res = gpu_check(*args, env=env)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert message in res.stderr and "usage:" in res.stderr


@needs_bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_skips_cleanly_without_a_gpu(tmp_path):
    # Without a folder argument the output goes to $OUT.
    res = gpu_check("sanitize", env={"OUT": str(tmp_path / "out")})
    assert res.returncode == 0, res.stderr
    assert "no CUDA GPU here" in res.stdout and "skipping" in res.stdout
    # What the machine has comes first.
    assert res.stdout.splitlines()[0].startswith("gpu_env: python")
    for what in (
        "setuptools",
        "ninja",
        "nvcc",
        "torch",
        "GPU",
        "driver",
        "compute-sanitizer",
        "pytest-xdist",
    ):
        assert f"gpu_env: {what}" in res.stdout or f", {what}" in res.stdout, what
    assert "skipped" in (tmp_path / "out" / "summary.md").read_text()


# A stand-in for python3 (and compute-sanitizer): FAKE_<STEP> says what each step does.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
  *"gpu.py testlog"*) exec "$REAL_PYTHON" "$@" ;;
  *"gpu.py env"*) echo "gpu_env: python           fake"
                if [ "${FAKE_ENV:-ok}" = missing ] && [[ "$*" == *--need-build* ]]; then
                  echo "gpu_env: cannot build: ninja is not on PATH (pip install ninja)"; exit 3; fi ;;
  -c*) [ "${FAKE_KERNELS:-yes}" = yes ] ;;
  *setup.py*) echo "ptxas info    : Compiling entry function 'tc_fwd' for 'sm_90'"
              echo "ptxas info    : Used 128 registers"; echo built >>"$FAKE_BUILDS"; [ "${FAKE_BUILD:-ok}" = ok ] ;;
  *"gpu.py smoke --cases sanitize"*) echo "PASS tiny" ;;
  *"gpu.py smoke"*) echo "PASS large-batch-bf16"; [ "${FAKE_SMOKE:-ok}" = ok ] ;;
  *bench_cuda.py*) [ "${FAKE_BENCH:-ok}" = sleep ] && exec sleep 60
                   echo "speedup table $*"; [ "${FAKE_BENCH:-ok}" = ok ] ;;
  "-m pytest"*) if [ "${FAKE_TESTS:-ok}" = crash ]; then cat "$FAKE_TESTS_LOG"; exec sleep 60; fi
                echo "12 passed in 1.0s"; [ "${FAKE_TESTS:-ok}" = ok ] ;;
esac
"""
FAKE_SANITIZER = r"""#!/usr/bin/env bash
if [ "${FAKE_SANITIZER:-ok}" = unsupported ]; then echo "========= Error: Device not supported"; exit 1; fi
[ "${FAKE_SANITIZER_SLEEP:-}" = "$2" ] && exec sleep 60
shift 6  # --tool T --error-exitcode 3 --print-limit 30
"$@"; rc=$?
if [ "${FAKE_SANITIZER:-ok}" = race ]; then echo "========= ERROR SUMMARY: 1 error"; exit 3; fi
echo "========= ERROR SUMMARY: 0 errors"; exit $rc
"""
# A stand-in for cuda-gdb and gdb: records its arguments, prints a native stack of 41 frames.
FAKE_DEBUGGER = r"""#!/usr/bin/env bash
echo "$(basename "$0") $*" >>"$FAKE_DEBUGGER_ARGS"
echo '[Thread debugging using libthread_db enabled]'
echo 'Thread 1 "python" received signal SIGSEGV, Segmentation fault.'
echo '#0  0x00007fffd1234567 in dilated_attention::cuda::launch_fwd (q=...) at csrc/cuda/fwd.cu:120'
for i in $(seq 1 40); do echo "#$i  0x00007fffd00000$i in frame_$i () from /torch/lib/libtorch_cpu.so"; done
"""
# A stand-in for Nsight Compute: prints a profile of the tensor-core kernels as ncu does.
FAKE_NCU = r"""#!/usr/bin/env bash
echo "==PROF== Connected to process 1234"
echo "  void dilated_attention::cuda::tc_fwd_kernel<__nv_bfloat16, 128, false>(Params) (4096, 16, 1)x(128, 1, 1)"
echo "    Section: GPU Speed Of Light Throughput"
echo "    Duration                         msecond        12.34"
echo "    Compute (SM) Throughput                %        41.20"
echo "    Achieved Occupancy                     %        11.90"
echo "    OPT   This kernel's theoretical occupancy is limited by the number of required registers."
echo "          a second line of the advice"
echo "  void dilated_attention::cuda::tc90_dkv_kernel<__nv_bfloat16, 128, false>(Params) (4096, 8, 1)x(128, 1, 1)"
echo "    Duration                         msecond        23.45"
[ "${FAKE_NCU:-ok}" = ok ]
"""
STEPS = ("build", "tests", "backtrace", "smoke", "memcheck", "racecheck", "synccheck", "bench", "profile")

# What pytest -v -n 8 writes when a test crashes its worker, and the run is then cut by the step's
# time limit before pytest's own count: per-test lines, the faulthandler dump, the replaced worker.
CRASH_LOG = """\
============================= test session starts ==============================
created: 8/8 workers
8 workers [1200 items]

scheduling tests via LoadScheduling

tests/cuda/test_cuda.py::test_fwd[bf16-64]
tests/cuda/test_cuda.py::test_fwd[bf16-128]
[gw1] [  0%] PASSED tests/cuda/test_cuda.py::test_fwd[bf16-64]
[gw2] [  0%] FAILED tests/cuda/test_cuda.py::test_fwd[bf16-128]
tests/cuda/test_cuda.py::test_bwd[f32]
[gw3] [  0%] SKIPPED tests/cuda/test_cuda.py::test_bwd[f32]
tests/cuda/test_cuda.py::test_empty_inputs_and_errors
tests/cuda/test_cuda.py::test_long[1m] Fatal Python error: Segmentation fault

Thread 0x00007f1d71fff6c0 (most recent call first):
  File "/opt/venv/lib/python3.12/site-packages/execnet/gateway_base.py", line 534 in read

Current thread 0x00007f1d73401b80 (most recent call first):
  File "/opt/venv/lib/python3.12/site-packages/torch/_ops.py", line 1243 in __call__
  File "/work/main/tests/common.py", line 88 in run_fwd
  File "/work/main/tests/cuda/test_cuda.py", line 1732 in test_empty_inputs_and_errors
  File "/opt/venv/lib/python3.12/site-packages/_pytest/python.py", line 166 in pytest_pyfunc_call

Extension modules: torch._C, numpy.core._multiarray_umath (total: 20)
[gw7] node down: Not properly terminated
[gw7] [  0%] FAILED tests/cuda/test_cuda.py::test_empty_inputs_and_errors

replacing crashed worker gw7
[gw0] [  0%] ERROR tests/ring/test_ring_pieces.py::test_pieces[2]
[gw4] [  0%] PASSED tests/cuda/test_cuda.py::test_long[1m]
tests/cuda/test_cuda.py::test_decode_paged[4096]
"""


@pytest.fixture
def fake_tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [
        ("python", FAKE_PYTHON),
        ("compute-sanitizer", FAKE_SANITIZER),
        ("cuda-gdb", FAKE_DEBUGGER),
        ("ncu", FAKE_NCU),
    ]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def run(*args, **fake):
        env = {
            "GPU_CHECK_ASSUME_GPU": "1",
            "GPU_CHECK_PYTHON": str(bin_dir / "python"),
            "GPU_CHECK_STAMP": str(tmp_path / "stamp"),
            "FAKE_BUILDS": str(tmp_path / "builds"),
            "FAKE_DEBUGGER_ARGS": str(tmp_path / "debugger_args"),
            "REAL_PYTHON": sys.executable,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
        }
        env.update({k: str(v) for k, v in fake.items()})
        res = gpu_check(*args, env=env)
        if "--dry-run" in args:
            return res
        out = next(Path(a) for a in args if isinstance(a, Path))
        summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
        rows = {}
        for line in summary.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 3 and cells[0] in STEPS:
                rows[cells[0]] = cells[1]
        return res, rows, summary

    run.bin_dir = bin_dir
    return run


def _dry_lines(res) -> dict[str, str]:
    return {line.split(" ", 1)[0]: line for line in res.stdout.splitlines() if not line.startswith("gpu_env")}


@needs_bash
def test_dry_run_names_every_command(tmp_path, fake_tools):
    res = fake_tools(tmp_path, "--dry-run", GPU_CHECK_ARCH="9.0")
    assert res.returncode == 0, res.stderr
    lines = _dry_lines(res)
    assert "phase all" in lines["gpu_check"] and "deadline 540 s" in lines["gpu_check"]
    assert (
        "TORCH_CUDA_ARCH_LIST=9.0 " in lines["build"]
        and r"DILATED_ATTENTION_NVCC_FLAGS=-Xptxas\ -v" in lines["build"]
    )
    assert "setup.py build_ext --inplace" in lines["build"] and "skipped when up to date" in lines["build"]
    assert (
        "pytest" in lines["tests"]
        and "tests/cuda/test_cuda.py tests/ring/test_ring_pieces.py -m cuda" in lines["tests"]
    )
    # One line per test as it ends (a run cut by its budget still names its failures), short tracebacks.
    assert "pytest -v --tb=short -rfEs --durations=25 " in lines["tests"]
    assert lines["backtrace"].startswith("backtrace (60 s, only after a crash in tests.log): ")
    assert (
        "cuda-gdb -batch " in lines["backtrace"] and "-ex run -ex bt -ex quit --args " in lines["backtrace"]
    )
    assert "-m pytest -x -q -p no:cacheprovider -p no:xdist CRASHED_TEST" in lines["backtrace"]
    assert "scripts/gpu.py smoke --cases errors small large sm90" in lines["smoke"]
    assert "bench_cuda.py --out" in lines["bench"] and "--budget 120 " in lines["bench"]
    assert lines["profile"].startswith("profile (90 s): ") and "--clock-control none" in lines["profile"]
    assert "scripts/gpu.py profile" in lines["profile"] and "--launch-count 6" in lines["profile"]
    for tool, budget in (("memcheck", 90), ("racecheck", 120), ("synccheck", 60)):
        assert lines[tool].startswith(f"{tool} ({budget} s): ") and f"--tool {tool} " in lines[tool]
        assert "scripts/gpu.py smoke --cases sanitize" in lines[tool]
    res = fake_tools(tmp_path, "--dry-run", "--steps", "smoke bench")
    assert list(_dry_lines(res))[1:] == ["smoke", "bench"]
    res = fake_tools(tmp_path, "--dry-run", "--steps", "backtrace", GPU_CHECK_DEBUGGER="none")
    assert "neither cuda-gdb nor gdb here" in _dry_lines(res)["backtrace"]
    res = fake_tools(tmp_path, "--dry-run", "--steps", "sanitize", GPU_CHECK_BUDGET_RACECHECK=7)
    assert list(_dry_lines(res))[1:] == ["memcheck", "racecheck", "synccheck"]
    assert _dry_lines(res)["racecheck"].startswith("racecheck (7 s)")


@needs_bash
@pytest.mark.parametrize(
    "phase,steps",
    [
        ("tests", ["build", "tests", "backtrace", "smoke"]),
        ("sanitize", ["build", "memcheck", "racecheck", "synccheck", "bench"]),
        ("profile", ["build", "profile"]),
        (
            "all",
            [
                "build",
                "tests",
                "backtrace",
                "smoke",
                "memcheck",
                "racecheck",
                "synccheck",
                "bench",
                "profile",
            ],
        ),
    ],
)
def test_the_two_commands_each_fit_in_eight_minutes(tmp_path, fake_tools, phase, steps):
    """Each phase's steps end inside its deadline (470 s: a device command may run 10 minutes);
    the sanitize phase rebuilds only when the in-place build is missing or out of date. The profile
    phase's budgets add up to less than its deadline, a full build included (the profile step never
    ran to the end while it came after the sanitizers)."""
    res = fake_tools(phase, tmp_path, "--dry-run")
    assert res.returncode == 0, res.stderr
    lines = _dry_lines(res)
    assert list(lines)[1:] == steps
    if phase != "all":
        assert "deadline 470 s" in lines["gpu_check"]
    if phase == "profile":
        budgets = [int(re.match(r"\w+ \((\d+) s", lines[s]).group(1)) for s in steps]
        assert sum(budgets) <= 470, lines


@needs_bash
def test_every_step_passing(tmp_path, fake_tools):
    res, rows, summary = fake_tools(tmp_path / "out")
    assert res.returncode == 0, res.stdout + res.stderr
    assert rows == {**dict.fromkeys(STEPS, "pass"), "backtrace": "not needed (no crashed test in tests.log)"}
    assert not (tmp_path / "debugger_args").exists()
    assert res.stdout.startswith("gpu_env: python")  # what the machine has, first
    assert "gpu_env: python           fake" in summary
    assert "Used 128 registers" in summary and "12 passed" in summary and "PASS large-batch-bf16" in summary
    assert summary.count("ERROR SUMMARY: 0 errors") == 3 and "speedup table" in summary
    assert "--budget 120" in summary  # the benchmark's own budget, under the step's
    # The entry that records the pass for this compute capability (assumed GPU: sm_90), as the
    # JSON of dilated_attention/gpu_records.json.
    entry = json.loads(next(line for line in summary.splitlines() if '"capability"' in line))
    assert entry["capability"] == [9, 0] and entry["gpu"] == "assumed GPU", entry
    assert entry["families"] == ["tensor-core", "simt"], entry
    res, rows, summary = fake_tools(tmp_path / "turing", "--steps", "build", GPU_CHECK_ARCH="7.5")
    entry = json.loads(next(line for line in summary.splitlines() if '"capability"' in line))
    assert entry["capability"] == [7, 5] and entry["families"] == ["simt"], entry
    res, rows, summary = fake_tools(tmp_path / "fail", "--steps", "smoke", FAKE_SMOKE="fail")
    assert '"capability"' not in summary
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["build.log", "sanitize.log", "smoke.log", "summary.md", "tests.log"]
    assert len(files) <= 8  # what a device run brings back


@needs_bash
def test_second_command_reuses_the_build(tmp_path, fake_tools):
    res, rows, summary = fake_tools("tests", tmp_path / "a")
    assert res.returncode == 0 and list(rows) == ["build", "tests", "backtrace", "smoke"]
    assert "scripts/gpu_check.sh sanitize" in summary
    res, rows, _ = fake_tools("sanitize", tmp_path / "b")
    assert res.returncode == 0, res.stdout + res.stderr
    assert rows["build"] == "pass (up to date: not rebuilt)" and list(rows) == [
        "build",
        "memcheck",
        "racecheck",
        "synccheck",
        "bench",
    ]
    res, rows, _ = fake_tools("profile", tmp_path / "c")
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(rows) == ["build", "profile"] and rows["profile"] == "pass"
    assert (tmp_path / "builds").read_text().count("built") == 1
    # Another architecture, or GPU_CHECK_REBUILD=1, builds again.
    fake_tools("sanitize", tmp_path / "c", "--steps", "build", GPU_CHECK_ARCH="8.0")
    fake_tools("sanitize", tmp_path / "d", "--steps", "build", GPU_CHECK_ARCH="8.0", GPU_CHECK_REBUILD=1)
    assert (tmp_path / "builds").read_text().count("built") == 3


@needs_bash
def test_stops_when_the_build_cannot_run(tmp_path, fake_tools):
    res, rows, summary = fake_tools("tests", tmp_path / "a", FAKE_ENV="missing")
    assert res.returncode == 3
    assert "cannot build: ninja is not on PATH" in res.stderr and "cannot be built here" in summary
    assert not (tmp_path / "builds").exists()
    # Steps that need no build still run.
    res, rows, _ = fake_tools("tests", tmp_path / "b", "--steps", "smoke", FAKE_ENV="missing")
    assert res.returncode == 0 and rows == {"smoke": "pass"}


@needs_bash
def test_failures_time_limits_and_the_deadline(tmp_path, fake_tools):
    res, rows, _ = fake_tools(
        tmp_path / "a", FAKE_SMOKE="fail", FAKE_BENCH="sleep", GPU_CHECK_BUDGET_BENCH=2, FAKE_SANITIZER="race"
    )
    assert res.returncode == 1
    assert rows["build"] == "pass" and rows["tests"] == "pass"
    assert rows["smoke"] == "FAIL (exit status 1)"
    assert rows["memcheck"] == rows["racecheck"] == rows["synccheck"] == "FAIL (exit status 3)"
    assert rows["bench"] == "FAIL: out of time (2 s)"
    # racecheck past its own budget is cut and reported; the tools after it still run.
    res, rows, summary = fake_tools(
        tmp_path / "r", "--steps", "sanitize", FAKE_SANITIZER_SLEEP="racecheck", GPU_CHECK_BUDGET_RACECHECK=2
    )
    assert res.returncode == 1
    assert rows == {"memcheck": "pass", "racecheck": "FAIL: out of time (2 s)", "synccheck": "pass"}, summary
    # compute-sanitizer that cannot use the device is not a kernel failure, but not a pass either.
    res, rows, _ = fake_tools(tmp_path / "b", "--steps", "memcheck", FAKE_SANITIZER="unsupported")
    assert res.returncode == 1 and rows == {
        "memcheck": "unavailable: compute-sanitizer cannot run here (see sanitize.log)"
    }
    # A failed build stops the steps that need it; without CUDA kernels nothing runs.
    res, rows, _ = fake_tools(
        tmp_path / "c", "--steps", "build,tests", FAKE_BUILD="fail", GPU_CHECK_REBUILD=1
    )
    assert (
        res.returncode == 1
        and rows["build"] == "FAIL (exit status 1)"
        and rows["tests"].startswith("not run")
    )
    res, rows, _ = fake_tools(tmp_path / "d", "--steps", "tests", FAKE_KERNELS="no")
    assert res.returncode == 1 and "has no CUDA kernels" in rows["tests"]
    # Past the deadline a step is not started.
    res, rows, _ = fake_tools(tmp_path / "e", "--deadline", "0", FAKE_KERNELS="no")
    assert rows.pop("backtrace") == "not needed (no crashed test in tests.log)"
    assert res.returncode == 1 and all(v.startswith("not run: deadline") for v in rows.values()), rows


# ----------------------------------------------------------------------------------------------
# The tests step's log: failed and crashed tests, and their native backtraces
# ----------------------------------------------------------------------------------------------


def _crash_run(tmp_path, fake_tools, name, **fake):
    (tmp_path / "crash.log").write_text(CRASH_LOG)
    return fake_tools(
        tmp_path / name,
        "--steps",
        "tests,backtrace",
        FAKE_TESTS="crash",
        FAKE_TESTS_LOG=tmp_path / "crash.log",
        GPU_CHECK_BUDGET_TESTS=2,
        **fake,
    )


@needs_bash
def test_a_run_cut_by_its_budget_names_the_failed_and_crashed_tests(tmp_path, fake_tools):
    res, rows, summary = _crash_run(tmp_path, fake_tools, "out")
    assert res.returncode == 1
    assert rows["tests"] == "FAIL: out of time (2 s); 1 crashes (Fatal Python error)"
    lines = summary.splitlines()
    # Counted from the per-test lines: pytest never printed its own count.
    assert (
        "pytest did not finish (cut by the time limit, or it crashed): 6 results so far for 1200 tests: "
        in summary
    )
    assert "2 passed, 2 failed, 1 skipped, 1 error" in summary
    assert "FAILED tests/cuda/test_cuda.py::test_fwd[bf16-128]" in lines
    assert "ERROR tests/ring/test_ring_pieces.py::test_pieces[2]" in lines
    assert (
        "CRASHED tests/cuda/test_cuda.py::test_empty_inputs_and_errors (gw7: Not properly terminated)"
        in lines
    )
    assert "FAILED tests/cuda/test_cuda.py::test_empty_inputs_and_errors" not in lines
    # The faulthandler dump names the test function, not the test whose line it interrupted.
    assert (
        "Fatal Python error: Segmentation fault -- in tests/cuda/test_cuda.py line 1732 in test_empty_inputs_and_errors;"
        " innermost Python frame: torch/_ops.py line 1243 in __call__" in lines
    )
    # Started, with no result when the log ends.
    assert "RUNNING tests/cuda/test_cuda.py::test_decode_paged[4096]  (no result when the log ends)" in lines
    assert not any("RUNNING" in line and ("test_long" in line or "test_empty" in line) for line in lines)
    # The crashed test alone, under cuda-gdb; its native frames #0-#30 in summary.md.
    args = (tmp_path / "debugger_args").read_text().splitlines()
    assert len(args) == 1 and args[0].startswith("cuda-gdb -batch -ex ")
    assert args[0].endswith(
        "-ex run -ex bt -ex quit --args "
        + str(fake_tools.bin_dir / "python")
        + " -m pytest -x -q -p no:cacheprovider -p no:xdist tests/cuda/test_cuda.py::test_empty_inputs_and_errors"
    )
    assert rows["backtrace"] == "done: 1 of 1 crashed tests rerun under cuda-gdb (tests.log)"
    assert "## native backtraces of the crashed tests" in summary
    assert 'Thread 1 "python" received signal SIGSEGV, Segmentation fault.' in lines
    assert (
        "#0  0x00007fffd1234567 in dilated_attention::cuda::launch_fwd (q=...) at csrc/cuda/fwd.cu:120"
        in lines
    )
    assert any(line.startswith("#30 ") for line in lines) and not any(
        line.startswith("#31 ") for line in lines
    )
    log = (tmp_path / "out" / "tests.log").read_text()
    assert "#40  0x" in log and "----- gpu_check backtrace 1: exit status 0" in log


@needs_bash
def test_backtrace_without_a_debugger_says_so(tmp_path, fake_tools):
    res, rows, summary = _crash_run(tmp_path, fake_tools, "out", GPU_CHECK_DEBUGGER="none")
    assert res.returncode == 1 and not (tmp_path / "debugger_args").exists()
    assert rows["backtrace"] == "unavailable: neither cuda-gdb nor gdb here (1 crashed tests not rerun)"
    assert "backtrace: neither cuda-gdb nor gdb found; the crashed tests are not rerun" in res.stdout
    log = (tmp_path / "out" / "tests.log").read_text()
    assert (
        "neither cuda-gdb nor gdb found" in log
        and "not rerun: tests/cuda/test_cuda.py::test_empty_inputs_and_errors" in log
    )
    assert "CRASHED tests/cuda/test_cuda.py::test_empty_inputs_and_errors" in summary  # still named


# scripts/gpu.py env and testlog run before the extension is built, with whatever interpreter the
# check uses: here with torch and the package hidden (importing either fails).
_WITHOUT_TORCH = """
import runpy, sys
sys.modules["torch"] = sys.modules["dilated_attention"] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gpu_py_without_torch(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, str(GPU_PY), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_env_runs_without_torch():
    res = gpu_py_without_torch("env")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("gpu_env: python")
    assert "gpu_env: torch            not importable" in res.stdout and "gpu_env: ninja" in res.stdout
    res = gpu_py_without_torch("env", "--need-build")
    assert res.returncode == 3, res.stdout + res.stderr
    assert "gpu_env: cannot build: torch cannot be imported" in res.stdout


def test_testlog_runs_without_torch_on_a_one_process_crash_and_a_finished_run(tmp_path):
    # Without xdist the crash ends pytest: the test on the open line is the one that crashed.
    crash = tmp_path / "crash.log"
    crash.write_text(
        "collecting ... collected 12 items / 3 deselected / 9 selected\n\n"
        "tests/cuda/test_cuda.py::test_a[0] PASSED                                    [ 11%]\n"
        "tests/cuda/test_cuda.py::test_b SKIPPED (needs a CUDA GPU)                   [ 22%]\n"
        "tests/cuda/test_cuda.py::test_c[x-1] Fatal Python error: Aborted\n\n"
        "Current thread 0x00007fad5c1c1b80 (most recent call first):\n"
        '  File "/w/tests/cuda/test_cuda.py", line 40 in _helper\n'
        '  File "/w/tests/cuda/test_cuda.py", line 44 in test_c\n'
    )
    res = gpu_py_without_torch("testlog", "crashed", crash)
    assert res.returncode == 0 and res.stdout.splitlines() == ["tests/cuda/test_cuda.py::test_c[x-1]"], res
    res = gpu_py_without_torch("testlog", "summary", crash)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert "2 results so far for 9 tests: 1 passed, 1 skipped" in text
    assert "CRASHED tests/cuda/test_cuda.py::test_c[x-1] (Fatal Python error: Aborted)" in text
    assert "RUNNING" not in text
    assert "Fatal Python error: Aborted -- in tests/cuda/test_cuda.py line 44 in test_c; innermost" in text
    # A finished run: pytest's count, the failures with their messages, the skip reasons, the slowest tests.
    done = tmp_path / "done.log"
    done.write_text(
        "[gw0] [ 50%] FAILED tests/cuda/test_cuda.py::test_x[a]\n"
        "[gw1] [100%] PASSED tests/cuda/test_cuda.py::test_y\n"
        "============================= slowest 25 durations =============================\n"
        "12.50s call     tests/cuda/test_cuda.py::test_y\n"
        "=========================== short test summary info ============================\n"
        "FAILED tests/cuda/test_cuda.py::test_x[a] - AssertionError: out differs\n"
        "SKIPPED [3] tests/cuda/test_cuda.py:10: needs a CUDA GPU\n"
        "=================== 1 failed, 1 passed in 200.12s (0:03:20) ====================\n"
    )
    text = gpu_py_without_torch("testlog", "summary", done).stdout
    assert text.splitlines()[3:6] == [
        "pytest: 1 failed, 1 passed in 200.12s (0:03:20)",
        "FAILED tests/cuda/test_cuda.py::test_x[a] - AssertionError: out differs",
        "SKIPPED [3] tests/cuda/test_cuda.py:10: needs a CUDA GPU",
    ]
    assert (
        "## slowest tests (--durations)" in text and "12.50s call     tests/cuda/test_cuda.py::test_y" in text
    )
    res = gpu_py_without_torch("testlog", "crashed", done)
    assert res.returncode == 0 and res.stdout == ""
    # A log that cannot be read, and a bad --max, are errors that name them.
    res = gpu_py_without_torch("testlog", "summary", tmp_path / "nope.log")
    assert res.returncode == 1 and "nope.log" in res.stderr
    res = gpu_py_without_torch("testlog", "crashed", done, "--max", "0")
    assert res.returncode == 2 and "--max: must be a whole number >= 1, got '0'" in res.stderr


def test_gpu_py_usage_errors_and_the_profile_dry_run():
    """A missing subcommand or a bad value is a usage error (exit status 2) naming it; the profile
    subcommand's dry run runs every family, head dim and mask on tiny CPU inputs."""
    for args, message in [
        ((), "required: {env,testlog,smoke,profile}"),
        (("smoke", "--cases", "huge"), "invalid choice: 'huge'"),
        (("profile", "--seq-len", "0"), "--seq-len: must be a whole number >= 1, got '0'"),
        (("profile", "--head-dims", "64", "x"), "--head-dims: must be a whole number >= 1, got 'x'"),
    ]:
        res = subprocess.run(
            [sys.executable, str(GPU_PY), *args], capture_output=True, text=True, timeout=120
        )
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr)
    res = subprocess.run(
        [
            sys.executable,
            str(GPU_PY),
            "profile",
            "--dry-run",
            "--head-dims",
            "32",
            "64",
            "--causal",
            "0",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    ran = [line for line in res.stdout.splitlines() if line.endswith("forward and backward ran")]
    assert len(ran) == 8 and ran[0].startswith("gpu_profile: sm80 N=256 H=16 D=32 causal=False"), ran
    assert ran[-1].startswith("gpu_profile: sm90 N=256 H=16 D=64 causal=True torch.float32"), ran


# ----------------------------------------------------------------------------------------------
# scripts/gpu.py smoke on CPU tensors
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke():
    yield load_script(GPU_PY)
    del sys.modules["gpu"]


def test_smoke_cases_cover_what_the_check_promises(smoke):
    large = smoke.large_cases()
    assert {c.dtype for c in large} == {"bfloat16", "float32", "float64"}
    for c in large:
        assert c.elements > 2**31, c.name
        assert c.slices and all(n1 - n0 >= math.lcm(*c.segs) for _, _, n0, n1 in c.slices)
        # A slice reaches the far end, where 32-bit offsets would have overflowed.
        assert max(((b1 - 1) * c.N + n1) * c.Hq * c.D for _, b1, _, n1 in c.slices) == c.elements
    assert any(c.B == 64 for c in large) and any(
        c.B == 64 and c.dtype == "float64" for c in smoke.small_cases()
    )
    tc = [c for c in smoke.sanitize_cases() if c.dtype in ("float16", "bfloat16") and not c.env]
    simt = [c for c in smoke.sanitize_cases() if c.dtype in ("float32", "float64") or c.env]
    assert any(32 <= c.D <= 256 and c.D % 8 == 0 for c in tc) and any(c.D == 256 for c in tc)  # smem opt-in
    assert {"float32", "float64"} <= {c.dtype for c in simt}
    assert any(c.env.get("DILATED_ATTENTION_CUDA_SIMT") == "1" for c in simt)
    assert all(c.backward for c in smoke.sanitize_cases())
    # The sm90 kernels: every padded head dim (both swizzles), both 16-bit dtypes, under the env.
    sm90 = smoke.sm90_cases()
    padded = {next(p for p in (32, 64, 96, 128, 192, 256) if c.D <= p) for c in sm90}
    assert padded == {32, 64, 96, 128, 192, 256} and any(c.D == 40 for c in sm90)  # 40: zero columns
    assert {c.dtype for c in sm90} == {"float16", "bfloat16"}
    assert all(c.env.get("DILATED_ATTENTION_CUDA_SM90") == "1" and c.backward for c in sm90)
    assert any(c.env.get("DILATED_ATTENTION_CUDA_TMA") == "0" for c in sm90)  # the cp.async path too
    assert any(c.env.get("DILATED_ATTENTION_CUDA_SM90") == "1" for c in smoke.sanitize_cases())


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
    misaligned = smoke.Case("bad", 1, 64, 1, 1, 8, [16], [1], False, "float64", [(0, 1, 8, 64)])
    with pytest.raises(ValueError, match=r"slice \[8, 64\) is not aligned"):
        smoke.check_case(misaligned, device="cpu")


def test_smoke_error_cases_raise_and_report_a_dead_process(smoke, capsys, monkeypatch):
    """The refused calls raise their errors on the CPU; a child process that dies is reported with
    the call it was making, and one that got the wrong error with what it got."""
    assert smoke.run_error_cases(["cpu"]) == 0
    assert "PASS errors-cpu" in capsys.readouterr().out
    # meta tensors hold no data: the fake kernels refuse the arguments, not cu_seqlens' values
    assert smoke.error_child("meta", rounds=1) == 1
    out = capsys.readouterr().out
    assert "no error from decreasing cu_seqlens" in out and "no error from softmax_scale" not in out

    class Died:
        returncode = -11
        stdout = "call 1.softmax_scale 1e39\ncall 1.head dim 257\n"
        stderr = (
            "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
            '  File "gpu.py", line 312 in <lambda>\n'
        )

    monkeypatch.setattr("subprocess.run", lambda *a, **k: Died())
    assert smoke.run_error_cases(["cuda"]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL errors-cuda" in out and "signal 11 during call 1.head dim 257 (1 calls raised before it)" in out
    )
    assert "Segmentation fault" in out and "line 312 in <lambda>" in out  # the innermost frame


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


GPU_TEST_FILES = (
    "tests/cuda/test_cuda.py",
    "tests/ring/test_ring_pieces.py",
    "tests/cuda/test_decode_cuda.py",
    "tests/backends/test_backends_views.py",
)


def test_every_gpu_test_is_marked_cuda(tmp_path):
    """gpu_check.sh runs ``-m cuda``: a GPU test without the mark would never run on the GPU. A
    test needs the GPU when it carries the skip of ``common.needs_cuda_kernels``. One collection of
    the files the tests step runs."""
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
            *GPU_TEST_FILES,
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
    for test_file in GPU_TEST_FILES:
        assert any(r["id"].startswith(test_file) for r in needs), (
            f"no test of {test_file} is recognised as a GPU test: the check would pass vacuously"
        )
    unmarked = [r["id"] for r in needs if "cuda" not in r["marks"]]
    assert not unmarked, f"GPU tests without @pytest.mark.cuda (gpu_check.sh -m cuda skips them): {unmarked}"
    # and the other way round: a test marked cuda is skipped where there is no GPU
    loose = [r["id"] for r in rows if "cuda" in r["marks"] and r not in needs]
    assert not loose, f"tests marked cuda without the GPU skip of common.needs_cuda_kernels: {loose}"


# ----------------------------------------------------------------------------------------------
# benchmarks/bench_cuda.py, dry run on the CPU
# ----------------------------------------------------------------------------------------------


def test_bench_cuda_dry_run_measures_every_method(tmp_path, capsys):
    """Every line of the GPU benchmark runs on tiny CPU tensors: every method has a time for the
    forward and for forward+backward (the gather baseline's backward among them: the gather driver
    widens a multi-branch backward to float32, which the flash kernel refuses), and the table, CSV
    and plot are written."""
    import csv

    bench = load_script(ROOT / "benchmarks" / "bench_cuda.py")
    try:
        assert bench.main(["--dry-run", "--budget", "120", "--out", str(tmp_path / "b")]) == 0
    finally:
        del sys.modules["bench_cuda"]
    printed = capsys.readouterr().out
    assert "dry run" in printed and "native / gather+flash" in printed
    with open(tmp_path / "b.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["causal"], r["pass"]) for r in rows} == {
        (c, p) for c in ("yes", "no") for p in ("fwd", "fwd+bwd")
    }
    for r in rows:
        labels = ["native", "sdpa", "auto", "gather+flash", "dense cuDNN"]
        labels += ["flex"] if r["pass"] == "fwd" else []  # FlexAttention has no backward on the CPU
        for label in labels:
            assert r[f"{label} ms"] != "n/a" and float(r[f"{label} TFLOP/s"]) > 0, (label, r)
        ratios = ["native / sdpa", "native / gather+flash", "native / matmul", "pairs dense / dilated"]
        ratios += [f"{label} / dense" for label in labels if label != "dense cuDNN"]
        for ratio in ratios:
            assert r[ratio] != "n/a", (ratio, r)
    md = (tmp_path / "b.md").read_text()
    notes = md.split("Notes:")[1].strip().splitlines() if "Notes:" in md else []
    assert all(n.endswith("backend='auto' runs 'native' here") for n in notes), notes  # no method failed
    assert "max |out - native out|" in md
    # FlexAttention with the dilated pattern computes dilated attention: its forward agrees with
    # native's to bf16 rounding on the sampled positions.
    flex = [float(d.split("flex ")[1].split(",")[0]) for d in md.splitlines() if "flex " in d and "B=" in d]
    assert flex and max(flex) < 0.05, flex
    pytest.importorskip("matplotlib")
    assert (tmp_path / "b.png").stat().st_size > 0


def test_bench_cuda_dry_run_past_its_budget(tmp_path):
    """A spent budget leaves the measurements out with a note instead of overrunning the command."""
    bench = load_script(ROOT / "benchmarks" / "bench_cuda.py")
    try:
        argv = [
            "--dry-run",
            "--budget",
            "0.001",
            "--methods",
            "native",
            "dense",
            "--out",
            str(tmp_path / "b"),
        ]
        assert bench.main(argv) == 0
    finally:
        del sys.modules["bench_cuda"]
    md = (tmp_path / "b.md").read_text()
    assert "not run, the run's time budget is spent" in md


@needs_bash
def test_profile_step_keeps_ncu_key_lines_in_the_summary(tmp_path, fake_tools):
    out = tmp_path / "out"
    res, rows, summary = fake_tools("--steps", "build profile", out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert rows["profile"] == "pass"
    assert "## Nsight Compute" in summary and "tc_fwd_kernel<__nv_bfloat16, 128, false>" in summary
    assert "tc90_dkv_kernel<__nv_bfloat16, 128, false>" in summary and "23.45" in summary
    assert "Duration                         msecond        12.34" in summary
    assert "OPT   This kernel's theoretical occupancy" in summary and "a second line" not in summary
    assert not (out / "profile.log").exists()  # at most 8 files come back: its lines are in summary.md
    (fake_tools.bin_dir / "ncu").unlink()
    res, rows, summary = fake_tools("--steps", "build profile", tmp_path / "out2")
    assert res.returncode == 1 and rows["profile"] == "unavailable: ncu (Nsight Compute) not found"


# ----------------------------------------------------------------------------------------------
# scripts/sm90_registers.py and scripts/sm90_first_run.sh
# ----------------------------------------------------------------------------------------------

_PTXAS = """\
ptxas info    : Compiling entry function '_ZN17dilated_attention4cuda15tc90_fwd_kernelI6__halfLi64ELb0EEEvNS0_6ParamsENS0_7TmaMapsE' for 'sm_90a'
ptxas info    : Function properties for _ZN17dilated_attention4cuda15tc90_fwd_kernelI6__halfLi64ELb0EEEvNS0_6ParamsENS0_7TmaMapsE
    0 bytes stack frame, {spill} bytes spill stores, 0 bytes spill loads
ptxas info    : Used {fwd} registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN17dilated_attention4cuda14tc90_dq_kernelI6__halfLi64EEEvNS0_6ParamsENS0_7TmaMapsE' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN17dilated_attention4cuda13tc_fwd_kernelI6__halfLi64EEEvNS0_6ParamsE' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
{note}"""


@pytest.mark.parametrize(
    "fwd,spill,note,problem",
    [
        (168, 0, "", None),
        (128, 0, "", "128 registers at launch where setmaxnreg's split needs 168"),
        (168, 64, "", "64 bytes of spill stores"),
        (168, 0, "ptxas warning : (C7519) wgmma fence inserted", "C7519"),
    ],
)
def test_sm90_registers_reads_ptxas(tmp_path, capsys, fwd, spill, note, problem):
    """A tc90 kernel that starts with fewer registers than setmaxnreg's split needs would hang its
    consumers: the check names it (the sm80 kernel's 128 registers are no concern)."""
    mod = load_script(ROOT / "scripts" / "sm90_registers.py")
    log = tmp_path / "build.log"
    log.write_text(_PTXAS.format(fwd=fwd, spill=spill, note=note))
    rc = mod.main([str(log)])
    out = capsys.readouterr()
    assert "tc90_fwd_kernel" in out.out and "tc90_dq_kernel" in out.out and "tc_fwd_kernel" not in out.out
    if problem is None:
        assert rc == 0 and "every tc90 kernel (2) starts with 168 registers" in out.out, out
    else:
        assert rc == 1 and problem in out.err, out
    log.write_text("ptxas info    : Used 40 registers\n")
    assert mod.main([str(log)]) == 1
    assert "no tc90 kernel" in capsys.readouterr().err


@needs_bash
def test_sm90_first_run_dry_run(tmp_path):
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "sm90_first_run.sh"), str(tmp_path / "o"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"^([\w-]+) \((\d+) s\): ", r.stdout, flags=re.M)
    assert [s for s, _ in steps] == ["build", "registers", "smoke", "bench", "profile"], r.stdout
    assert sum(int(t) for _, t in steps) <= 575
    assert (
        "scripts/gpu.py smoke --cases sm90" in r.stdout and "--methods native native90 auto dense" in r.stdout
    )
    assert "**dry run**" in (tmp_path / "o" / "summary.md").read_text()
