"""The Python side of the GPU commands (scripts/gpu_check.sh, gpu_session.sh, sm90_first_run.sh),
one subcommand per question:

    python scripts/gpu.py env [--need-build]
        what this machine offers the build and the check, one line each; with --need-build, exit
        status 3 and one line per missing piece when the extension cannot be built here
    python scripts/gpu.py testlog summary|crashed LOG [--max N]
        the log of gpu_check.sh's tests step: summary.md's tests sections, or the crashed tests to
        rerun under a debugger (at most N, 3), one per line
    python scripts/gpu.py smoke [--cases ...] [--device cuda|cpu] [--seed N]
        the native op on the GPU against the same op on the CPU in float64; exit status 1 when a
        case fails, 2 without a GPU or kernels
    python scripts/gpu.py profile [--seq-len N] [--heads H] [--head-dims D...] [--causal 0|1...]
                                  [--families sm80 sm90] [--dry-run]
        one forward and backward of the native op per configuration, for Nsight Compute to read

env and testlog import only the standard library: they run before the extension is built, with
whatever interpreter the check uses, torch or not. smoke and profile import torch and the checkout's
op (built in place) when they start (``import_op``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata as md
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest.mock import patch

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------------
# env: Python, setuptools (>= 77 reads pyproject.toml's PEP 639 ``license`` field), ninja on PATH,
# nvcc, torch with its CUDA and cuDNN versions, the GPU, the driver, compute-sanitizer, pytest and
# pytest-xdist, expecttest. Imports nothing of the package (it may not be built yet).
# --------------------------------------------------------------------------------------------------

MIN_SETUPTOOLS = (77, 0)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def report() -> tuple[list[str], list[str]]:
    """(lines to print, what the build lacks)."""
    lines, missing = [f"python           {sys.version.split()[0]} ({sys.executable})"], []
    st = _version("setuptools")
    ok = st is not None and _tuple(st) >= MIN_SETUPTOOLS
    lines.append(f"setuptools       {st or 'not installed'} ({'ok' if ok else 'needs >= 77'})")
    if not ok:
        missing.append(
            f"setuptools {st or '(none)'}: the build needs setuptools >= 77 (pyproject.toml's license field, "
            "PEP 639); carry a wheel (pip download setuptools) and install it first"
        )
    ninja = shutil.which("ninja")
    lines.append(
        f"ninja            {ninja or 'not on PATH'} {_run([ninja, '--version']).strip() if ninja else ''}"
    )
    if not ninja:
        missing.append("ninja is not on PATH: torch's extension build needs it (pip install ninja)")
    nvcc = shutil.which("nvcc")
    m = re.search(r"release ([\d.]+)", _run([nvcc, "--version"])) if nvcc else None
    lines.append(f"nvcc             {m.group(1) if m else 'not found'} ({nvcc or 'not on PATH'})")
    if not nvcc:
        missing.append("nvcc is not on PATH (put the CUDA toolkit's bin/ on PATH or set CUDA_HOME)")
    try:
        import torch
    except ImportError as exc:
        missing.append(f"torch cannot be imported: {exc}")
        return [*lines, f"torch            not importable ({exc})"], missing
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(f"torch            {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {cudnn})")
    if torch.version.cuda is None:
        missing.append(
            f"torch {torch.__version__} is not a CUDA build: the CUDA kernels cannot link against it"
        )
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            mem = torch.cuda.get_device_properties(i).total_memory / 2**30
            lines.append(
                f"GPU {i}            {torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]}, {mem:.0f} GiB)"
            )
    else:
        lines.append("GPU              none visible to torch")
    smi = shutil.which("nvidia-smi")
    driver = (
        _run([smi, "--query-gpu=driver_version", "--format=csv,noheader"]).strip().splitlines() if smi else []
    )
    lines.append(f"driver           {driver[0] if driver else 'unknown (no nvidia-smi)'}")
    san = shutil.which("compute-sanitizer")
    lines.append(f"compute-sanitizer {san or 'not on PATH'}")
    lines.append(
        f"pytest           {_version('pytest') or 'not installed'}, pytest-xdist {_version('pytest-xdist') or 'no'}"
    )
    expect = _version("expecttest")
    lines.append(
        f"expecttest       {expect or 'not installed: the opcheck tests fail without it (carry a wheel)'}"
    )
    return lines, missing


def env_main(args: argparse.Namespace) -> int:
    lines, missing = report()
    for line in lines:
        print(f"gpu_env: {line}")
    if args.need_build and missing:
        for m in missing:
            print(f"gpu_env: cannot build: {m}")
        return 3
    return 0


# --------------------------------------------------------------------------------------------------
# testlog: reads the log of gpu_check.sh's tests step (pytest -v, with or without pytest-xdist).
# ``summary`` prints the sections of summary.md that come from tests.log: pytest's count (or, when
# the run was cut before pytest printed it, the count of the per-test lines so far and the tests
# still running), the failed, errored and crashed tests, the Python frames of every "Fatal Python
# error" (faulthandler), the skip reasons, the slowest tests (--durations) and the native
# backtraces that the backtrace step appended. ``crashed`` prints the tests to rerun under a
# debugger, one per line: the node id that pytest-xdist names for each crashed worker, else
# ``file::function`` from the faulthandler dump (its parameters are unknown there); one per test
# function. Only the standard library.
# --------------------------------------------------------------------------------------------------

# The line that the backtrace step writes before each rerun; pytest's own log ends there.
BACKTRACE_MARK = "===== gpu_check backtrace"
BACKTRACE_END = "----- gpu_check backtrace"  # "----- gpu_check backtrace 1: exit status 0"
OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_OUTCOME = "|".join(OUTCOMES)
_NODEID = r"[\w./-]+\.py::\S+"
# pytest-xdist -v: "[gw3] [ 12%] PASSED tests/cuda/test_cuda.py::test_x[a]"
XDIST_RESULT = re.compile(rf"^\[(gw\d+)\] \[\s*\d+%\] ({_OUTCOME}) ({_NODEID})")
# pytest -v: "tests/cuda/test_cuda.py::test_x[a] PASSED    [ 12%]" (SKIPPED may carry "(reason)")
PLAIN_RESULT = re.compile(rf"^({_NODEID}) ({_OUTCOME})\b.*\[\s*\d+%\]\s*$")
# pytest -v prints the node id when a test starts (xdist: its own line; without: the result follows)
STARTED = re.compile(rf"^({_NODEID})(?:\s|$)")
NODE_DOWN = re.compile(r"^\[(gw\d+)\] node down: (.*)$")
FATAL = re.compile(r"Fatal Python error: (.*)$")
FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)')
FINAL = re.compile(r"^(?:=+ )?((?:\d+ [a-z]+|no tests ran)(?:, \d+ [a-z]+)* in [\d.]+s\b.*?)(?: =+)?$")
# "8 workers [1234 items]" (xdist) or "collected 1300 items / 66 deselected / 1234 selected"
COLLECTED = re.compile(
    r"^(?:(\d+) workers \[(\d+) items?\]|(?:collecting \.\.\. )?collected (\d+) items?(.*))$"
)
SECTION = re.compile(r"^=+ (.*?) =+$")
FRAME_NO = re.compile(r"^#(\d+)\s")


@dataclass
class Crash:
    error: str  # "Segmentation fault"
    frame: tuple[str, int, str] | None = None  # (tests/test_x.py, line, test function)
    innermost: tuple[str, int, str] | None = None  # the first frame of the current thread
    nodeid: str | None = None  # when pytest named the test on the same line (no xdist)


@dataclass
class PytestLog:
    results: list[tuple[str, str]] = field(default_factory=list)  # (outcome, nodeid), in order
    started: list[str] = field(default_factory=list)
    crashed: list[tuple[str, str, str]] = field(default_factory=list)  # (nodeid, worker, why)
    fatal: list[Crash] = field(default_factory=list)
    final: str | None = None
    collected: int | None = None  # how many tests run
    short_summary: list[str] = field(default_factory=list)
    durations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # "maximum crashed workers reached"
    xdist: bool = False
    backtraces: list[tuple[str, list[str]]] = field(default_factory=list)  # (header, lines)


def _tests_path(path: str) -> str:
    """/work/main/tests/cuda/test_cuda.py -> tests/cuda/test_cuda.py (the node ids' form); an installed
    package's file from its package folder on (.../site-packages/torch/x.py -> torch/x.py)."""
    for mark in ("/tests/", "/site-packages/", "/dilated_attention/"):
        i = path.rfind(mark)
        if i >= 0:
            return path[i + (len(mark) if mark == "/site-packages/" else 1) :]
    return re.sub(r"^.*/lib/python3\.\d+t?/", "", path)  # the standard library


def _fatal_dump(error: str, lines: list[str], i: int) -> Crash:
    """The frames of the dump that starts at lines[i]: "Current thread 0x... (most recent call
    first):", then one "  File ..., line N in f" per frame."""
    crash = Crash(error)
    while i < len(lines) and not FATAL.search(lines[i]):
        if lines[i].startswith("Current thread"):
            i += 1
            while i < len(lines) and (f := FRAME.match(lines[i])):
                path, lineno, func = _tests_path(f.group(1)), int(f.group(2)), f.group(3)
                crash.innermost = crash.innermost or (path, lineno, func)
                name = path.rsplit("/", 1)[-1]
                if (
                    crash.frame is None
                    and path.startswith("tests/")
                    and name.startswith("test_")
                    and func.startswith("test")
                ):
                    crash.frame = (path, lineno, func)
                i += 1
            break
        i += 1
    return crash


def parse(text: str) -> PytestLog:
    log = PytestLog()
    lines = text.splitlines()
    cut = next((i for i, line in enumerate(lines) if line.startswith(BACKTRACE_MARK)), len(lines))
    pytest_lines, bt_lines = lines[:cut], lines[cut:]
    section = None
    down: dict[str, str] = {}  # worker -> why, until its crash report
    for i, line in enumerate(pytest_lines):
        if m := FATAL.search(line):
            # faulthandler writes to the worker's stderr, often after a line that pytest left open
            # ("tests/x.py::test_y " when a test starts, or a result line): the rest goes on below.
            crash = _fatal_dump(m.group(1).strip(), pytest_lines, i + 1)
            line = line[: m.start()]
            if (s := STARTED.match(line)) and not line[s.end() :].strip():
                crash.nodeid = s.group(1)
            log.fatal.append(crash)
        if m := SECTION.match(line):
            section = m.group(1)
            if (f := FINAL.match(line)) and not section.startswith("slowest"):
                log.final = f.group(1)
            continue
        if m := XDIST_RESULT.match(line):
            log.xdist = True
            outcome, nodeid = m.group(2), m.group(3)
            log.results.append((outcome, nodeid))
            if m.group(1) in down and outcome == "FAILED":
                log.crashed.append((nodeid, m.group(1), down.pop(m.group(1))))
            continue
        if m := NODE_DOWN.match(line):
            log.xdist = True
            down[m.group(1)] = m.group(2).strip()
            continue
        if "maximum crashed workers reached" in line or "crashed and worker restarting disabled" in line:
            log.notes.append(line.strip())
            continue
        if m := PLAIN_RESULT.match(line):
            log.results.append((m.group(2), m.group(1)))
            continue
        if m := STARTED.match(line):
            log.started.append(m.group(1))
            continue
        if m := COLLECTED.match(line.strip()):
            selected = re.search(r"(\d+) selected", m.group(4) or "")
            log.collected = int(m.group(2) or (selected.group(1) if selected else m.group(3)))
            continue
        if f := FINAL.match(line.strip()):  # -q: "12 passed in 1.0s", no rule around it
            log.final = f.group(1)
            continue
        if section and section.startswith("slowest"):
            if line.strip():
                log.durations.append(line.rstrip())
            continue
        if section == "short test summary info" and line.strip():
            log.short_summary.append(line.rstrip())
            continue
    if not log.xdist:  # one process: the test that was running is the one that crashed
        for crash in log.fatal:
            if crash.nodeid:
                log.crashed.append((crash.nodeid, "", f"Fatal Python error: {crash.error}"))
    # The backtrace step's sections: a header line, then the debugger's output.
    for line in bt_lines:
        if line.startswith(BACKTRACE_MARK):
            log.backtraces.append((line, []))
        elif log.backtraces:
            log.backtraces[-1][1].append(line)
    return log


def _function(nodeid: str) -> tuple[str, str]:
    """tests/test_x.py::test_y[a-1] -> (tests/test_x.py, test_y)."""
    path, _, rest = nodeid.partition("::")
    return path, rest.rsplit("::", 1)[-1].split("[", 1)[0]


def rerun_targets(log: PytestLog, limit: int = 3) -> list[str]:
    targets, seen = [], set()
    candidates = [nodeid for nodeid, _, _ in log.crashed]
    candidates += [f"{c.frame[0]}::{c.frame[2]}" for c in log.fatal if c.frame]
    for nodeid in candidates:
        key = _function(nodeid)
        if key not in seen:
            seen.add(key)
            targets.append(nodeid)
    return targets[:limit]


def _counts(results: list[tuple[str, str]]) -> str:
    words = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}
    counts: dict[str, int] = {}
    for outcome, _ in results:
        key = words.get(outcome, outcome.lower())
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def _frame(frame: tuple[str, int, str] | None) -> str:
    return f"{frame[0]} line {frame[1]} in {frame[2]}" if frame else "?"


