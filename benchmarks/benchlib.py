"""What the benchmark scripts share: the command line, timing, the machine, and result files.

* ``type=`` functions for argparse (a bad value is argparse's usage error, exit status 2, naming the
  option and the value) and checks of several options together that call ``parser.error``;
* the dtypes by name, LongNet's branches, a synchronised timer;
* the machine (:func:`machine_info`, :func:`machine_tag`, :func:`device_name`, :func:`git_commit`);
* :func:`fresh_stem`: a result name that never replaces saved (committed) results unasked.

Importing it puts this checkout's package on ``sys.path`` (after the folder of the script), so that
``python benchmarks/X.py`` measures the code beside it; it does not import the package itself
(``bench_sdpa_views.py`` measures another checkout in a child process).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

K = 1024
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
MAX_HEAD_DIM = 256  # dilated_attention's limits (dilated_attention/_validation.py)
MAX_BRANCHES = 16


def _int(text: str) -> int:
    """An int, with an optional ``k`` (x 1024) or ``m`` (x 1024**2) suffix: ``4k``, ``1m``, ``1.5k``."""
    part = text.strip().lower()
    mult = 1
    if part.endswith("k"):
        mult, part = K, part[:-1]
    elif part.endswith("m"):
        mult, part = K * K, part[:-1]
    try:
        value = float(part) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (e.g. 4096 or 4k), got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"expected an integer (e.g. 4096 or 4k), got {text!r}")
    return int(value)


def int_list(text: str) -> list[int]:
    """Comma-separated ints with optional k/m suffixes: ``4k,16k,1m``."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [_int(p) for p in parts]


