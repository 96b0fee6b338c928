"""Dilated attention with the sequence split across processes (LongNet section 3.1).

Run with torchrun; each process holds N / P positions of q, k and v:

    torchrun --nproc_per_node=2 examples/ring_torchrun.py                 # CPU (gloo) or GPUs (nccl)
    torchrun --nproc_per_node=4 examples/ring_torchrun.py --comm ring --causal --layout zigzag
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 --rdzv_id=longnet examples/ring_torchrun.py --seq-len 262144

Every rank builds the same random inputs, keeps its chunk, runs RingDilatedAttention forward and
backward, and the chunks of out, dq, dk and dv are gathered and compared with the one-process op
on the whole sequence. The script exits with status 1 when they differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from dilated_attention import dilated_attention
from dilated_attention.ring import (
    RingDilatedAttention,
    comm_stats,
    gather_sequence,
    reset_comm_stats,
    shard_sequence,
)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# Largest difference accepted between the ring and the one-process op, both run in the same dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096, help="N, the whole sequence (divisible by the ranks)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: --heads")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--segment-lengths", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--comm", choices=["all_gather", "ring"], default="all_gather")
    p.add_argument(
        "--layout", choices=["contiguous", "zigzag"], default="contiguous", help="zigzag balances causal work"
    )
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on GPUs, float32 on the CPU"
    )
    p.add_argument("--iters", type=int, default=3, help="timed forward+backward iterations")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the one-process op")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if use_cuda else torch.float32)
    B, N, H, D = args.batch, args.seq_len, args.heads, args.head_dim
    Hkv = args.kv_heads or H
    if N % world:
        raise SystemExit(f"--seq-len {N} must be divisible by the number of processes {world}")

    # The same inputs on every rank (same seed); each keeps its chunk of N / P positions.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, h, D, generator=g).to(device, dtype) for h in (H, Hkv, Hkv))
    dout = torch.randn(B, N, H, D, generator=g).to(device, dtype)
    mine = [shard_sequence(t, layout=args.layout).detach().clone().requires_grad_() for t in (q, k, v)]
    dout_mine = shard_sequence(dout, layout=args.layout)

    attn = RingDilatedAttention(args.segment_lengths, args.dilation_rates, comm=args.comm, layout=args.layout)
    reset_comm_stats()
    out = attn(*mine, is_causal=args.causal)  # (B, N/P, H, D)
    out.backward(dout_mine)
    stats = comm_stats()

    times = []
    for _ in tqdm(range(args.iters), desc="forward+backward", disable=rank != 0):
        for t in mine:
            t.grad = None
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        attn(*mine, is_causal=args.causal).backward(dout_mine)
        if use_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    fwd = stats.get("forward", {"sent": 0, "received": 0})
    bwd = stats.get("backward", {"sent": 0, "received": 0})
    print(
        f"rank {rank}/{world} on {device}: chunk {tuple(out.shape)}, "
        f"forward sent {fwd['sent']} B received {fwd['received']} B, "
        f"backward sent {bwd['sent']} B received {bwd['received']} B, "
        f"best {min(times) * 1e3 if times else float('nan'):.1f} ms per forward+backward",
        flush=True,
    )

    status = 0
    if not args.no_check:
        got = [
            gather_sequence(t, layout=args.layout)
            for t in (out.detach(), mine[0].grad, mine[1].grad, mine[2].grad)
        ]
        if rank == 0:
            ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            ref = dilated_attention(*ref_in, args.segment_lengths, args.dilation_rates, is_causal=args.causal)
            ref.backward(dout)
            expected = [ref.detach()] + [t.grad for t in ref_in]
            tol = TOLERANCE[dtype]
            for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
                err = (a.double() - e.double()).abs().max().item()
                ok = err <= tol * max(1.0, e.double().abs().max().item())
                status |= not ok
                print(
                    f"{name}: max |ring - one process| = {err:.3e} ({'ok' if ok else 'MISMATCH'})", flush=True
                )
        flag = torch.tensor([status], device=device)
        dist.broadcast(flag, src=0)
        status = int(flag.item())
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