def summary(log: PytestLog, max_lines: int = 60, max_frames: int = 30) -> str:
    out = ["## tests", "", "```"]
    finished = {nodeid for _, nodeid in log.results}
    if log.final:
        out.append(f"pytest: {log.final}")
    else:
        gone = finished | {nodeid for nodeid, _, _ in log.crashed}
        running = [n for n in dict.fromkeys(log.started) if n not in gone]
        out.append(
            "pytest did not finish (cut by the time limit, or it crashed): "
            f"{len(log.results)} results so far"
            + (f" for {log.collected} tests" if log.collected is not None else "")
            + f": {_counts(log.results)}"
        )
        for nodeid in running[:20]:
            out.append(f"RUNNING {nodeid}  (no result when the log ends)")
    crashed = {nodeid: (worker, why) for nodeid, worker, why in log.crashed}
    short = {}
    for line in log.short_summary:
        word, _, rest = line.partition(" ")
        if word in ("FAILED", "ERROR"):
            short.setdefault((word, rest.split(" - ", 1)[0]), line)
    listed = []
    for outcome, nodeid in log.results:
        if outcome in ("FAILED", "ERROR"):
            if nodeid in crashed:
                worker, why = crashed[nodeid]
                listed.append(f"CRASHED {nodeid} ({worker + ': ' if worker else ''}{why})")
            else:
                listed.append(short.get((outcome, nodeid), f"{outcome} {nodeid}"))
    listed += [line for (_, nodeid), line in short.items() if nodeid not in finished]  # -q: no per-test lines
    for nodeid, (worker, why) in crashed.items():  # no result line: pytest died with the test
        if nodeid not in finished:
            listed.append(f"CRASHED {nodeid} ({worker + ': ' if worker else ''}{why})")
    listed = list(dict.fromkeys(listed))
    out += listed[:max_lines]
    if len(listed) > max_lines:
        out.append(f"... and {len(listed) - max_lines} more (tests.log)")
    if log.crashed:
        workers = sum(1 for _, w, _ in log.crashed if w)
        if workers:
            out.append(f"{workers} crashed pytest-xdist worker(s) (each replaced; its test counts as failed)")
    fatal: dict[str, int] = {}
    for crash in log.fatal:
        where = _frame(crash.frame)
        inner = (
            f"; innermost Python frame: {_frame(crash.innermost)}" if crash.innermost != crash.frame else ""
        )
        line = f"Fatal Python error: {crash.error} -- in {where}{inner}"
        fatal[line] = fatal.get(line, 0) + 1
    out += [line + (f" (x{n})" if n > 1 else "") for line, n in fatal.items()]
    out += log.notes
    skipped = [line for line in log.short_summary if line.startswith("SKIPPED")]
    out += skipped[:15]
    if len(skipped) > 15:
        out.append(f"... and {len(skipped) - 15} more skip reasons (tests.log)")
    out.append("```")
    if log.durations:
        out += ["", "## slowest tests (--durations)", "", "```", *log.durations[:40], "```"]
    if log.backtraces:
        out += ["", "## native backtraces of the crashed tests (the full output: tests.log)", "", "```"]
        for header, lines in log.backtraces:
            out.append(header)
            frames, keep = [], False
            for line in lines:
                if m := FRAME_NO.match(line):
                    keep = int(m.group(1)) <= max_frames
                    if keep:
                        frames.append(line[:300])
                elif keep and line.startswith("    ") and line.strip():
                    frames.append(line[:300])  # a frame's continuation ("    at file:line")
                elif not line.startswith("    "):
                    keep = False
            signal = [line for line in lines if "received signal" in line or "CUDA Exception" in line]
            rest = [line for line in lines if line.strip() and not line.startswith(BACKTRACE_END)]
            if not frames and rest:  # no stack: the test passed alone, or the debugger failed
                frames = ["(no frames) " + " | ".join(rest[-4:])[:600]]
            out += signal[:3] + frames + [line for line in lines if line.startswith(BACKTRACE_END)]
        out.append("```")
    return "\n".join(out)


