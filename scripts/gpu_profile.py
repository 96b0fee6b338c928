"""One forward and backward of the native op on a GPU, for a kernel profiler to read.

``scripts/gpu_check.sh``'s ``profile`` step runs this under Nsight Compute (``ncu``), filtered to
the tensor-core kernels, so that each configuration's forward, dq and dk/dv kernels are profiled
once: bf16, B = 1, N = 256K (``--seq-len``), H = 16, LongNet branches (w = 2048·2^i up to N,
r = 2^i), the head dims and masks given, with the sm80 kernels and then the sm90 (wgmma) ones
(``DILATED_ATTENTION_CUDA_SM90=1``; on a GPU without sm_90a code that run repeats the sm80
kernels). Nothing is timed or checked here: that is
``benchmarks/bench_cuda.py``'s and ``scripts/gpu_smoke.py``'s work.

    ncu --kernel-name regex:tc --launch-count 6 python scripts/gpu_profile.py
    python scripts/gpu_profile.py --dry-run      # tiny sizes on the CPU: checks this script
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchlib import longnet_branches

import dilated_attention


def run(N: int, H: int, D: int, causal: bool, device: str, dtype: torch.dtype) -> None:
    """One forward and one backward of ``backend="native"`` on random (1, N, H, D) inputs."""
    segs, rates = longnet_branches(N, min(2048, N))
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, N, H, D, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3)
    )
    out = dilated_attention.dilated_attention(q, k, v, segs, rates, is_causal=causal, backend="native")
    out.backward(torch.randn(out.shape, device=device, dtype=dtype, generator=g))
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=262144)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128])
    p.add_argument("--causal", type=int, nargs="+", default=[0], choices=[0, 1])
    p.add_argument(
        "--families",
        nargs="+",
        default=["sm80", "sm90"],
        choices=["sm80", "sm90"],
        help="the tensor-core kernels of tc_kernels.cuh (sm80) and of tc90_kernels.cuh (sm90)",
    )
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU in float32")
    args = p.parse_args(argv)
    for name in ("seq_len", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if any(d < 1 for d in args.head_dims):
        p.error(f"--head-dims must be positive, got {args.head_dims}")
    if args.dry_run:
        device, dtype, N = "cpu", torch.float32, min(args.seq_len, 256)
    elif not torch.cuda.is_available():
        print("gpu_profile: no CUDA GPU here; nothing to profile (--dry-run runs tiny sizes on the CPU)")
        return 0
    else:
        device, dtype, N = "cuda", torch.bfloat16, args.seq_len
    for family in args.families:
        if family == "sm90":
            os.environ["DILATED_ATTENTION_CUDA_SM90"] = "1"
        else:
            os.environ.pop("DILATED_ATTENTION_CUDA_SM90", None)
        for D in args.head_dims:
            for causal in args.causal:
                run(N, args.heads, D, bool(causal), device, dtype)
                print(
                    f"gpu_profile: {family} N={N} H={args.heads} D={D} causal={bool(causal)} {dtype}: "
                    "forward and backward ran"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
