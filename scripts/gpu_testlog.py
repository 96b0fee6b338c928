"""Reads the log of scripts/gpu_check.sh's tests step (pytest -v, with or without pytest-xdist).

* ``summary LOG``: the sections of summary.md that come from tests.log: pytest's count (or, when
  the run was cut before pytest printed it, the count of the per-test lines so far and the tests
  still running), the failed, errored and crashed tests, the Python frames of every "Fatal Python
  error" (faulthandler), the skip reasons, the slowest tests (--durations) and the native
  backtraces that the backtrace step appended.
* ``crashed LOG [--max N]``: the tests to rerun under a debugger, one per line, at most N (3):
  the node id that pytest-xdist names for each crashed worker, else ``file::function`` from the
  faulthandler dump (its parameters are unknown there); one per test function.

Only the standard library: it runs with whatever interpreter the check uses.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("summary", "crashed"))
    p.add_argument("log")
    p.add_argument("--max", type=int, default=3, help="crashed: at most this many tests (3)")
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