def testlog_main(args: argparse.Namespace) -> int:
    try:
        with open(args.log, encoding="utf-8", errors="replace") as f:
            log = parse(f.read())
    except OSError as e:
        print(f"gpu_testlog: {e}", file=sys.stderr)
        return 1
    if args.what == "crashed":
        for nodeid in rerun_targets(log, args.max):
            print(nodeid)
    else:
        print(summary(log))
    return 0


# --------------------------------------------------------------------------------------------------
# smoke: each case runs ``torch.ops.dilated_attention.fwd`` and ``.bwd`` on the device, then the
# CPU op in float64 on the same inputs (upcast), and compares out, lse, dq, dk and dv with a
# tolerance for the case's dtype. The CPU op is itself tested against the dense float64 reference
# (tests/op/test_op.py). Prints one line per case.
#
# * small: float64 and bfloat16 problems, among them B = 64 and LongNet-shaped branches.
# * large: inputs of more than 2^31 elements (bfloat16 on the tensor-core kernels, float32 and
#   float64 on the SIMT kernels; one with a large batch, others with a long sequence), where any
#   32-bit index arithmetic would overflow. The CPU op then checks aligned blocks of positions at
#   both ends (a block whose ends are multiples of every segment length holds whole segments of
#   every branch, so its rows depend on that block alone). Where the backward does not fit in the
#   GPU's memory (float64 on an 80 GB GPU), the case runs its forward only and says so.
# * sanitize: tiny forward + backward runs of both kernel families (tensor-core bf16/fp16, SIMT
#   fp32/fp64/bf16, a forced SIMT run and a forced tiling), short enough for compute-sanitizer.
# * sm90: the sm90 kernels (wgmma, ``DILATED_ATTENTION_CUDA_SM90=1``), forward and backward, on
#   float16 and bfloat16 problems of every padded head dim; on a compute capability 9.0 GPU the
#   first case also checks (torch.profiler) that the wgmma kernel ran, so that a build without
#   sm_90a code fails instead of passing on the sm80 kernel.
# * errors: calls the op must refuse (a softmax_scale the scores cannot hold, head dim 257, a
#   decreasing ``cu_seqlens``, dropout_p = 1.5), each round led by one of torch's own refused calls
#   (``torch.mm`` of mismatched shapes) as a control; three rounds on the CPU and then on the
#   device, each device in a process of its own: every call must raise its error, and a process
#   that dies is reported with the call it was making and the end of its Python traceback.
#
# ``--device cpu`` runs the "device" op on the CPU too: it checks the logic without a GPU.
# --------------------------------------------------------------------------------------------------


