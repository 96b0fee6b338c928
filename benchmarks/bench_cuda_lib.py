"""Timing and reporting for ``benchmarks/bench_cuda.py``: the clock that keeps every measurement
within the run's time budget, and the table, CSV and plot of what was measured."""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: The implementations measured, in the order of the table: key, column label, what it is.
METHODS: tuple[tuple[str, str, str], ...] = (
    ("native", "native", "dilated_attention(..., backend='native'): the fused CUDA kernels"),
    (
        "native90",
        "native sm90",
        "backend='native' with DILATED_ATTENTION_CUDA_SM90=1: the tensor-core passes on the warpgroup (wgmma) kernels "
        "where the GPU runs sm_90a code (else the same kernels as native)",
    ),
    ("sdpa", "sdpa", "dilated_attention(..., backend='sdpa'): whatever the sdpa backend is in this checkout"),
    ("auto", "auto", "dilated_attention(..., backend='auto'): what a user gets by default on this GPU"),
    (
        "flex",
        "flex",
        "FlexAttention (torch.compile'd) on the whole sequence with the dilated pattern: mask_mod keeps the pairs "
        "some branch covers, score_mod adds the log of how many branches cover them (SPEC section 3's "
        "multiplicity), a block mask skips the blocks no branch reaches",
    ),
    (
        "gather",
        "gather+flash",
        "the gather driver (backends/driver.py) with PyTorch's flash kernel on the gathered sub-sequences, "
        "merged by log-sum-exp: the gather path as a baseline that stays whatever sdpa becomes",
    ),
    (
        "dense",
        "dense cuDNN",
        "dense causal/full SDPA (cuDNN) on the same tokens, as sequences of length L = min(N, --dense-len): "
        "the rate a dense model reaches",
    ),
)
LABEL = {key: label for key, label, _ in METHODS}
PASSES = (("fwd", 1.0), ("fwd+bwd", 3.5))  # SPEC section 3: backward = 2.5 x forward


@dataclass
class Timing:
    """One measurement: median seconds over ``runs`` calls (``runs == 1`` and ``cold``: the first
    call only, which includes any one-time set-up, because the next one would not fit the budget),
    and the peak of the allocator's memory during the calls beyond what was allocated before."""

    seconds: float
    runs: int
    peak_bytes: int | None = None
    cold: bool = False


@dataclass
class Row:
    """One configuration: shapes, branches, useful forward FLOPs, and every measurement."""

    B: int
    N: int
    H: int
    D: int
    causal: bool
    branches: int
    fwd_flops: float  # dilated attention, SPEC section 3
    dense_len: int  # L of the dense comparison
    dense_fwd_flops: float
    times: dict[tuple[str, str], Timing] = field(default_factory=dict)  # (method, pass) -> Timing
    diffs: dict[str, float] = field(default_factory=dict)  # method -> max |out - native out| (sample)
    notes: list[str] = field(default_factory=list)

    def flops(self, method: str, factor: float) -> float:
        return factor * (self.dense_fwd_flops if method == "dense" else self.fwd_flops)

    def tflops(self, method: str, pass_: str) -> float | None:
        t = self.times.get((method, pass_))
        factor = dict(PASSES)[pass_]
        return None if t is None else self.flops(method, factor) / t.seconds / 1e12

    def describe(self) -> str:
        return f"B={self.B} N={self.N} H={self.H} D={self.D} causal={self.causal}"


