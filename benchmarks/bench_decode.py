"""Benchmark of one decode step: ``dilated_attention_decode`` against dense attention over the cache.

At each cache length L it times one generation step of one new token (B sequences, Hq query
heads, Hkv key/value heads, head dim D):

* ``dilated``: ``dilated_attention.dilated_attention_decode`` appending the token's key and value
  and attending to the keys SPEC section 8 gives it, at most ``sum_i ceil(w_i / r_i)`` per query
  however long the cache is;
* ``dense_sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` of the token over all L
  cached keys (``enable_gqa``), what a dense model does at every step.

Both read the same cache, a (B, Hkv, Lmax, D) tensor (transformers' layout; the decode function
sees it through ``.transpose(1, 2)``), filled with random values once. Before timing, the decode
step is checked against SDPA on a branch that covers the whole cache (one segment, rate 1), where
the two compute the same attention. Reported per L: ms per step (median of the repeats), the keys
each query reads (gathered slots for ``dilated``, L for dense), and the ratio. It writes ``<out>/<tag>.csv``, ``.json`` (rows plus machine,
versions, date, commit and the ``--note``) and ``.png`` (time against L, log-log).

    python benchmarks/bench_decode.py                       # L = 4K .. 1M, float32, on the CPU
    python benchmarks/bench_decode.py --lengths 4k,64k --repeats 5 --threads 1 --note "shared machine"
    python benchmarks/bench_decode.py --device cuda
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dilated_attention import dilated_attention_decode
from dilated_attention.decode import decode_key_positions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import DTYPES, _ints, machine_info, machine_tag

log = logging.getLogger("bench_decode")

METHODS = ("dilated", "dense_sdpa")
CSV_FIELDS = ["method", "L", "B", "Hq", "Hkv", "D", "dtype", "keys_read", "ms_median", "ms_min", "repeats"]


def keys_read(L: int, Hq: int, segments: Sequence[int], rates: Sequence[int]) -> int:
    """Keys that the decode step gathers for the query at position ``L - 1`` (its slots: at most
    ``sum_i ceil(w_i / r_i)``, a key of two branches counted twice)."""
    keys, _ = decode_key_positions(torch.tensor([L - 1]), Hq, segments, rates)
    return int(keys.shape[-1])


def step_fns(cache_k: torch.Tensor, cache_v: torch.Tensor, L: int, args: argparse.Namespace):
    """The two decode steps at cache length L (the new token at position L - 1)."""
    B, Hkv, _, D = cache_k.shape
    g = torch.Generator(device="cpu").manual_seed(L)
    q = torch.randn(B, 1, args.heads, D, generator=g).to(cache_k)
    kn = torch.randn(B, 1, Hkv, D, generator=g).to(cache_k)
    vn = torch.randn(B, 1, Hkv, D, generator=g).to(cache_k)
    kc, vc = cache_k.transpose(1, 2), cache_v.transpose(1, 2)  # (B, Lmax, Hkv, D) views

    def dilated() -> torch.Tensor:
        return dilated_attention_decode(q, kc, vc, L - 1, args.segments, args.rates, k=kn, v=vn)

    qt = q.transpose(1, 2)  # (B, Hq, 1, D)

    def dense_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qt, cache_k[:, :, :L], cache_v[:, :, :L], enable_gqa=True)

    return {"dilated": dilated, "dense_sdpa": dense_sdpa}


def check(cache_k: torch.Tensor, cache_v: torch.Tensor, L: int, args: argparse.Namespace) -> float:
    """Max difference of the decode step and SDPA when one branch (w >= L, r = 1) covers the cache."""
    one = argparse.Namespace(**{**vars(args), "segments": [L], "rates": [1]})
    fns = step_fns(cache_k, cache_v, L, one)
    a = fns["dilated"]()  # (B, 1, Hq, D)
    b = fns["dense_sdpa"]().transpose(1, 2)
    return float((a.float() - b.float()).abs().max())


def time_fn(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def plot(path: str, rows: list[dict], meta: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return False
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, m in enumerate(METHODS):
        pts = sorted((r["L"], r["ms_median"]) for r in rows if r["method"] == m)
        if pts:
            ax.plot(*zip(*pts, strict=True), "-o", ms=4, color=f"C{i}", label=m)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cache length L (tokens)")
    ax.set_ylabel("one decode step (ms, median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    r0 = rows[0]
    where = meta.get("gpu") or f"{meta.get('cpu')} ({meta.get('torch_threads')} threads)"
    note = f"\n{meta['note']}" if meta.get("note") else ""
    ax.set_title(
        f"decode step, {r0['dtype']}, B={r0['B']} Hq={r0['Hq']} Hkv={r0['Hkv']} D={r0['D']}\n"
        f"w={meta['segments']} r={meta['rates']}\n{where}, torch {meta['torch']}, {meta['date'][:10]}{note}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_table(rows: list[dict]) -> None:
    by = {(r["method"], r["L"]): r for r in rows}
    print(f"{'L':>9} {'keys/query':>11} {'dilated ms':>11} {'dense ms':>10} {'dense/dilated':>14}")
    for L in sorted({r["L"] for r in rows}):
        d, s = by.get(("dilated", L)), by.get(("dense_sdpa", L))
        ratio = f"{s['ms_median'] / d['ms_median']:.2f}x" if d and s else "-"
        print(
            f"{L:>9} {d['keys_read'] if d else '-':>11} "
            f"{d['ms_median'] if d else float('nan'):>11.3f} {s['ms_median'] if s else float('nan'):>10.3f} "
            f"{ratio:>14}"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=_ints, default=_ints("4k,16k,64k,256k,1m"), help="cache lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--segments", type=_ints, default=[2048, 8192, 32768, 131072, 524288])
    p.add_argument("--rates", type=_ints, default=[1, 4, 16, 64, 256])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--note", default="", help="a label for the run, e.g. that the machine was shared")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default=None, help="output file stem (default: decode-<machine>)")
    args = p.parse_args(argv)
    if len(args.segments) != len(args.rates):
        p.error(f"--segments and --rates must have the same length, got {args.segments} and {args.rates}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    meta = machine_info(device)
    meta.update(segments=args.segments, rates=args.rates, note=args.note)
    stem = os.path.join(args.out, args.tag or f"decode-{machine_tag(meta)}")
    Lmax = max(args.lengths)
    shape = (args.batch, args.kv_heads, Lmax, args.dim)
    gib = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size() / 2**30
    log.info("cache of %d tokens: %.2f GiB for keys and values", Lmax, gib)
    g = torch.Generator(device="cpu").manual_seed(0)
    cache_k = torch.empty(shape, dtype=dtype, device=device)
    cache_v = torch.empty(shape, dtype=dtype, device=device)
    for t in (cache_k, cache_v):  # filled in chunks: no float32 copy of the whole cache at once
        for s in range(0, Lmax, 1 << 16):
            n = min(1 << 16, Lmax - s)
            t[:, :, s : s + n] = torch.randn(args.batch, args.kv_heads, n, args.dim, generator=g).to(t)
    L0 = min(args.lengths)
    err = check(cache_k, cache_v, L0, args)
    log.info("check at L=%d (one branch w=L, r=1): max |decode - sdpa| = %.2e", L0, err)
    if err > (1e-4 if dtype in (torch.float32, torch.float64) else 2e-2):
        raise SystemExit(f"the decode step disagrees with SDPA at L={L0}: max difference {err:.3e}")
    meta["check_max_abs_diff"] = err
    rows = []
    with tqdm(total=len(args.lengths) * len(METHODS), unit="case", dynamic_ncols=True) as bar:
        for L in sorted(args.lengths):
            fns = step_fns(cache_k, cache_v, L, args)
            reads = keys_read(L, args.heads, args.segments, args.rates)
            for m in METHODS:
                bar.set_description(f"{m} L={L}")
                times = time_fn(fns[m], device, args.warmup, args.repeats)
                rows.append(
                    {
                        "method": m,
                        "L": L,
                        "B": args.batch,
                        "Hq": args.heads,
                        "Hkv": args.kv_heads,
                        "D": args.dim,
                        "dtype": args.dtype,
                        "keys_read": reads if m == "dilated" else L,
                        "ms_median": sorted(times)[len(times) // 2],
                        "ms_min": min(times),
                        "repeats": args.repeats,
                    }
                )
                bar.update()
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    written = [stem + ".csv", stem + ".json"]
    if plot(stem + ".png", rows, meta):
        written.append(stem + ".png")
    print_table(rows)
    print("wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