@functools.cache
def import_op() -> ModuleType:
    """torch, with the checkout's op registered (``torch.ops.dilated_attention``, built in place):
    what smoke and profile run on, imported when they first need it."""
    sys.path.insert(0, str(ROOT))
    import torch

    import dilated_attention.op  # noqa: F401  (registers torch.ops.dilated_attention)

    return torch


# Per dtype: (atol = rtol) for out and lse, and for the gradients, against the float64 CPU op.
TOLERANCE = {
    "float64": (1e-9, 1e-9),
    "float32": (2e-4, 2e-3),
    "bfloat16": (3e-2, 1e-1),
    "float16": (1e-2, 5e-2),
}

TWO_POW_31 = 2**31

# The environment of the sm90 cases: the forward on the warpgroup kernel (tc90_kernels.cuh).
SM90 = {"DILATED_ATTENTION_CUDA_SM90": "1"}


@dataclass
class Case:
    """One problem: shapes, branches, dtype, and the slices the CPU op checks."""

    name: str
    B: int
    N: int
    Hq: int
    Hkv: int
    D: int
    segs: list[int]
    rates: list[int]
    causal: bool
    dtype: str  # a torch dtype's name: "bfloat16"
    # (batch start, batch end, position start, position end) to compare; empty: everything.
    slices: list[tuple[int, int, int, int]] = field(default_factory=list)
    backward: bool = True
    env: dict[str, str] = field(default_factory=dict)  # e.g. a forced tiling or kernel family

    @property
    def elements(self) -> int:
        """Elements of q (the largest input)."""
        return self.B * self.N * self.Hq * self.D

    def bytes_needed(self) -> int:
        """Device memory the case holds at once (inputs, outputs, gradients), roughly."""
        item = getattr(import_op(), self.dtype).itemsize
        big = self.B * self.N * self.Hq * self.D
        small = self.B * self.N * self.Hkv * self.D
        n_big, n_small = (4, 4) if self.backward else (2, 2)  # q out [dout dq] / k v [dk dv]
        return item * (n_big * big + n_small * small) + 8 * self.B * self.Hq * self.N * 2

    def describe(self) -> str:
        return (
            f"B={self.B} N={self.N} Hq={self.Hq} Hkv={self.Hkv} D={self.D} {self.dtype} w={self.segs} r={self.rates} "
            f"{'causal' if self.causal else 'full'} ({self.elements:.3g} elements)"
        )


