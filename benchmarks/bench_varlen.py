"""Packed sequences against padding: the cost of a batch of documents of different lengths.

Draws ``--docs`` documents of random lengths (a Dirichlet split, every length >= 1) that sum to
``--tokens`` tokens and times, side by side in one run (interleaved rounds, median of the rounds):

* ``packed``: the documents packed into (T, H, D) and run by
  ``dilated_attention_varlen(q, k, v, cu_seqlens, max_seqlen, ...)``: work on the real tokens only;
* ``padded``: the same documents padded to the longest, (docs, L_max, H, D), run as one batch by
  ``dilated_attention(...)``: the work of docs * L_max tokens.

Both run the same backend (``native`` by default), forward and forward+backward. The useful
TFLOP/s count only the (query, key) pairs of the real documents (SPEC section 3), the same
numerator for both. Writes ``<out>/<tag>.json`` and ``.txt``.

    python benchmarks/bench_varlen.py                          # 64 documents, 64K tokens, CPU
    python benchmarks/bench_varlen.py --device cuda --dtype bfloat16 --tokens 1048576
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import torch

# benchlib beside this file; importing it puts the checkout's package on the path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as lib

from dilated_attention import dilated_attention, dilated_attention_varlen
from dilated_attention.backends import BACKEND_NAMES
from dilated_attention.flops import attention_flops, attention_pairs

DTYPES = {name: lib.DTYPES[name] for name in ("float32", "float16", "bfloat16")}


def document_lengths(docs: int, tokens: int, seed: int) -> list[int]:
    """``docs`` random lengths >= 1 summing to ``tokens`` (Dirichlet(1) proportions, rounded)."""
    if tokens < docs:
        raise ValueError(f"--tokens ({tokens}) must be at least --docs ({docs})")
    g = torch.Generator().manual_seed(seed)
    share = torch.empty(docs, dtype=torch.float64).exponential_(generator=g)
    lengths = (1 + (share / share.sum() * (tokens - docs)).floor()).long()
    lengths[: tokens - int(lengths.sum())] += 1  # the rounding remainder, one token each
    return lengths.tolist()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=lib.positive_int, default=64)
    ap.add_argument("--tokens", type=lib.positive_int, default=64 * 1024)
    ap.add_argument("--heads", type=lib.positive_int, default=8)
    ap.add_argument("--head-dim", type=lib.positive_int, default=64)
    ap.add_argument("--segments", type=lib.positive_int_list, default=[2048, 4096, 8192])
    ap.add_argument("--rates", type=lib.positive_int_list, default=[1, 2, 4])
    ap.add_argument(
        "--causal", type=int, default=1, choices=[0, 1], help="1: causal (language modelling), 0: not"
    )
    ap.add_argument("--backend", default="native", choices=["auto", *BACKEND_NAMES])
    ap.add_argument("--device", type=lib.device, default="cpu")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--rounds", type=lib.positive_int, default=3, help="timed rounds after one warm-up round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="a label for the run, e.g. that the machine was shared")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="varlen")
    args = ap.parse_args(argv)
    lib.check_branches(ap, args.segments, args.rates)
    lib.check_head_dim(ap, args.head_dim, "--head-dim")
    if args.tokens < args.docs:
        ap.error(f"--tokens {args.tokens} must be at least --docs {args.docs} (every document has a token)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    segs, rates = args.segments, args.rates
    H, D, causal = args.heads, args.head_dim, bool(args.causal)
    lengths = document_lengths(args.docs, args.tokens, args.seed)
    T, L = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    g = torch.Generator().manual_seed(args.seed + 1)
    q, k, v = (torch.randn(T, H, D, generator=g).to(device, dtype) for _ in range(3))
    padded = []
    for t in (q, k, v):
        p = t.new_zeros((len(lengths), L, H, D))
        for i, (s, n) in enumerate(zip(cu[:-1].tolist(), lengths, strict=True)):
            p[i, :n] = t[s : s + n]
        padded.append(p)
    dout_packed = torch.randn(T, H, D, generator=g).to(device, dtype)
    dout_padded = torch.randn(len(lengths), L, H, D, generator=g).to(device, dtype)

    def packed_fwd() -> None:
        with torch.no_grad():
            dilated_attention_varlen(q, k, v, cu, L, segs, rates, is_causal=causal, backend=args.backend)

    def packed_fwdbwd() -> None:
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        out = dilated_attention_varlen(*x, cu, L, segs, rates, is_causal=causal, backend=args.backend)
        out.backward(dout_packed)

    def padded_fwd() -> None:
        with torch.no_grad():
            dilated_attention(*padded, segs, rates, is_causal=causal, backend=args.backend)

    def padded_fwdbwd() -> None:
        x = [t.detach().requires_grad_() for t in padded]
        dilated_attention(*x, segs, rates, is_causal=causal, backend=args.backend).backward(dout_padded)

    cases = {
        ("packed", "fwd"): packed_fwd,
        ("padded", "fwd"): padded_fwd,
        ("packed", "fwdbwd"): packed_fwdbwd,
        ("padded", "fwdbwd"): padded_fwdbwd,
    }
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    for r in range(args.rounds + 1):  # round 0 warms up
        for case, fn in cases.items():
            (ms,) = lib.time_ms(fn, device)
            if r:
                times[case].append(ms)
            print(f"round {r}: {case[0]:6s} {case[1]:6s} {ms:10.1f} ms", file=sys.stderr, flush=True)

    pairs = sum(attention_pairs(n, H, segs, rates, causal) for n in lengths)
    rows = []
    for (layout, mode), ts in times.items():
        ms = statistics.median(ts)
        flop = attention_flops(pairs, D, backward=mode == "fwdbwd")
        rows.append(
            {
                "layout": layout,
                "mode": mode,
                "ms": ms,
                "ms_all": ts,
                "tokens_computed": T if layout == "packed" else len(lengths) * L,
                "real_tokens_per_s": T / (ms / 1e3),
                "useful_tflops": flop / (ms / 1e3) / 1e12,
            }
        )
    result = {
        "config": {
            "docs": len(lengths),
            "tokens": T,
            "max_len": L,
            "padded_tokens": len(lengths) * L,
            "heads": H,
            "head_dim": D,
            "segment_lengths": segs,
            "dilation_rates": rates,
            "causal": causal,
            "backend": args.backend,
            "device": str(device),
            "dtype": args.dtype,
            "rounds": args.rounds,
            "seed": args.seed,
            "lengths": lengths,
        },
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "torch": torch.__version__,
        "commit": lib.git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "note": args.note,
        "rows": rows,
    }
    by = {(r["layout"], r["mode"]): r for r in rows}
    lines = [
        f"Packed vs padded: {len(lengths)} documents, {T} tokens (longest {L}; padded batch "
        f"{len(lengths)} x {L} = {len(lengths) * L} tokens, {len(lengths) * L / T:.2f}x), H={H}, D={D}, "
        f"w={segs}, r={rates}, {'causal' if causal else 'not causal'}, {args.dtype}, backend "
        f"{args.backend}, {device}; median of {args.rounds} interleaved rounds after one warm-up.",
        f"{result['date']}, commit {result['commit']}, torch {result['torch']}, "
        f"{result['machine']['cpu_count']} CPUs, {result['machine']['torch_threads']} threads."
        + (f" {args.note}" if args.note else ""),
        "",
        "| mode | packed ms | padded ms | padded / packed | packed useful TFLOP/s | padded useful TFLOP/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode in ("fwd", "fwdbwd"):
        a, b = by[("packed", mode)], by[("padded", mode)]
        lines.append(
            f"| {'forward' if mode == 'fwd' else 'forward+backward'} | {a['ms']:.0f} | {b['ms']:.0f} | "
            f"{b['ms'] / a['ms']:.2f}x | {a['useful_tflops']:.4f} | {b['useful_tflops']:.4f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, f"{args.tag}.txt"), "w") as f:
        f.write(text)
    return result


if __name__ == "__main__":
    main()
