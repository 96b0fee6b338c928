"""Smoke run of the native op on a GPU against the same op on the CPU in float64.

Each case runs ``torch.ops.dilated_attention.fwd`` and ``.bwd`` on the device, then the CPU op in
float64 on the same inputs (upcast), and compares out, lse, dq, dk and dv with a tolerance for the
case's dtype. The CPU op is itself tested against the dense float64 reference (tests/op/test_op.py).

* ``--cases small``: float64 and bfloat16 problems, among them B = 64 and LongNet-shaped branches.
* ``--cases large``: inputs of more than 2^31 elements (bfloat16 on the tensor-core kernels, float32
  and float64 on the SIMT kernels; one with a large batch, others with a long sequence), where any
  32-bit index arithmetic would overflow. The CPU op then checks aligned blocks of positions at
  both ends (a block whose ends are multiples of every segment length holds whole segments of
  every branch, so its rows depend on that block alone). Where the backward does not fit in the
  GPU's memory (float64 on an 80 GB GPU), the case runs its forward only and says so.
* ``--cases sanitize``: tiny forward + backward runs of both kernel families (tensor-core bf16/fp16,
  SIMT fp32/fp64/bf16, a forced SIMT run and a forced tiling), short enough for compute-sanitizer.
* ``--cases sm90``: the sm90 kernels (wgmma, ``DILATED_ATTENTION_CUDA_SM90=1``), forward and
  backward, on float16 and bfloat16 problems of every padded head dim; on a compute
  capability 9.0 GPU the first case also checks (torch.profiler) that the wgmma kernel ran, so that
  a build without sm_90a code fails instead of passing on the sm80 kernel.
* ``--cases errors``: calls the op must refuse (a softmax_scale the scores cannot hold, head dim
  257, a decreasing ``cu_seqlens``, dropout_p = 1.5), each round led by one of torch's own refused
  calls (``torch.mm`` of mismatched shapes) as a control; three rounds on the CPU and then on the
  device, each device in a process of its own: every call must raise its error, and a process that
  dies is reported with the call it was making and the end of its Python traceback.

``--device cpu`` runs the "device" op on the CPU too: it checks this script's logic without a GPU.
Prints one line per case and exits 1 when any case fails.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's package, built in place
import dilated_attention.op  # registers torch.ops.dilated_attention (after the path above is set)

# Per dtype: (atol = rtol) for out and lse, and for the gradients, against the float64 CPU op.
TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-4, 2e-3),
    torch.bfloat16: (3e-2, 1e-1),
    torch.float16: (1e-2, 5e-2),
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
    dtype: torch.dtype
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
        item = torch.empty((), dtype=self.dtype).element_size()
        big = self.B * self.N * self.Hq * self.D
        small = self.B * self.N * self.Hkv * self.D
        n_big, n_small = (4, 4) if self.backward else (2, 2)  # q out [dout dq] / k v [dk dv]
        return item * (n_big * big + n_small * small) + 8 * self.B * self.Hq * self.N * 2

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (
            f"B={self.B} N={self.N} Hq={self.Hq} Hkv={self.Hkv} D={self.D} {dt} w={self.segs} r={self.rates} "
            f"{'causal' if self.causal else 'full'} ({self.elements:.3g} elements)"
        )


def _block(segs: Sequence[int]) -> int:
    """The least common multiple of the segment lengths: blocks of it hold whole segments."""
    return math.lcm(*segs)


def small_cases() -> list[Case]:
    return [
        Case("b64-gqa-f64", 64, 64, 4, 2, 32, [16, 32], [1, 2], True, torch.float64),
        Case("longnet-f64", 2, 300, 8, 2, 64, [32, 64, 128, 256], [1, 2, 4, 8], True, torch.float64),
        Case("irregular-f64", 1, 1000, 2, 1, 128, [100, 1000], [1, 7], False, torch.float64),
        Case("uncovered-f64", 3, 40, 4, 4, 16, [8], [4], False, torch.float64),
        Case("b64-bf16", 64, 128, 8, 8, 64, [32, 64], [1, 2], True, torch.bfloat16),
        Case("longnet-bf16-d128", 1, 1024, 4, 2, 128, [128, 256, 512], [1, 2, 4], True, torch.bfloat16),
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
    out = [Case("large-batch-bf16", B, N, H, Hkv, D, segs, [1, 2], True, torch.bfloat16, ends)]
    # A long sequence: positions beyond 2^31 / (H D) in one batch element.
    for name, dtype, causal in [
        ("large-seq-f32", torch.float32, False),
        ("large-seq-f64", torch.float64, True),
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
    bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
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
    bf16, f16 = torch.bfloat16, torch.float16
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


OpFn = Callable[..., tuple[torch.Tensor, ...]]


def run_op(q, k, v, dout, dlse_fn, segs, rates, causal, scale, backward=True):
    """Forward and (optionally) backward of the native op: (out, lse[, dq, dk, dv], dlse)."""
    out, lse = torch.ops.dilated_attention.fwd(q, k, v, segs, rates, causal, scale)
    if not backward:
        return out, lse, None, None, None, None
    dlse = dlse_fn(lse)
    dq, dk, dv = torch.ops.dilated_attention.bwd(dout, q, k, v, out, lse, dlse, segs, rates, causal, scale)
    return out, lse, dq, dk, dv, dlse


def _inputs(case: Case, device: str, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    shape_q = (case.B, case.N, case.Hq, case.D)
    shape_k = (case.B, case.N, case.Hkv, case.D)
    q = torch.randn(shape_q, generator=g, device=device, dtype=case.dtype)
    k = torch.randn(shape_k, generator=g, device=device, dtype=case.dtype)
    v = torch.randn(shape_k, generator=g, device=device, dtype=case.dtype)
    dout = torch.randn(shape_q, generator=g, device=device, dtype=case.dtype) if case.backward else None
    return q, k, v, dout


def _dlse(lse: torch.Tensor, seed: int) -> torch.Tensor:
    """A gradient for lse: random where the row is covered, 0 where lse is -inf (uncovered rows)."""
    g = torch.Generator(device=lse.device).manual_seed(seed + 7)
    d = torch.randn(lse.shape, generator=g, device=lse.device, dtype=lse.dtype)
    return torch.where(torch.isfinite(lse), d, torch.zeros_like(d))


def check_case(case: Case, device: str = "cuda", seed: int = 0, op: OpFn = run_op) -> dict[str, float]:
    """Runs ``case`` on ``device`` with ``op`` and compares it, slice by slice, with the float64 CPU op.

    Returns the largest absolute error per output; raises AssertionError naming the output, the
    slice and the error when a comparison fails.
    """
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
    import subprocess

    failures = 0
    for device in devices:
        start = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-X", "faulthandler", __file__, "--error-child", device],
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cases",
        nargs="+",
        default=["small", "large"],
        choices=["small", "large", "sanitize", "sm90", "errors"],
    )
    p.add_argument("--error-child", metavar="DEVICE", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.error_child:
        return error_child(args.error_child)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA GPU is available (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if not dilated_attention.op.has_kernel(args.device):
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


if __name__ == "__main__":
    sys.exit(main())