def _block(segs: Sequence[int]) -> int:
    """The least common multiple of the segment lengths: blocks of it hold whole segments."""
    return math.lcm(*segs)


def small_cases() -> list[Case]:
    return [
        Case("b64-gqa-f64", 64, 64, 4, 2, 32, [16, 32], [1, 2], True, "float64"),
        Case("longnet-f64", 2, 300, 8, 2, 64, [32, 64, 128, 256], [1, 2, 4, 8], True, "float64"),
        Case("irregular-f64", 1, 1000, 2, 1, 128, [100, 1000], [1, 7], False, "float64"),
        Case("uncovered-f64", 3, 40, 4, 4, 16, [8], [4], False, "float64"),
        Case("b64-bf16", 64, 128, 8, 8, 64, [32, 64], [1, 2], True, "bfloat16"),
        Case("longnet-bf16-d128", 1, 1024, 4, 2, 128, [128, 256, 512], [1, 2, 4], True, "bfloat16"),
    ]


def large_cases(
    min_elements: int = TWO_POW_31 + 1, heads: int = 32, kv_heads: int = 4, head_dim: int = 256
) -> list[Case]:
    """Problems whose q has at least ``min_elements`` elements (default: more than 2^31)."""
    H, Hkv, D = heads, kv_heads, head_dim
    # A large batch: batch 63's offsets are beyond 2^31. The CPU op checks an aligned block of
    # positions at each end: the first rows of batch 0 and the last rows of batch 63.
    B, segs = 64, [64, 128]
    blk = _block(segs)
    N = _round_up(math.ceil(min_elements / (B * H * D)), blk)
    ends = [(0, 1, 0, blk), (B - 1, B, N - blk, N)]
    out = [Case("large-batch-bf16", B, N, H, Hkv, D, segs, [1, 2], True, "bfloat16", ends)]
    # A long sequence: positions beyond 2^31 / (H D) in one batch element.
    for name, dtype, causal in [
        ("large-seq-f32", "float32", False),
        ("large-seq-f64", "float64", True),
    ]:
        B, segs = 1, [128, 256]
        blk = _block(segs)
        N = _round_up(math.ceil(min_elements / (B * H * D)), blk)
        out.append(
            Case(name, B, N, H, Hkv, D, segs, [1, 2], causal, dtype, [(0, 1, 0, blk), (0, 1, N - blk, N)])
        )
    return out


def sanitize_cases() -> list[Case]:
    """Tiny runs of every kernel (forward, dq, dk/dv, delta) of both families."""
    forced_tiling = {"DILATED_ATTENTION_CUDA_TILING": "4,1"}
    forced_simt = {"DILATED_ATTENTION_CUDA_SIMT": "1"}
    bf16, f16, f32, f64 = "bfloat16", "float16", "float32", "float64"
    return [
        Case("tc-bf16-gqa-causal", 2, 150, 4, 2, 64, [16, 64], [1, 2], True, bf16),
        Case("tc-fp16-d256-optin", 1, 80, 2, 1, 256, [32, 64], [1, 2], False, f16),
        Case("tc-bf16-tiling-4-1", 1, 157, 4, 2, 64, [12, 48, 96], [1, 3, 4], True, bf16, env=forced_tiling),
        Case("simt-f32-d40", 2, 90, 2, 1, 40, [7, 200], [1, 5], True, f32),
        Case("simt-f64-d24", 1, 61, 4, 2, 24, [8, 32], [1, 2], False, f64),
        Case("simt-bf16-d24", 1, 61, 4, 2, 24, [8, 32], [1, 2], True, bf16),
        Case("simt-forced-bf16", 1, 100, 2, 2, 64, [16, 32], [1, 2], True, bf16, env=forced_simt),
        Case("sm90-bf16-gqa-causal", 2, 150, 4, 2, 64, [16, 64], [1, 2], True, bf16, env=SM90),
        Case("sm90-f16-d96", 1, 90, 2, 1, 96, [7, 200], [1, 5], False, f16, env=SM90),
    ]


def sm90_cases() -> list[Case]:
    """The sm90 kernels at every padded head dim (32 and 96: the 64-byte swizzle; 40 padded to 64),
    GQA, causal, irregular branches, uncovered rows, a batch."""
    bf16, f16 = "bfloat16", "float16"
    return [
        Case("sm90-bf16-d128-longnet", 1, 1024, 4, 2, 128, [128, 256, 512], [1, 2, 4], True, bf16, env=SM90),
        Case("sm90-f16-d40-b8", 8, 300, 4, 4, 40, [32, 64, 128, 256], [1, 2, 4, 8], False, f16, env=SM90),
        Case("sm90-bf16-d96-irregular", 1, 1000, 2, 1, 96, [100, 1000], [1, 7], True, bf16, env=SM90),
        Case("sm90-bf16-d32-uncovered", 2, 77, 4, 4, 32, [16], [4], False, bf16, env=SM90),
        Case("sm90-f16-d192", 1, 400, 6, 3, 192, [50, 100, 200, 400], [1, 2, 3, 4], True, f16, env=SM90),
        Case("sm90-bf16-d256", 1, 257, 2, 1, 256, [64, 256], [1, 2], False, bf16, env=SM90),
        Case(
            "sm90-bf16-d128-cp-async",  # no tensor maps: every chunk by cp.async
            1,
            1024,
            4,
            2,
            128,
            [128, 256, 512],
            [1, 2, 4],
            True,
            bf16,
            env={**SM90, "DILATED_ATTENTION_CUDA_TMA": "0"},
        ),
    ]