def names_among(choices: Sequence[str], what: str = "backends") -> Callable[[str], list[str]]:
    """A ``type=`` for comma-separated names, each one of ``choices`` (``dense,auto,native``)."""

    def parse(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        bad = [n for n in names if n not in choices]
        if not names or bad:
            raise argparse.ArgumentTypeError(
                f"expected {what} among {','.join(choices)}, got {text!r}"
                + (f" ({', '.join(bad)} unknown)" if bad else "")
            )
        return names

    return parse


def _at_least(parse: Callable[[str], Any], low: float, strict: bool = False) -> Callable[[str], Any]:
    """``parse`` (a number or a list of numbers), then every value ``>= low`` (``> low`` if strict)."""
    bound = f"> {low}" if strict else f">= {low}"

    def check(text: str) -> Any:
        value = parse(text)
        values = value if isinstance(value, list) else [value]
        if any(v <= low if strict else v < low for v in values):
            raise argparse.ArgumentTypeError(f"every value must be {bound}, got {text!r}")
        return value

    return check


positive_int_list = _at_least(int_list, 1)  # comma-separated ints >= 1 (k/m suffixes allowed)
nonnegative_int_list = _at_least(int_list, 0)
positive_int = _at_least(_int, 1)
nonnegative_int = _at_least(_int, 0)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


positive_float = _at_least(_float, 0, strict=True)
nonnegative_float = _at_least(_float, 0)


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def device(text: str) -> str:
    """A torch device string that names a device this machine has (``cpu``, ``cuda``, ``cuda:1``)."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"not a device (e.g. cpu, cuda, cuda:1), got {text!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} was asked for, but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    return text


def existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"not a directory: {text!r}")
    return text


def check_branches(
    parser: argparse.ArgumentParser,
    segments: Sequence[int],
    rates: Sequence[int],
    seg_opt: str = "--segments",
    rate_opt: str = "--rates",
) -> None:
    """Segment lengths and dilation rates as dilated attention takes them: as many of each (at most
    16), every segment length >= 1 and every rate in [1, its segment length]."""
    shown = f"{seg_opt} {','.join(map(str, segments))} {rate_opt} {','.join(map(str, rates))}"
    if not segments:
        parser.error(f"{seg_opt} must not be empty")
    if len(segments) != len(rates):
        parser.error(
            f"{shown}: {seg_opt} and {rate_opt} must have the same number of values, got "
            f"{len(segments)} and {len(rates)}"
        )
    if len(segments) > MAX_BRANCHES:
        parser.error(f"{shown}: at most {MAX_BRANCHES} branches are supported, got {len(segments)}")
    for w, r in zip(segments, rates, strict=True):
        if w < 1:
            parser.error(f"{shown}: every segment length must be >= 1, got {w}")
        if not 1 <= r <= w:
            parser.error(
                f"{shown}: every rate must be in [1, its segment length], got rate {r} for segment {w}"
            )


def check_heads(
    parser: argparse.ArgumentParser,
    heads: int,
    kv_heads: int | None,
    q_opt: str = "--heads",
    kv_opt: str = "--kv-heads",
) -> None:
    """``heads`` a multiple of ``kv_heads`` (None: as many as ``heads``); both come positive."""
    if kv_heads is not None and heads % kv_heads:
        parser.error(f"{q_opt} {heads} must be a multiple of {kv_opt} {kv_heads}")


def check_head_dim(parser: argparse.ArgumentParser, dim: int, opt: str) -> None:
    if not 1 <= dim <= MAX_HEAD_DIM:
        parser.error(f"{opt} must be in [1, {MAX_HEAD_DIM}] (dilated_attention's head dims), got {dim}")


# ------------------------------------------------------------------------------------------------
# Shapes and timing
# ------------------------------------------------------------------------------------------------


def longnet_branches(N: int, w0: int = 2048) -> tuple[list[int], list[int]]:
    """LongNet's branches up to N: w = w0 * 2^i (the largest cut to N), r = 2^i."""
    segs, rates = [], []
    w, r = w0, 1
    while True:
        segs.append(min(w, N))
        rates.append(r)
        if w >= N:
            return segs, rates
        w, r = 2 * w, 2 * r


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 0, repeats: int = 1) -> list[float]:
    """``warmup`` untimed calls of ``fn``, then the milliseconds of each of ``repeats`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# ------------------------------------------------------------------------------------------------
# The machine
# ------------------------------------------------------------------------------------------------


def git_commit() -> str:
    """The checkout's commit (``+modified`` when tracked files differ from it), or ``unknown`` when
    this folder is not the root of a git checkout of its own (e.g. a copy of the files)."""

    def git(*cmd: str) -> str:
        r = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
        return r.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != ROOT:
            return "unknown"
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+modified" if dirty else "")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_info(device: torch.device) -> dict:
    """Date, platform, versions, commit, CPU (model, vector ISA, memory) and GPU of this run."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "git_commit": git_commit(),
        "cpu": device_name(torch.device("cpu")),
    }
    try:
        import dilated_attention

        info["dilated_attention"] = dilated_attention.__version__
    except Exception as exc:
        info["dilated_attention"] = f"unavailable ({type(exc).__name__})"
    try:
        from dilated_attention import op as _ops

        info["kernel_isa"] = _ops.cpu_isa()
    except Exception as exc:
        info["kernel_isa"] = f"unknown ({type(exc).__name__})"
    try:
        with open("/proc/cpuinfo") as f:
            flags = re.search(r"^flags\s*:\s*(.+)$", f.read(), re.MULTILINE)
        info["cpu_isa"] = ",".join(
            x for x in ("avx512f", "avx2", "fma") if flags and x in flags.group(1).split()
        )
        with open("/proc/meminfo") as f:
            mem = re.search(r"MemTotal:\s+(\d+)", f.read())
        if mem:
            info["mem_total_gib"] = round(int(mem.group(1)) / 2**20, 1)
    except OSError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_capability"] = f"{props.major}.{props.minor}"
        info["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``: a name as a piece of a file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def machine_tag(info: dict) -> str:
    """``cpu-amd-epyc-...-2core-avx512`` or ``cuda-nvidia-h200``: the machine in a file name."""
    if "gpu" in info:
        name = info["gpu"]
    else:
        name = f"{info.get('cpu', 'cpu')}-{info.get('cpu_count')}core"
    tag = re.sub(r"-(processor|cpu)\b", "", slug(name))
    if "gpu" not in info and info.get("cpu_isa"):
        tag += "-" + info["cpu_isa"].split(",")[0].replace("avx512f", "avx512")  # the widest vector ISA
    return f"{info['device'].split(':')[0]}-{tag}"


# ------------------------------------------------------------------------------------------------
# Result files
# ------------------------------------------------------------------------------------------------


def fresh_stem(stem: str | Path, exts: Iterable[str], overwrite: bool = False) -> str:
    """``stem``, or ``stem-<date>-<time>[-n]`` where a file ``stem + ext`` exists and ``overwrite``
    is not set: a new run never replaces saved (e.g. committed) results unasked."""
    stem, exts = str(stem), tuple(exts)
    if overwrite or not any(os.path.exists(stem + ext) for ext in exts):
        return stem
    when = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    fresh, n = f"{stem}-{when}", 1
    while any(os.path.exists(fresh + ext) for ext in exts):
        n += 1
        fresh = f"{stem}-{when}-{n}"
    print(
        f"results named {os.path.basename(stem)!r} exist in {os.path.dirname(stem) or '.'}: writing "
        f"{os.path.basename(fresh)}.* beside them (--overwrite replaces them)"
    )
    return fresh
