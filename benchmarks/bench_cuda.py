"""GPU speed of the native CUDA kernels against gather + SDPA (flash) + LSE merge, and against the
GPU's dense bf16 matmul rate measured in the same run.

For every configuration (B, N, H, D, causal) with LongNet's branches (w = 2048, 4096, ..., N and
r = 1, 2, 4, ...), the script times, forward and forward+backward:

* ``native``: ``dilated_attention(..., backend="native")``, the fused CUDA kernels;
* ``gather+flash``: the same computation done the usual way: for every branch and head phase,
  gather the dilated sub-sequences, run PyTorch's FlashAttention kernel
  (``aten._scaled_dot_product_flash_attention``, which returns the log-sum-exp), merge the
  branches by their log-sum-exp and scatter back; the backward runs the flash backward once per
  group with the merged out/lse (exact gradients, as ring attention does);
* ``matmul``: a dense bf16 ``torch.matmul`` of size ``--matmul-size`` cubed, for the GPU's
  reachable tensor-core rate.

Throughput is counted in useful TFLOP/s (SPEC section 3): forward = 4 * D * (number of (query,
key) pairs with multiplicity, summed over batch and heads), backward = 2.5 x forward. The script
prints, per row, ``speedup`` = time(gather+flash) / time(native) (target >= 1.3) and
``of matmul`` = native TFLOP/s / matmul TFLOP/s (target >= 0.40), and writes the table (Markdown
and CSV) and a plot to ``benchmarks/results/``.

Usage::

    python benchmarks/bench_cuda.py                      # the default sweep (needs ~40 GB of GPU memory)
    python benchmarks/bench_cuda.py --quick              # one small configuration
    python benchmarks/bench_cuda.py --tokens 262144 --heads 12 --head-dims 64 --causal 1

Without a CUDA GPU (or without the extension's CUDA kernels) it exits with a message saying so.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import math
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dilated_attention.flops import attention_flops, attention_pairs, matmul_flops

RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------------------------
# Useful work (SPEC section 3)
# ----------------------------------------------------------------------------------------------


def longnet_branches(N: int, w0: int = 2048) -> tuple[list[int], list[int]]:
    """w = w0, 2 w0, 4 w0, ... up to N (the last one N itself), r = 1, 2, 4, ..."""
    segs, rates = [], []
    w, r = w0, 1
    while True:
        segs.append(min(w, N))
        rates.append(r)
        if w >= N:
            break
        w, r = 2 * w, 2 * r
    return segs, rates


def useful_flops(
    B: int, N: int, Hq: int, D: int, segs: list[int], rates: list[int], is_causal: bool
) -> float:
    """Forward FLOPs: 4 * D * pairs, over the batch and the heads."""
    return attention_flops(B * attention_pairs(N, Hq, segs, rates, is_causal), D)


# ----------------------------------------------------------------------------------------------
# The baseline: gather + SDPA flash + LSE merge
# ----------------------------------------------------------------------------------------------


def make_flash_baseline():
    """The project's gather/merge driver with PyTorch's flash kernel (forward returns lse;
    backward fed the merged out/lse)."""
    from dilated_attention.backends.sdpa import SdpaBackend

    def _t(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)

    class FlashSdpaBaseline(SdpaBackend):
        name = "gather+flash"

        def native_gqa(self, device: torch.device) -> bool:
            return False  # the flash operator wants as many key/value heads as query heads

        def merged_backward(self, device: torch.device, dropout_p: float) -> bool:
            return True

        def attn_forward(self, q, k, v, *, is_causal, scale):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                _t(q), _t(k), _t(v), 0.0, is_causal, False, scale=scale
            )
            out, lse = res[0], res[1]
            return _t(out), lse, tuple(res[2:8])

        def attn_backward(self, dout, q, k, v, out, lse, extra, *, is_causal, scale):
            cum_q, cum_k, max_q, max_k, rng, unused = extra
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                _t(dout),
                _t(q),
                _t(k),
                _t(v),
                _t(out),
                lse.contiguous(),
                cum_q,
                cum_k,
                max_q,
                max_k,
                0.0,
                is_causal,
                rng,
                unused,
                scale=scale,
            )
            return _t(dq), _t(dk), _t(dv)

    return FlashSdpaBaseline()


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def cuda_time(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median seconds of fn() over iters runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


@dataclass
class Row:
    B: int
    N: int
    H: int
    D: int
    causal: bool
    branches: int
    fwd_flops: float
    native_fwd_s: float | None = None
    base_fwd_s: float | None = None
    native_fb_s: float | None = None
    base_fb_s: float | None = None
    max_abs_diff: float | None = None
    notes: list[str] = field(default_factory=list)

    def tflops(self, seconds: float | None, factor: float) -> float | None:
        return None if seconds is None else factor * self.fwd_flops / seconds / 1e12


def run_config(B: int, N: int, H: int, D: int, causal: bool, args, baseline) -> Row:
    from dilated_attention import dilated_attention

    segs, rates = longnet_branches(N, args.w0)
    row = Row(B, N, H, D, causal, len(segs), useful_flops(B, N, H, D, segs, rates, causal))
    scale = D**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    dout = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def native_fwd():
        return dilated_attention(
            q, k, v, segs, rates, is_causal=causal, softmax_scale=scale, backend="native"
        )

    def base_fwd():
        return baseline.forward(q, k, v, segs, rates, is_causal=causal, softmax_scale=scale)[0]

    def fwd_bwd(fwd):
        def run():
            for t in (q, k, v):
                t.grad = None
            out = fwd()
            out.backward(dout)

        return run

    try:
        with torch.no_grad():
            row.native_fwd_s = cuda_time(native_fwd, args.warmup, args.iters)
            o_native = native_fwd()
    except torch.cuda.OutOfMemoryError:
        row.notes.append("native: out of memory")
        o_native = None
    torch.cuda.empty_cache()
    try:
        with torch.no_grad():
            row.base_fwd_s = cuda_time(base_fwd, args.warmup, args.iters)
            o_base = base_fwd()
        if o_native is not None:
            row.max_abs_diff = (o_native.float() - o_base.float()).abs().max().item()
        del o_base
    except torch.cuda.OutOfMemoryError:
        row.notes.append("gather+flash: out of memory")
    except RuntimeError as e:  # e.g. no flash kernel for this GPU or head dim
        row.notes.append(f"gather+flash: {str(e).splitlines()[0][:80]}")
    del o_native
    torch.cuda.empty_cache()

    if not args.forward_only:
        for t in (q, k, v):
            t.requires_grad_(True)
        try:
            row.native_fb_s = cuda_time(fwd_bwd(native_fwd), args.warmup, args.iters)
        except torch.cuda.OutOfMemoryError:
            row.notes.append("native fwd+bwd: out of memory")
        torch.cuda.empty_cache()
        try:
            row.base_fb_s = cuda_time(fwd_bwd(base_fwd), args.warmup, args.iters)
        except torch.cuda.OutOfMemoryError:
            row.notes.append("gather+flash fwd+bwd: out of memory")
        except RuntimeError as e:
            row.notes.append(f"gather+flash fwd+bwd: {str(e).splitlines()[0][:80]}")
    return row


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None or math.isnan(x) else format(x, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


HEADER = [
    "B",
    "N",
    "H",
    "D",
    "causal",
    "branches",
    "pass",
    "native ms",
    "gather+flash ms",
    "native TFLOP/s",
    "gather+flash TFLOP/s",
    "speedup",
    "of matmul",
]


def table_rows(rows: list[Row], mm: float) -> list[list[str]]:
    out = []
    for r in rows:
        for name, tn, tb, factor in (
            ("fwd", r.native_fwd_s, r.base_fwd_s, 1.0),
            ("fwd+bwd", r.native_fb_s, r.base_fb_s, 3.5),
        ):
            if tn is None and tb is None:
                continue
            tf_n, tf_b = r.tflops(tn, factor), r.tflops(tb, factor)
            out.append(
                [
                    str(r.B),
                    str(r.N),
                    str(r.H),
                    str(r.D),
                    "yes" if r.causal else "no",
                    str(r.branches),
                    name,
                    _fmt(None if tn is None else tn * 1e3, ".2f"),
                    _fmt(None if tb is None else tb * 1e3, ".2f"),
                    _fmt(tf_n, ".1f"),
                    _fmt(tf_b, ".1f"),
                    _fmt(_ratio(tb, tn), ".2f"),
                    _fmt(_ratio(tf_n, mm), ".0%"),
                ]
            )
    return out


def write_results(rows: list[Row], mm: float, args, gpu: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = "".join(c if c.isalnum() else "-" for c in gpu).strip("-").lower()
    stem = Path(args.out) if args.out else RESULTS / f"cuda_{slug}_{stamp}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    body = table_rows(rows, mm)
    lines = [
        f"# Native CUDA kernels vs gather + SDPA (flash) + LSE merge, bf16, on {gpu}",
        "",
        (
            f"Measured {stamp} by `benchmarks/bench_cuda.py` ({' '.join(sys.argv[1:]) or 'default sweep'}); torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}, {platform.node()}."
        ),
        f"Dense bf16 matmul ({args.matmul_size}^3) measured in the same run: **{mm:.1f} TFLOP/s**.",
        (
            "LongNet branches: w = 2048, 4096, ..., N; r = 1, 2, 4, ... . Useful FLOPs (SPEC section 3): forward "
            "4 D x pairs, forward+backward 3.5 x that. speedup = gather+flash time / native time (target >= 1.3); "
            "of matmul = native useful TFLOP/s / matmul TFLOP/s (target >= 40%)."
        ),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    notes = [f"- B={r.B} N={r.N} H={r.H} D={r.D} causal={r.causal}: {n}" for r in rows for n in r.notes]
    diffs = [
        f"- B={r.B} N={r.N} H={r.H} D={r.D} causal={r.causal}: max |native - gather+flash| = {r.max_abs_diff:.3g}"
        for r in rows
        if r.max_abs_diff is not None
    ]
    if diffs:
        lines += ["", "Forward outputs of the two implementations (bf16):", "", *diffs]
    if notes:
        lines += ["", "Notes:", "", *notes]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*HEADER, "matmul TFLOP/s", "gpu"])
        for r in body:
            w.writerow([*r, f"{mm:.1f}", gpu])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [
            f"N={r[1]}\nH={r[2]} D={r[3]}\n{'causal' if r[4] == 'yes' else 'full'} {r[6]}" for r in body
        ]
        nat = [float(r[9]) if r[9] != "n/a" else 0.0 for r in body]
        base = [float(r[10]) if r[10] != "n/a" else 0.0 for r in body]
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(body)), 4))
        xs = range(len(body))
        ax.bar([x - 0.2 for x in xs], nat, width=0.4, label="native")
        ax.bar([x + 0.2 for x in xs], base, width=0.4, label="gather+flash")
        ax.axhline(mm, color="k", linestyle="--", linewidth=1, label=f"dense bf16 matmul ({mm:.0f})")
        ax.axhline(0.4 * mm, color="gray", linestyle=":", linewidth=1, label="40% of matmul")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("useful TFLOP/s")
        ax.set_title(f"dilated attention, bf16, {gpu}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    return stem


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[262144, 1048576], help="B * N per configuration")
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=None,
        help="sequence lengths N (default: N = tokens, B = 1; with --seq-lens, B = tokens / N)",
    )
    p.add_argument("--heads", type=int, nargs="+", default=[16])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    p.add_argument("--w0", type=int, default=2048, help="the smallest segment length")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--quick", action="store_true", help="one small configuration (a smoke test)")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument(
        "--out",
        default=None,
        metavar="STEM",
        help="write STEM.md, STEM.csv and STEM.png (default: benchmarks/results/cuda_<gpu>_<time>)",
    )
    args = p.parse_args(argv)
    for name in ("tokens", "heads", "head_dims"):
        bad = [x for x in getattr(args, name) if x < 1]
        if bad:
            p.error(f"--{name.replace('_', '-')} must be positive, got {bad}")
    if args.quick:
        args.tokens, args.seq_lens, args.heads, args.head_dims, args.causal = [16384], None, [8], [64], [1]
        args.iters, args.matmul_size = 3, 4096
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
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_cuda: no CUDA GPU is available here (torch.cuda.is_available() is False); "
            "this benchmark measures the CUDA kernels and needs one."
        )
    from dilated_attention._ops import has_kernel

    if not has_kernel("cuda"):
        raise SystemExit(
            "bench_cuda: the installed extension has no CUDA kernels; rebuild it with nvcc present "
            "(pip install --no-build-isolation -e . , or FORCE_CUDA=1)."
        )
    gpu = torch.cuda.get_device_name()
    cc = torch.cuda.get_device_capability()
    print(f"GPU: {gpu} (sm_{cc[0]}{cc[1]}), torch {torch.__version__}, CUDA {torch.version.cuda}")
    mm = matmul_flops("cuda", torch.bfloat16, n=args.matmul_size) / 1e12
    print(f"dense bf16 matmul {args.matmul_size}^3: {mm:.1f} TFLOP/s")
    baseline = make_flash_baseline()
    rows = []
    for B, N, H, D, causal in tqdm(configurations(args), desc="configurations"):
        rows.append(run_config(B, N, H, D, causal, args, baseline))
        torch.cuda.empty_cache()  # the configuration's tensors are gone with run_config's frame
        r = table_rows(rows[-1:], mm)
        for line in r:
            tqdm.write(" ".join(f"{h}={v}" for h, v in zip(HEADER, line, strict=True)))
    print()
    widths = [max(len(h), *(len(r[i]) for r in table_rows(rows, mm))) for i, h in enumerate(HEADER)]
    print("  ".join(h.rjust(w) for h, w in zip(HEADER, widths, strict=True)))
    for r in table_rows(rows, mm):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    for r in rows:
        for n in r.notes:
            print(f"note (B={r.B} N={r.N} H={r.H} D={r.D} causal={r.causal}): {n}")
    if not args.no_write:
        stem = write_results(rows, mm, args, gpu)
        print(f"wrote {stem.with_suffix('.md')}, .csv and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