def sm90_kernel_ran() -> bool | None:
    """Whether the forward of an sm90 case runs the wgmma kernel (tc90_fwd_kernel), by the CUDA
    kernels torch.profiler records; None where the GPU is not compute capability 9.0."""
    torch = import_op()
    if torch.cuda.get_device_capability()[0] != 9:
        return None
    from torch.profiler import ProfilerActivity, profile

    q = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16)
    with patch.dict(os.environ, SM90), profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.dilated_attention.fwd(q, q, q, [64, 128], [1, 2], True, 0.125)
        torch.cuda.synchronize()
    return any("tc90_fwd_kernel" in e.key for e in prof.key_averages())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


OpFn = Callable[..., tuple[Any, ...]]


def run_op(q, k, v, dout, dlse_fn, segs, rates, causal, scale, backward=True):
    """Forward and (optionally) backward of the native op: (out, lse[, dq, dk, dv], dlse)."""
    torch = import_op()
    out, lse = torch.ops.dilated_attention.fwd(q, k, v, segs, rates, causal, scale)
    if not backward:
        return out, lse, None, None, None, None
    dlse = dlse_fn(lse)
    dq, dk, dv = torch.ops.dilated_attention.bwd(dout, q, k, v, out, lse, dlse, segs, rates, causal, scale)
    return out, lse, dq, dk, dv, dlse


def _inputs(case: Case, device: str, seed: int):
    torch = import_op()
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    shape_q = (case.B, case.N, case.Hq, case.D)
    shape_k = (case.B, case.N, case.Hkv, case.D)
    q = torch.randn(shape_q, generator=g, device=device, dtype=dtype)
    k = torch.randn(shape_k, generator=g, device=device, dtype=dtype)
    v = torch.randn(shape_k, generator=g, device=device, dtype=dtype)
    dout = torch.randn(shape_q, generator=g, device=device, dtype=dtype) if case.backward else None
    return q, k, v, dout


def _dlse(lse, seed: int):
    """A gradient for lse: random where the row is covered, 0 where lse is -inf (uncovered rows)."""
    torch = import_op()
    g = torch.Generator(device=lse.device).manual_seed(seed + 7)
    d = torch.randn(lse.shape, generator=g, device=lse.device, dtype=lse.dtype)
    return torch.where(torch.isfinite(lse), d, torch.zeros_like(d))


def check_case(case: Case, device: str = "cuda", seed: int = 0, op: OpFn = run_op) -> dict[str, float]:
    """Runs ``case`` on ``device`` with ``op`` and compares it, slice by slice, with the float64 CPU op.

    Returns the largest absolute error per output; raises AssertionError naming the output, the
    slice and the error when a comparison fails.
    """
    torch = import_op()
    with patch.dict(os.environ, case.env):  # restored after the case
        q, k, v, dout = _inputs(case, device, seed)
        scale = case.D**-0.5
        res = op(
            q,
            k,
            v,
            dout,
            lambda lse: _dlse(lse, seed),
            case.segs,
            case.rates,
            case.causal,
            scale,
            case.backward,
        )
        if device == "cuda":
            torch.cuda.synchronize()
    out, lse, dq, dk, dv, dlse = res
    tol_out, tol_grad = TOLERANCE[case.dtype]
    errors: dict[str, float] = {}
    for b0, b1, n0, n1 in case.slices or [(0, case.B, 0, case.N)]:
        blk = _block(case.segs)
        if not (n0 % blk == 0 and (n1 % blk == 0 or n1 == case.N)):
            raise ValueError(f"{case.name}: slice [{n0}, {n1}) is not aligned to the segment lengths ({blk})")

        def cut(t, b0=b0, b1=b1, n0=n0, n1=n1):
            return t[b0:b1, n0:n1].detach().to("cpu", torch.float64).contiguous()

        def cut_lse(t, b0=b0, b1=b1, n0=n0, n1=n1):
            return t[b0:b1, :, n0:n1].detach().to("cpu", torch.float64).contiguous()

        q64, k64, v64 = cut(q), cut(k), cut(v)
        ref_out, ref_lse = torch.ops.dilated_attention.fwd(
            q64, k64, v64, case.segs, case.rates, case.causal, scale
        )
        got = {"out": (cut(out), ref_out, tol_out), "lse": (cut_lse(lse), ref_lse, tol_out)}
        if case.backward:
            rq, rk, rv = torch.ops.dilated_attention.bwd(
                cut(dout),
                q64,
                k64,
                v64,
                ref_out,
                ref_lse,
                cut_lse(dlse),
                case.segs,
                case.rates,
                case.causal,
                scale,
            )
            got.update(
                {"dq": (cut(dq), rq, tol_grad), "dk": (cut(dk), rk, tol_grad), "dv": (cut(dv), rv, tol_grad)}
            )
        where = f"batch [{b0}, {b1}) positions [{n0}, {n1})"
        for name, (a, e, tol) in got.items():
            both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
            diff = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
            bad = ~(diff <= tol + tol * e.abs().masked_fill(both_inf, 0))  # NaN counts as bad
            err = float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0
            errors[name] = max(errors.get(name, 0.0), err)
            if bool(bad.any()):
                idx = tuple(int(i) for i in bad.nonzero()[0])
                raise AssertionError(
                    f"{case.name}: {name} differs from the float64 CPU op at {where}, index {idx}: "
                    f"{float(a[idx])!r} vs {float(e[idx])!r} (tolerance {tol:g} abs + rel; max |diff| {err:.3g})"
                )
    return errors