class Clock:
    """Wall-clock timing of device work; the run's deadline shared by the measurements left."""

    def __init__(self, device: torch.device, budget_s: float, measurements: int):
        self.device, self.deadline, self.left = device, time.perf_counter() + budget_s, measurements

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def remaining(self) -> float:
        """Seconds left of the run's budget."""
        return max(0.0, self.deadline - time.perf_counter())

    def skip(self) -> None:
        """A measurement left out: the ones after it share its time."""
        self.left -= 1

    def share(self) -> float:
        """Seconds for the next measurement: the time left over the measurements left."""
        return max(0.0, self.deadline - time.perf_counter()) / max(1, self.left)

    def measure(self, fn: Callable[[], object], iters: int) -> Timing | None:
        """Median over up to ``iters`` calls after a first call, all within this measurement's
        share; None when no time is left at all."""
        share = self.share()
        self.left -= 1
        if share <= 0:
            return None
        cuda = self.device.type == "cuda"
        self.sync()
        base = torch.cuda.memory_allocated(self.device) if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        fn()
        self.sync()
        first = time.perf_counter() - t0
        times = []
        while len(times) < iters and (time.perf_counter() - t0) + first <= share:
            t1 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t1)
        peak = torch.cuda.max_memory_allocated(self.device) - base if cuda else None
        if not times:
            return Timing(first, 1, peak, cold=True)
        times.sort()
        return Timing(times[len(times) // 2], len(times), peak)


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None or math.isnan(x) else format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def header() -> list[str]:
    cols = ["B", "N", "H", "D", "causal", "pass"]
    for _key, label, _ in METHODS:
        cols += [f"{label} ms", f"{label} TFLOP/s", f"{label} peak GiB"]
    cols += ["pairs dense / dilated", "native / sdpa", "native / gather+flash"]
    cols += [f"{label} / dense" for key, label, _ in METHODS if key != "dense"]
    cols += ["native / matmul", "sm90 / native"]
    return cols


def table_rows(rows: list[Row], mm_tflops: float) -> list[list[str]]:
    """Per configuration and pass: time, useful TFLOP/s and peak memory of every method; the pairs
    dense attention computes over the pairs dilated attention attends (the speed-up the pair count
    allows); native's speed over sdpa's and the gather path's (> 1: native faster); every method's
    rate per useful pair as a fraction of dense cuDNN's (the number that says whether the kernels or
    the plumbing are the bottleneck); native's over the matmul rate; the sm90 kernels' speed over
    native's (> 1: faster)."""
    out = []
    for r in rows:
        for pass_, _ in PASSES:
            if not any((m, pass_) in r.times for m, _, _ in METHODS):
                continue
            cells = [str(r.B), str(r.N), str(r.H), str(r.D), "yes" if r.causal else "no", pass_]
            for m, _, _ in METHODS:
                t = r.times.get((m, pass_))
                ms = None if t is None else t.seconds * 1e3
                cells.append(fmt(ms, ".2f") + ("*" if t is not None and t.cold else ""))
                cells.append(fmt(r.tflops(m, pass_), ".4g"))
                peak = None if t is None or t.peak_bytes is None else t.peak_bytes / 2**30
                cells.append(fmt(peak, ".2f"))
            cells.append(fmt(ratio(r.dense_fwd_flops, r.fwd_flops), ".2f"))
            nat = r.times.get(("native", pass_))
            for other in ("sdpa", "gather"):
                o = r.times.get((other, pass_))
                cells.append(
                    fmt(ratio(None if o is None else o.seconds, None if nat is None else nat.seconds), ".2f")
                )
            for m, _, _ in METHODS:  # the rate per useful pair as a fraction of dense cuDNN's
                if m != "dense":
                    cells.append(fmt(ratio(r.tflops(m, pass_), r.tflops("dense", pass_)), ".0%"))
            cells.append(fmt(ratio(r.tflops("native", pass_), mm_tflops), ".0%"))
            n90 = r.times.get(("native90", pass_))
            cells.append(
                fmt(ratio(None if nat is None else nat.seconds, None if n90 is None else n90.seconds), ".2f")
            )
            out.append(cells)
    return out


def print_table(rows: list[Row], mm_tflops: float) -> None:
    head = header()
    body = table_rows(rows, mm_tflops)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for b in body:
        print("  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)))


def write(stem: Path, rows: list[Row], mm_tflops: float, intro: list[str], gpu: str) -> list[Path]:
    """Writes STEM.md, STEM.csv and (with matplotlib) STEM.png; returns the files written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    head, body = header(), table_rows(rows, mm_tflops)
    lines = [*intro, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(b) + " |" for b in body]
    lines += ["", "Methods:", ""] + [f"- {label}: {what}" for _, label, what in METHODS]
    dense = sorted({(r.N, r.dense_len) for r in rows})
    if dense:
        lines += ["", "Dense sequence length per N: " + ", ".join(f"N={n}: L={L}" for n, L in dense)]
    diffs = [
        f"- {r.describe()}: " + ", ".join(f"{LABEL[m]} {d:.3g}" for m, d in r.diffs.items())
        for r in rows
        if r.diffs
    ]
    if diffs:
        lines += ["", "max |out - native out| of the forward on sampled positions (bf16):", "", *diffs]
    notes = [f"- {r.describe()}: {n}" for r in rows for n in r.notes]
    if notes:
        lines += ["", "Notes:", "", *notes]
    written = [stem.with_suffix(".md"), stem.with_suffix(".csv")]
    written[0].write_text("\n".join(lines) + "\n")
    with open(written[1], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*head, "matmul TFLOP/s", "device"])
        for b in body:
            w.writerow([*b, f"{mm_tflops:.1f}", gpu])
    png = _plot(stem.with_suffix(".png"), rows, mm_tflops, gpu)
    return [*written, *([png] if png else [])]


def _plot(path: Path, rows: list[Row], mm_tflops: float, gpu: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = [(r, p) for r in rows for p, _ in PASSES if any((m, p) in r.times for m, _, _ in METHODS)]
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups)), 4.5))
    width = 0.8 / len(METHODS)
    for i, (m, label, _) in enumerate(METHODS):
        xs = [g + (i - (len(METHODS) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [r.tflops(m, p) or 0.0 for r, p in groups], width=width, label=label)
    ax.axhline(mm_tflops, color="k", linestyle="--", linewidth=1, label=f"bf16 matmul ({mm_tflops:.0f})")
    ax.set_xticks(list(range(len(groups))))
    ax.set_xticklabels(
        [f"N={r.N} D={r.D}\n{'causal' if r.causal else 'full'} {p}" for r, p in groups], fontsize=7
    )
    ax.set_ylabel("useful TFLOP/s (SPEC section 3)")
    ax.set_title(f"dilated attention, bf16, H={rows[0].H}, {gpu}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
