"""GPU speed of dilated attention in bf16, every way this project can compute it, in one run:

* ``native``: ``dilated_attention(..., backend="native")``, the fused CUDA kernels;
* ``native sm90``: the same with ``DILATED_ATTENTION_CUDA_SM90=1``, whose forward and backward run the
  warpgroup (wgmma) kernels on a GPU that runs sm_90a code (an H100 or H200), else what ``native`` runs;
* ``sdpa``: ``dilated_attention(..., backend="sdpa")``, whatever that backend is in this checkout;
* ``auto``: ``dilated_attention(...)``, the backend a user gets by default;
* ``flex``: FlexAttention over the whole sequence with the dilated pattern as its ``mask_mod`` and the
  branches' multiplicity as its ``score_mod`` (:func:`make_flex`);
* ``gather+flash``: the gather driver (``backends/driver.py``) with PyTorch's flash kernel on the
  gathered sub-sequences, merged by log-sum-exp, its backward the flash backward fed the merged
  out/lse: the gather path as a fixed baseline, whatever ``sdpa`` becomes;
* ``dense cuDNN``: dense SDPA (cuDNN) on the same tokens as sequences of length
  ``L = min(N, --dense-len)``: the rate a dense model reaches;
* the bf16 matmul rate of the GPU, measured in the same run.

For every configuration (B·N tokens, H heads, head dim D, causal or not) with LongNet's branches
(w = w0·2^i, r = 2^i, the largest segment N), forward and forward+backward: median time, useful
TFLOP/s (SPEC section 3: forward 4·D per (query, key) pair with multiplicity, forward+backward 3.5x
that) and the allocator's peak memory beyond the inputs. Printed with the pairs dense attention
computes over those dilated attention attends (``flops.attention_pairs``: the speed-up the pair
count allows), native/sdpa and native/gather+flash (time over time: > 1 means native is faster),
every method's rate per useful pair as a fraction of dense cuDNN's (``METHOD / dense``, TFLOP/s over
TFLOP/s: whether the kernels or the plumbing are the bottleneck) and native/matmul; written as
STEM.md, STEM.csv and STEM.png after every configuration, so a run cut short still leaves its table.

Every measurement has a time budget (the run's ``--budget`` seconds shared by the measurements left):
the first call is timed alone, and further calls run only while they fit; a measurement whose first
call alone overran is reported from that call (marked ``*``).

Usage::

    python benchmarks/bench_cuda.py                 # bf16, 256K and 1M tokens, H=16, D=64/128 (~40 GB)
    python benchmarks/bench_cuda.py --quick         # one small configuration
    python benchmarks/bench_cuda.py --gpt           # the example GPT's shape: H=12, D=64, causal, 16K-128K
    python benchmarks/bench_cuda.py --dry-run       # tiny sizes on the CPU: checks this script, no GPU
    python benchmarks/bench_cuda.py --tokens 262144 --head-dims 128 --causal 1 --out $OUT/bench

Without a CUDA GPU (or without the extension's CUDA kernels) it exits with a message saying so,
except with --dry-run.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib beside this file (it adds the checkout)
import benchlib as lib

from dilated_attention.flops import attention_flops, attention_pairs, matmul_flops

RESULTS = lib.RESULTS
SM90_ENV = "DILATED_ATTENTION_CUDA_SM90"  # the warpgroup kernels (csrc/cuda/tc90_kernels.cuh)
longnet_branches = lib.longnet_branches


# ----------------------------------------------------------------------------------------------
# The methods, the clock that keeps every measurement within the run's time budget, and the
# table, CSV and plot of what was measured
# ----------------------------------------------------------------------------------------------

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
        lib.sync(self.device)

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


def useful_flops(
    B: int, N: int, Hq: int, D: int, segs: list[int], rates: list[int], is_causal: bool
) -> float:
    """Forward FLOPs: 4 * D * pairs, over the batch and the heads."""
    return attention_flops(B * attention_pairs(N, Hq, segs, rates, is_causal), D)


# ----------------------------------------------------------------------------------------------
# The gather baseline: gather + flash + LSE merge
# ----------------------------------------------------------------------------------------------

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def make_gather_baseline():
    """The project's gather/merge driver with PyTorch's flash kernel (its forward returns the
    log-sum-exp, its backward takes the merged out/lse). On the CPU (``--dry-run``) the CPU flash
    operators stand in, refusing what the CUDA flash kernel refuses (anything but fp16/bf16)."""
    from dilated_attention.backends.driver import StridedBackend

    def _t(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)  # (B, M, H, D) <-> (B, H, M, D)

    def _kernel_dtype(x: torch.Tensor) -> torch.dtype:
        # The driver widens a multi-branch backward to float32 so that the branches' shares add up
        # unrounded; the flash kernels take fp16/bf16 only: they get bf16, their results are summed
        # in float32 by the driver all the same.
        return x.dtype if x.dtype in _FLASH_DTYPES else torch.bfloat16

    def _check(*xs: torch.Tensor) -> None:
        bad = [x.dtype for x in xs if x.dtype not in _FLASH_DTYPES]
        if bad:
            raise RuntimeError(f"FlashAttention only supports fp16 and bf16 inputs, got {bad[0]}")

    class GatherFlashBaseline(StridedBackend):
        name = "gather+flash"

        def native_gqa(self, device: torch.device) -> bool:
            return False  # the flash operator wants as many key/value heads as query heads

        def merged_backward(self, device: torch.device, dropout_p: float) -> bool:
            return dropout_p == 0.0

        def attn_forward(self, q, k, v, *, is_causal, scale):
            if q.device.type == "cpu":
                _check(q, k, v)
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    _t(q), _t(k), _t(v), 0.0, is_causal, scale=scale
                )
                return _t(out), lse, None
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                _t(q), _t(k), _t(v), 0.0, is_causal, False, scale=scale
            )
            return _t(res[0]), res[1], tuple(res[2:8])

        def attn_backward(self, dout, q, k, v, out, lse, extra, *, is_causal, scale):
            kd = _kernel_dtype(q)
            dout, q, k, v, out = (x.to(kd) for x in (dout, q, k, v, out))
            if q.device.type == "cpu":
                _check(dout, q, k, v, out)
                dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    _t(dout), _t(q), _t(k), _t(v), _t(out), lse, 0.0, is_causal, scale=scale
                )
                return _t(dq), _t(dk), _t(dv)
            cum_q, cum_k, max_q, max_k, rng, unused = extra
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                _t(dout), _t(q), _t(k), _t(v), _t(out), lse.contiguous(),
                cum_q, cum_k, max_q, max_k, 0.0, is_causal, rng, unused, scale=scale,
            )  # fmt: skip
            return _t(dq), _t(dk), _t(dv)

    return GatherFlashBaseline()


def make_flex(N: int, segs: list[int], rates: list[int], is_causal: bool, device: torch.device):
    """Dilated attention by FlexAttention over the whole sequence: ``mask_mod`` keeps the (query,
    key) pairs that some branch covers, ``score_mod`` adds the log of how many branches cover them
    (a key found by two branches counts twice, SPEC section 3), and the block mask lets the kernel
    skip blocks no branch reaches. Returns ``f(q, k, v, scale)`` on (B, N, H, D) tensors;
    compiled on CUDA (FlexAttention's kernels), eager on the CPU (``--dry-run``)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def count(b, h, qi, kv):
        total = None
        for w, r in zip(segs, rates, strict=True):
            w = min(w, N)
            cov = ((qi // w) == (kv // w)) & ((qi % w) % r == h % r) & ((kv % w) % r == h % r)
            total = cov.to(torch.int32) if total is None else total + cov.to(torch.int32)
        return torch.where(kv <= qi, total, 0) if is_causal else total

    def mask_mod(b, h, qi, kv):
        return count(b, h, qi, kv) > 0

    def score_mod(score, b, h, qi, kv):
        return score + torch.log(count(b, h, qi, kv).to(score.dtype))

    heads: dict[int, object] = {}  # the block mask per head count (it depends on h % r)
    run = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention

    def attend(q, k, v, scale: float) -> torch.Tensor:
        H = q.shape[2]
        if H not in heads:
            heads[H] = create_block_mask(mask_mod, B=None, H=H, Q_LEN=N, KV_LEN=N, device=str(device))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention on the CPU says it is slow
            out = run(
                *(x.transpose(1, 2) for x in (q, k, v)), score_mod=score_mod, block_mask=heads[H], scale=scale
            )
        return out.transpose(1, 2)

    return attend


def dense_attention(q, k, v, is_causal: bool, scale: float) -> torch.Tensor:
    """SDPA on (B, H, L, D) views; cuDNN on CUDA (flash where cuDNN cannot), the default on CPU."""
    import torch.nn.functional as F

    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    try:
        ctx = sdpa_kernel(order, set_priority=True)  # cuDNN first, whatever torch would prefer
    except TypeError:  # a torch without set_priority
        ctx = sdpa_kernel(order)
    with ctx:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


# ----------------------------------------------------------------------------------------------
# One configuration
# ----------------------------------------------------------------------------------------------


def _sample(out: torch.Tensor) -> torch.Tensor:
    """Up to 4096 positions spread over the sequence, on the CPU in float32 (for the differences
    between methods without keeping whole outputs)."""
    N = out.shape[1]
    idx = torch.linspace(0, N - 1, min(N, 4096), device=out.device).long()
    return out.index_select(1, idx).float().cpu()


def run_config(B, N, H, D, causal, args, clock: Clock, baseline, methods) -> Row:
    from dilated_attention import dilated_attention
    from dilated_attention.backends import select_backend

    dev, dt = clock.device, torch.bfloat16
    segs, rates = longnet_branches(N, args.w0)
    L = min(N, args.dense_len)
    L = L if N % L == 0 else N  # whole sequences of length L
    dense_pairs = (B * N // L) * H * (L * (L + 1) // 2 if causal else L * L)
    row = Row(B, N, H, D, causal, len(segs), useful_flops(B, N, H, D, segs, rates, causal), L,
              attention_flops(dense_pairs, D))  # fmt: skip
    scale = D**-0.5
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(B, N, H, D, device=dev, dtype=dt, generator=g) for _ in range(4))

    def dense_view(x):
        return x.view(B * N // L, L, H, D).transpose(1, 2)  # (B', H, L, D), no copy

    def native(sm90: bool) -> torch.Tensor:
        with patch.dict(os.environ):  # restored after the call
            os.environ.pop(SM90_ENV, None)
            if sm90:
                os.environ[SM90_ENV] = "1"
            return dilated_attention(
                q, k, v, segs, rates, is_causal=causal, softmax_scale=scale, backend="native"
            )

    fwds: dict[str, Callable[[], torch.Tensor]] = {
        "native": lambda: native(False),
        "native90": lambda: native(True),
        "sdpa": lambda: dilated_attention(q, k, v, segs, rates, is_causal=causal, softmax_scale=scale, backend="sdpa"),
        "auto": lambda: dilated_attention(q, k, v, segs, rates, is_causal=causal, softmax_scale=scale),
        "flex": lambda: flex(q, k, v, scale),
        "gather": lambda: baseline.forward(q, k, v, segs, rates, is_causal=causal, softmax_scale=scale)[0],
        "dense": lambda: dense_attention(dense_view(q), dense_view(k), dense_view(v), causal, scale),
    }  # fmt: skip
    flex = make_flex(N, segs, rates, causal, dev) if "flex" in methods else None
    douts = {"dense": dense_view(dout)}
    for name in ("native", "sdpa", "auto"):
        if name in methods:
            ran = select_backend(name, q, k).name
            if ran != name:
                row.notes.append(f"backend={name!r} runs {ran!r} here")
    reference = None
    for m in methods:
        for pass_ in ("fwd", "fwd+bwd"):
            if pass_ == "fwd+bwd" and args.forward_only:
                continue
            fwd = fwds[m]
            if pass_ == "fwd":
                for t in (q, k, v):
                    t.requires_grad_(False)

                def fn(fwd=fwd):
                    with torch.no_grad():
                        return fwd()

            else:
                for t in (q, k, v):
                    t.requires_grad_(True)

                d = douts.get(m, dout)

                def fn(fwd=fwd, d=d):
                    for t in (q, k, v):
                        t.grad = None
                    fwd().backward(d)

            if m == "flex" and pass_ == "fwd+bwd" and dev.type == "cpu":
                clock.skip()  # FlexAttention has no backward on the CPU
                continue
            fwd_time = row.times.get((m, "fwd"))
            if pass_ == "fwd+bwd" and fwd_time is not None and 3.5 * fwd_time.seconds > clock.remaining():
                # One call would overrun the whole run's budget (a call cannot be cut short).
                clock.skip()
                row.notes.append(
                    f"{m} {pass_}: not run, one call takes about {3.5 * fwd_time.seconds:.1f} s "
                    f"(3.5x the forward) and {clock.remaining():.0f} s of the budget are left"
                )
                continue
            try:
                timing = clock.measure(fn, args.iters)
                if timing is None:
                    row.notes.append(f"{m} {pass_}: not run, the run's time budget is spent")
                    continue
                row.times[(m, pass_)] = timing
                if pass_ == "fwd" and m != "dense":
                    s = _sample(fn())
                    if m == "native":
                        reference = s
                    elif reference is not None:
                        row.diffs[m] = (s - reference).abs().max().item()
            except torch.cuda.OutOfMemoryError:
                row.notes.append(f"{m} {pass_}: out of memory")
            except (
                RuntimeError,
                torch._dynamo.exc.BackendCompilerFailed,
            ) as e:  # e.g. no kernel for this GPU
                row.notes.append(f"{m} {pass_}: {str(e).splitlines()[0][:160]}")
            finally:
                for t in (q, k, v):
                    t.grad = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[262144, 1048576], help="B * N per configuration")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help="sequence lengths N (default: N = tokens, B = 1; with --seq-lens, B = tokens / N)")  # fmt: skip
    p.add_argument("--heads", type=int, nargs="+", default=[16])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    p.add_argument("--w0", type=int, default=2048, help="the smallest segment length")
    p.add_argument(
        "--methods", nargs="+", default=[m for m, _, _ in METHODS], choices=[m for m, _, _ in METHODS]
    )
    p.add_argument(
        "--dense-len", type=int, default=32768, help="sequence length of the dense comparison (at most N)"
    )
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--iters", type=int, default=10, help="timed calls per measurement at most")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all measurements together")
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--quick", action="store_true", help="one small configuration (a smoke test)")
    p.add_argument(
        "--gpt",
        action="store_true",
        help="the example GPT's attention: B=1, H=12, D=64, causal, N = 16K, 64K, 128K, dense over the whole "
        "sequence (give --tokens to choose other N)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="tiny sizes on the CPU: runs every line of this script"
    )
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--out", default=None, metavar="STEM",
                   help="write STEM.md, STEM.csv and STEM.png (default: benchmarks/results/cuda_<gpu>_<time>)")  # fmt: skip
    args = p.parse_args(argv)
    for name in ("tokens", "seq_lens", "heads", "head_dims"):
        bad = [x for x in getattr(args, name) or [] if x < 1]
        if bad:
            p.error(f"--{name.replace('_', '-')} must be positive, got {bad}")
    for name in ("w0", "dense_len", "iters", "matmul_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not args.budget > 0:
        p.error(f"--budget must be positive, got {args.budget}")
    for tokens in args.tokens if args.seq_lens and not (args.quick or args.dry_run) else []:
        for N in args.seq_lens:
            if tokens % N:
                p.error(f"--tokens {tokens} is not a multiple of --seq-lens {N}")
    if args.gpt:
        if args.tokens == p.get_default("tokens"):
            args.tokens = [16384, 65536, 131072]
        args.seq_lens, args.heads, args.head_dims, args.causal = None, [12], [64], [1]
        args.dense_len = max(args.tokens)
    if args.quick:
        args.tokens, args.seq_lens, args.heads, args.head_dims, args.causal = [16384], None, [8], [64], [1]
        args.iters, args.matmul_size, args.budget = 3, 4096, min(args.budget, 120.0)
    if args.dry_run:
        args.tokens, args.seq_lens, args.heads, args.head_dims = [256], [128], [2], [16]
        args.w0, args.dense_len, args.iters, args.matmul_size = 32, 64, 2, 64
    return args


def configurations(args) -> list[tuple[int, int, int, int, bool]]:
    out = []
    for tokens in args.tokens:
        for N in args.seq_lens or [tokens]:
            if tokens % N:
                raise SystemExit(f"bench_cuda: --tokens {tokens} is not a multiple of sequence length {N}")
            for H in args.heads:
                for D in args.head_dims:
                    for c in args.causal:
                        out.append((tokens // N, N, H, D, bool(c)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = configurations(args)
    from dilated_attention.op import has_kernel

    if args.dry_run:
        device, gpu = torch.device("cpu"), f"CPU ({platform.machine()}), dry run"
    else:
        if not torch.cuda.is_available():
            raise SystemExit(
                "bench_cuda: no CUDA GPU is available here (torch.cuda.is_available() is False); "
                "this benchmark measures the CUDA kernels and needs one (--dry-run checks the script on the CPU)."
            )
        if not has_kernel("cuda"):
            raise SystemExit(
                "bench_cuda: the installed extension has no CUDA kernels; rebuild it with nvcc present "
                "(pip install --no-build-isolation -e . , or FORCE_CUDA=1)."
            )
        device = torch.device("cuda", torch.cuda.current_device())
        cc = torch.cuda.get_device_capability()
        gpu = f"{torch.cuda.get_device_name()} (sm_{cc[0]}{cc[1]})"
    print(
        f"device: {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
    )
    mm = matmul_flops(device, torch.bfloat16, n=args.matmul_size) / 1e12
    print(f"dense bf16 matmul {args.matmul_size}^3: {mm:.1f} TFLOP/s")
    passes = 1 if args.forward_only else 2
    clock = Clock(device, args.budget, len(configs) * len(args.methods) * passes)
    baseline = make_gather_baseline()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    slug = "".join(c if c.isalnum() else "-" for c in gpu.split(" (")[0]).strip("-").lower()
    stem = Path(args.out) if args.out else RESULTS / f"cuda_{slug}_{stamp}"
    intro = [
        f"# Dilated attention, bf16, on {gpu}",
        "",
        f"Measured {stamp} UTC by `benchmarks/bench_cuda.py {' '.join(sys.argv[1:] if argv is None else argv)}`; "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}.",
        f"bf16 matmul ({args.matmul_size}^3) in the same run: **{mm:.1f} TFLOP/s**.",
        f"LongNet branches: w = {args.w0}·2^i up to N, r = 2^i. Useful FLOPs (SPEC section 3): forward 4·D per pair, "
        "forward+backward 3.5x. Ratios: pairs dense / dilated is the speed-up the pair count allows; "
        "native/sdpa and native/gather+flash are times (> 1: native faster); METHOD / dense (the rate per useful "
        "pair as a fraction of dense cuDNN's) and native/matmul are TFLOP/s. Peak GiB: the allocator's peak beyond the inputs. "
        "`*`: a single cold call (the budget had no room for more).",
    ]
    rows: list[Row] = []
    for i, (B, N, H, D, causal) in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] B={B} N={N} H={H} D={D} causal={causal} ...", flush=True)
        rows.append(run_config(B, N, H, D, causal, args, clock, baseline, args.methods))
        if not args.no_write:
            written = write(stem, rows, mm, intro, gpu)
    print()
    print_table(rows, mm)
    for r in rows:
        for n in r.notes:
            print(f"note ({r.describe()}): {n}")
    if not args.no_write:
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