def run_cases(cases: list[Case], device: str, seed: int = 0) -> tuple[int, int]:
    """Runs and reports every case: (failures, cases skipped for lack of device memory)."""
    torch = import_op()
    failures = skipped = 0
    for case in cases:
        start = time.perf_counter()
        if device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            need = case.bytes_needed()
            if need > 0.9 * free and case.backward:
                case.backward = False  # forward only where the backward does not fit
                print(
                    f"  {case.name}: backward needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} free: forward only"
                )
                need = case.bytes_needed()
            if need > 0.9 * free:
                print(
                    f"SKIP {case.name}: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free; {case.describe()}"
                )
                skipped += 1
                continue
        print(f"RUN {case.name}", flush=True)  # the last such line names a case that hangs
        try:
            errors = check_case(case, device, seed)
            status = "PASS"
        except (AssertionError, RuntimeError) as exc:  # a mismatch, or the op's own error
            errors, status = {}, f"FAIL: {exc}"
            failures += 1
        seconds = time.perf_counter() - start
        errs = " ".join(f"{k}={v:.2g}" for k, v in errors.items())
        print(f"{status.split(':')[0]} {case.name} ({seconds:.1f} s) {case.describe()} max|diff| {errs}")
        if status != "PASS":
            print(f"  {status}")
        sys.stdout.flush()
        if device == "cuda":
            torch.cuda.empty_cache()
    return failures, skipped


# Calls the op must refuse: (what, error type, a part of the message, the call on ``device``).
def _error_calls(device: str) -> list[tuple[str, type, str, Callable[[], object]]]:
    torch = import_op()
    ops = torch.ops.dilated_attention
    q = torch.randn(1, 8, 2, 32, device=device)
    big = torch.randn(1, 8, 2, 257, device=device)
    cu = torch.tensor([0, 6, 3, 8], dtype=torch.int32, device=device)
    a = torch.ones(2, 3, device=device)
    return [
        # torch's own refusal first: if it crashes too, C++ exceptions fail in this process whatever
        # raises them (the environment), not the op's code
        ("torch.mm of (2, 3) by (2, 3)", RuntimeError, "cannot be multiplied", lambda: torch.mm(a, a)),
        ("softmax_scale 1e39", ValueError, "softmax_scale", lambda: ops.fwd(q, q, q, [4], [1], False, 1e39)),
        ("head dim 257", RuntimeError, "head dim", lambda: ops.fwd(big, big, big, [4], [1], False, 1.0)),
        (
            "decreasing cu_seqlens",
            RuntimeError,
            "non-decreasing",
            lambda: ops.varlen_fwd(q[0], q[0], q[0], cu, 8, [4], [1], False, 1.0),
        ),
        (
            "dropout_p 1.5",
            ValueError,
            "dropout_p",
            lambda: ops.fwd(q, q, q, [4], [1], False, 1.0, False, 1.5),
        ),
    ]


def error_child(device: str, rounds: int = 3) -> int:
    """Makes every refused call ``rounds`` times on ``device``, printing each before it is made."""
    bad = 0
    for r in range(rounds):
        for what, kind, text, call in _error_calls(device):
            print(f"call {r + 1}.{what}", flush=True)
            try:
                call()
                print(f"  no error from {what}", flush=True)
                bad += 1
            except kind as exc:
                if text not in str(exc):
                    print(f"  {what}: {type(exc).__name__} without {text!r}: {exc}", flush=True)
                    bad += 1
            except Exception as exc:  # the wrong type
                print(f"  {what}: {type(exc).__name__} instead of {kind.__name__}: {exc}", flush=True)
                bad += 1
    return 1 if bad else 0


def run_error_cases(devices: Sequence[str]) -> int:
    """Each device's refused calls in a child process; returns the number of devices that failed."""
    failures = 0
    for device in devices:
        start = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-X", "faulthandler", __file__, "smoke", "--error-child", device],
            capture_output=True,
            text=True,
            check=False,
        )
        calls = [line[5:] for line in res.stdout.splitlines() if line.startswith("call ")]
        problems = [line.strip() for line in res.stdout.splitlines() if line.startswith("  ")]
        seconds = time.perf_counter() - start
        if res.returncode == 0:
            print(f"PASS errors-{device} ({seconds:.1f} s) {len(calls)} refused calls, each raised its error")
            continue
        failures += 1
        if res.returncode < 0:
            died = f"the process died with signal {-res.returncode} during call {calls[-1] if calls else '?'}"
            print(f"FAIL errors-{device} ({seconds:.1f} s) {died} ({len(calls) - 1} calls raised before it)")
        else:
            print(
                f"FAIL errors-{device} ({seconds:.1f} s) "
                + "; ".join(problems or ["exit status " + str(res.returncode)])
            )
        err = (res.stderr or "").strip().splitlines()
        fatal = [i for i, line in enumerate(err) if line.startswith("Fatal Python error")]
        tail = err[fatal[0] : fatal[0] + 8] if fatal else err[-5:]  # the innermost frames of a crash
        for line in tail:
            print(f"  {line}")
        sys.stdout.flush()
    return failures


def smoke_main(args: argparse.Namespace) -> int:
    if args.error_child:
        return error_child(args.error_child)
    torch = import_op()
    from dilated_attention.op import has_kernel

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA GPU is available (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if not has_kernel(args.device):
        print(f"gpu_smoke: the extension has no {args.device.upper()} kernels", file=sys.stderr)
        return 2
    if args.device == "cuda":
        print(
            f"gpu_smoke on {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    sets = {"small": small_cases, "large": large_cases, "sanitize": sanitize_cases, "sm90": sm90_cases}
    failures = skipped = total = 0
    for name in args.cases:
        if name == "errors":
            print("-- errors cases")
            devices = ["cpu"] if args.device == "cpu" else ["cpu", args.device]
            total += len(devices)
            failures += run_error_cases(devices)
            continue
        cases = sets[name]()
        total += len(cases)
        if name == "sm90" and args.device == "cuda":
            ran = sm90_kernel_ran()
            print(f"-- sm90: the wgmma kernel ran: {'n/a (not sm90)' if ran is None else ran}")
            if ran is False:
                print("FAIL sm90-code: DILATED_ATTENTION_CUDA_SM90=1 ran the sm80 forward (no sm_90a code?)")
                failures += 1
        print(f"-- {name} cases")
        f, s = run_cases(cases, args.device, args.seed)
        failures, skipped = failures + f, skipped + s
    print(
        f"gpu_smoke: {total - failures - skipped} of {total} cases passed"
        + (f", {skipped} skipped (device memory)" if skipped else "")
        + (f", {failures} FAILED" if failures else "")
    )
    return 1 if failures else 0


# --------------------------------------------------------------------------------------------------
# profile: gpu_check.sh's profile step runs this under Nsight Compute (``ncu``), filtered to the
# tensor-core kernels, so that each configuration's forward, dq and dk/dv kernels are profiled
# once: bf16, B = 1, N = 256K (--seq-len), H = 16, LongNet branches (w = 2048·2^i up to N,
# r = 2^i), the head dims and masks given, with the sm80 kernels and then the sm90 (wgmma) ones
# (``DILATED_ATTENTION_CUDA_SM90=1``; on a GPU without sm_90a code that run repeats the sm80
# kernels). Nothing is timed or checked here: that is benchmarks/bench_cuda.py's and smoke's work.
#
#     ncu --kernel-name regex:tc --launch-count 6 python scripts/gpu.py profile
#     python scripts/gpu.py profile --dry-run      # tiny sizes on the CPU: checks this subcommand
# --------------------------------------------------------------------------------------------------


def profile_run(N: int, H: int, D: int, causal: bool, device: str, dtype, segs, rates) -> None:
    """One forward and one backward of ``backend="native"`` on random (1, N, H, D) inputs."""
    torch = import_op()
    import dilated_attention

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, N, H, D, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3)
    )
    out = dilated_attention.dilated_attention(q, k, v, segs, rates, is_causal=causal, backend="native")
    out.backward(torch.randn(out.shape, device=device, dtype=dtype, generator=g))
    if device == "cuda":
        torch.cuda.synchronize()


def profile_main(args: argparse.Namespace) -> int:
    torch = import_op()
    if args.dry_run:
        device, dtype, N = "cpu", torch.float32, min(args.seq_len, 256)
    elif not torch.cuda.is_available():
        print("gpu_profile: no CUDA GPU here; nothing to profile (--dry-run runs tiny sizes on the CPU)")
        return 0
    else:
        device, dtype, N = "cuda", torch.bfloat16, args.seq_len
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchlib import longnet_branches

    segs, rates = longnet_branches(N, min(2048, N))
    for family in args.families:
        if family == "sm90":
            os.environ.update(SM90)
        else:
            os.environ.pop("DILATED_ATTENTION_CUDA_SM90", None)
        for D in args.head_dims:
            for causal in args.causal:
                profile_run(N, args.heads, D, bool(causal), device, dtype, segs, rates)
                print(
                    f"gpu_profile: {family} N={N} H={args.heads} D={D} causal={bool(causal)} {dtype}: "
                    "forward and backward ran"
                )
    return 0


# --------------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------------


def _positive(text: str) -> int:
    """A whole number >= 1 (argparse's type: a bad value is a usage error naming it)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/gpu.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{env,testlog,smoke,profile}")

    e = sub.add_parser("env", help="what this machine offers the build and the check")
    e.add_argument("--need-build", action="store_true", help="exit 3 when the extension cannot be built here")
    e.set_defaults(run=env_main)

    t = sub.add_parser("testlog", help="read the log of gpu_check.sh's tests step")
    t.add_argument("what", choices=("summary", "crashed"))
    t.add_argument("log")
    t.add_argument("--max", type=_positive, default=3, help="crashed: at most this many tests (3)")
    t.set_defaults(run=testlog_main)

    s = sub.add_parser("smoke", help="the op on the GPU against the float64 CPU op")
    s.add_argument(
        "--cases",
        nargs="+",
        default=["small", "large"],
        choices=["small", "large", "sanitize", "sm90", "errors"],
    )
    s.add_argument("--error-child", metavar="DEVICE", help=argparse.SUPPRESS)
    s.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(run=smoke_main)

    f = sub.add_parser("profile", help="one forward and backward per configuration, for ncu")
    f.add_argument("--seq-len", type=_positive, default=262144)
    f.add_argument("--heads", type=_positive, default=16)
    f.add_argument("--head-dims", type=_positive, nargs="+", default=[128])
    f.add_argument("--causal", type=int, nargs="+", default=[0], choices=[0, 1])
    f.add_argument(
        "--families",
        nargs="+",
        default=["sm80", "sm90"],
        choices=["sm80", "sm90"],
        help="the tensor-core kernels of tc_kernels.cuh (sm80) and of tc90_kernels.cuh (sm90)",
    )
    f.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU in float32")
    f.set_defaults(run=profile_main)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
