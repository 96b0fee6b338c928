"""Benchmark of one decode step: the bounded cache's fused step, the full-cache step and dense attention.

At each cache length L it times one generation step of one new token (B sequences, Hq query
heads, Hkv key/value heads, head dim D):

* ``bounded``: ``BoundedDilatedKVCache.attend`` (sized for L tokens): the token is written into
  the slots that later queries read and the fused op ``decode_step`` reads each (sequence, kv
  head, branch) row in place (plain PyTorch where the extension has no kernel for the device);
* ``dilated``: ``dilated_attention.dilated_attention_decode`` on a full (B, Hkv, Lmax, D) cache,
  gathering the keys SPEC section 8 gives the token (at most ``sum_i ceil(w_i / r_i)``);
* ``dense_sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` of the token over all L
  cached keys (``enable_gqa``), what a dense model does at every step.

``dilated`` and ``dense_sdpa`` read the same full cache, in transformers' layout, filled with random
values once; the bounded cache holds random values in its slots. Before timing, ``dilated`` is
checked against SDPA on a branch that covers the whole cache (one segment, rate 1), and
``bounded`` (prefilled with the first L0 - 1 tokens) against ``dilated`` on the token at L0 - 1.
Reported per L: ms per step (median of the repeats), the keys each query reads, and the bytes of
keys and values each cache holds for one layer (also for L up to ``--memory-lengths``, computed
from the layout). It writes ``<out>/<tag>.csv``, ``.json`` (rows, memory rows, machine, versions,
date, commit and the ``--note``) and ``.png`` (time and bytes against L, log-log).

``--generate TOKENS`` measures instead the memory of HuggingFace ``generate()`` on the bounded
cache over a long generation: a tiny Llama (random weights, ``attn_implementation=
"dilated_attention"``) generates TOKENS new tokens greedily with
``dilated_attention.transformers_cache.BoundedDilatedCache``; every ``--every`` tokens it records the
process's resident memory (VmRSS, Linux), its peak (VmHWM), the cache's bytes and the time per
token. The cache's bytes stop growing at the largest segment; the RSS should too. For comparison,
``--cache dynamic`` runs transformers' own cache (every position kept). It writes
``<out>/<tag>.json`` (default tag ``decode-generate-<cache>``) and prints a line per record.

    python benchmarks/bench_decode.py                       # L = 4K .. 1M, float32, on the CPU
    python benchmarks/bench_decode.py --lengths 4k,64k --repeats 5 --threads 1 --note "shared machine"
    python benchmarks/bench_decode.py --device cuda
    python benchmarks/bench_decode.py --generate 32768 --threads 1
    python benchmarks/bench_decode.py --generate 8192 --cache dynamic
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
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# benchlib beside this file; importing it puts the checkout's package on the path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as lib

from dilated_attention import CacheUsageWarning, dilated_attention_decode
from dilated_attention.decode import BoundedDilatedKVCache, decode_key_positions
from dilated_attention.op.slots import branch_slots

log = logging.getLogger("bench_decode")

METHODS = ("bounded", "dilated", "dense_sdpa")
CSV_FIELDS = [
    "method",
    "L",
    "B",
    "Hq",
    "Hkv",
    "D",
    "dtype",
    "keys_read",
    "cache_bytes",
    "ms_median",
    "ms_min",
    "repeats",
]


def bounded_bytes(L: int, args: argparse.Namespace, element_size: int) -> int:
    """Bytes of keys and values of one layer of a bounded cache sized for L tokens."""
    layout = branch_slots(args.segments, args.rates, args.heads // args.kv_heads, L)
    slots = sum(br.rows * br.length for br in layout)
    return 2 * args.batch * args.kv_heads * slots * args.dim * element_size


def bounded_keys_read(L: int, args: argparse.Namespace) -> int:
    """Keys the fused step loads for the token at L - 1, summed over the kv heads and divided by
    Hkv: per branch one row of ``t // r + 1`` slots where a head of the group reads that phase."""
    G = args.heads // args.kv_heads
    total = 0
    for w, r in zip(args.segments, args.rates, strict=True):
        t = (L - 1) % w
        for j in range(args.kv_heads):
            if ((t % r) - j * G) % r < min(G, r):
                total += t // r + 1
    return total // args.kv_heads


def make_bounded(L: int, args: argparse.Namespace, dtype: torch.dtype, device: torch.device):
    """A bounded cache sized for L tokens, its slots random, holding L - 1 positions, and its step."""
    cache = BoundedDilatedKVCache(
        1, args.batch, args.heads, args.kv_heads, args.dim, args.segments, args.rates,
        max_seqlen=L, dtype=dtype, device=device,
    )  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(L + 1)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g).to(t))
    cache.advance(L - 1)
    q = torch.randn(args.batch, 1, args.heads, args.dim, generator=g).to(device=device, dtype=dtype)
    kn = torch.randn(args.batch, 1, args.kv_heads, args.dim, generator=g).to(device=device, dtype=dtype)

    def bounded() -> torch.Tensor:  # the same position every repeat: the same work
        with warnings.catch_warnings():  # attending again before advance(), on purpose
            warnings.simplefilter("ignore", CacheUsageWarning)
            return cache.attend(0, q, kn, kn)

    return cache, bounded


def check_bounded(cache_k: torch.Tensor, cache_v: torch.Tensor, L: int, args: argparse.Namespace) -> float:
    """Max difference of the bounded cache's step and the full-cache step for the token at L - 1,
    the bounded cache prefilled with the first L - 1 tokens of the full cache."""
    B, Hkv, _, D = cache_k.shape
    g = torch.Generator(device="cpu").manual_seed(3)
    q = torch.randn(B, L, args.heads, D, generator=g).to(cache_k)
    k, v = cache_k[:, :, :L].transpose(1, 2), cache_v[:, :, :L].transpose(1, 2)
    cache = BoundedDilatedKVCache(
        1,
        B,
        args.heads,
        Hkv,
        D,
        args.segments,
        args.rates,
        max_seqlen=L,
        dtype=cache_k.dtype,
        device=cache_k.device,
    )
    cache.attend(0, q[:, : L - 1], k[:, : L - 1], v[:, : L - 1])
    cache.advance(L - 1)
    a = cache.attend(0, q[:, L - 1 :], k[:, L - 1 :], v[:, L - 1 :])
    full_k, full_v = k.clone(), v.clone()
    b = dilated_attention_decode(q[:, L - 1 :], full_k, full_v, L, args.segments, args.rates)
    return float((a.float() - b.float()).abs().max())


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


def plot(path: str, rows: list[dict], memory: list[dict], meta: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return False
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5))
    for i, m in enumerate(METHODS):
        pts = sorted((r["L"], r["ms_median"]) for r in rows if r["method"] == m)
        if pts:
            ax.plot(*zip(*pts, strict=True), "-o", ms=4, color=f"C{i}", label=m)
    for key, i, label in (
        ("bounded_bytes", 0, "bounded cache"),
        ("full_bytes", 2, "full cache (dilated, dense)"),
    ):
        pts = sorted((r["L"], r[key] / 2**20) for r in memory)
        bx.plot(*zip(*pts, strict=True), "-o", ms=4, color=f"C{i}", label=label)
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("cache length L (tokens)")
        a.grid(True, which="both", alpha=0.3)
        a.legend()
    ax.set_ylabel("one decode step (ms, median)")
    bx.set_ylabel("keys and values of one layer (MiB)")
    r0 = rows[0]
    where = meta.get("gpu") or f"{meta.get('cpu')} ({meta.get('torch_threads')} threads)"
    note = f"\n{meta['note']}" if meta.get("note") else ""
    fig.suptitle(
        f"decode step, {r0['dtype']}, B={r0['B']} Hq={r0['Hq']} Hkv={r0['Hkv']} D={r0['D']}, "
        f"w={meta['segments']} r={meta['rates']}\n{where}, torch {meta['torch']}, {meta['date'][:10]}{note}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_table(rows: list[dict], memory: list[dict]) -> None:
    by = {(r["method"], r["L"]): r for r in rows}
    nan = {"ms_median": float("nan"), "keys_read": "-"}
    print(
        f"{'L':>9} {'bounded ms':>11} {'dilated ms':>11} {'dense ms':>10} {'dense/bounded':>14} "
        f"{'dilated/bounded':>16} {'keys bounded':>13} {'keys dilated':>13}"
    )
    for L in sorted({r["L"] for r in rows}):
        b, d, s = (by.get((m, L), nan) for m in METHODS)
        print(
            f"{L:>9} {b['ms_median']:>11.3f} {d['ms_median']:>11.3f} {s['ms_median']:>10.3f} "
            f"{s['ms_median'] / b['ms_median']:>13.1f}x {d['ms_median'] / b['ms_median']:>15.1f}x "
            f"{b['keys_read']:>13} {d['keys_read']:>13}"
        )
    print(f"\n{'L':>9} {'bounded MiB':>12} {'full MiB':>10} {'bounded/full':>13}")
    for r in memory:
        print(
            f"{r['L']:>9} {r['bounded_bytes'] / 2**20:>12.2f} {r['full_bytes'] / 2**20:>10.2f} "
            f"{100 * r['bounded_bytes'] / r['full_bytes']:>12.2f}%"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--lengths",
        type=lib.positive_int_list,
        default=lib.int_list("4k,16k,64k,256k,1m"),
        help="cache lengths",
    )
    p.add_argument(
        "--memory-lengths",
        type=lib.positive_int_list,
        default=lib.int_list("4k,16k,64k,256k,1m,4m,16m"),
        help="cache lengths of the memory table (computed, not allocated)",
    )
    p.add_argument("--batch", type=lib.positive_int, default=1)
    p.add_argument("--heads", type=lib.positive_int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=lib.positive_int, default=2, help="key/value heads")
    p.add_argument("--dim", type=lib.positive_int, default=64, help="head dim")
    p.add_argument(
        "--segments",
        type=lib.positive_int_list,
        help="segment lengths (default 2048,8192,32768,131072,524288; with --generate 512,2048,8192)",
    )
    p.add_argument(
        "--rates",
        type=lib.positive_int_list,
        help="dilation rates (default 1,4,16,64,256; with --generate 1,4,16)",
    )
    p.add_argument("--dtype", choices=sorted(lib.DTYPES), default="float32")
    p.add_argument("--device", type=lib.device, default="cpu")
    p.add_argument(
        "--threads", type=lib.nonnegative_int, default=0, help="torch threads on the CPU (0: torch's default)"
    )
    p.add_argument("--warmup", type=lib.nonnegative_int, default=2)
    p.add_argument("--repeats", type=lib.positive_int, default=10)
    p.add_argument("--note", default="", help="a label for the run, e.g. that the machine was shared")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default=None, help="output file stem (default: decode-<machine>)")
    g = p.add_argument_group("--generate: HuggingFace generate() on the bounded cache (CPU)")
    g.add_argument("--generate", type=lib.positive_int, metavar="TOKENS", help="new tokens to generate")
    g.add_argument("--every", type=lib.positive_int, default=2048, help="record every this many tokens")
    g.add_argument("--cache", choices=["bounded", "dynamic"], default="bounded")
    args = p.parse_args(argv)
    generate = args.generate is not None
    if args.segments is None:
        args.segments = [512, 2048, 8192] if generate else [2048, 8192, 32768, 131072, 524288]
    if args.rates is None:
        args.rates = [1, 4, 16] if generate else [1, 4, 16, 64, 256]
    lib.check_branches(p, args.segments, args.rates)
    if generate and args.every > args.generate:
        p.error(f"--every {args.every} records nothing in --generate {args.generate}: give at most that")
    lib.check_heads(p, args.heads, args.kv_heads)
    lib.check_head_dim(p, args.dim, "--dim")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.generate is not None:
        return generate(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = lib.DTYPES[args.dtype]
    meta = lib.machine_info(device)
    meta.update(segments=args.segments, rates=args.rates, note=args.note)
    stem = os.path.join(args.out, args.tag or f"decode-{lib.machine_tag(meta)}")
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
    err_b = check_bounded(cache_k, cache_v, L0, args)
    log.info("check at L=%d: max |bounded - dilated| = %.2e", L0, err_b)
    if err_b > (1e-4 if dtype in (torch.float32, torch.float64) else 2e-2):
        raise SystemExit(f"the bounded step disagrees with the full-cache step at L={L0}: {err_b:.3e}")
    meta["check_bounded_max_abs_diff"] = err_b
    esize = torch.empty((), dtype=dtype).element_size()
    rows = []
    with tqdm(total=len(args.lengths) * len(METHODS), unit="case", dynamic_ncols=True) as bar:
        for L in sorted(args.lengths):
            fns = step_fns(cache_k, cache_v, L, args)
            cache, fns["bounded"] = make_bounded(L, args, dtype, device)
            reads = {
                "bounded": bounded_keys_read(L, args),
                "dilated": keys_read(L, args.heads, args.segments, args.rates),
            }
            full = 2 * args.batch * args.kv_heads * L * args.dim * esize
            for m in METHODS:
                bar.set_description(f"{m} L={L}")
                times = lib.time_ms(fns[m], device, args.warmup, args.repeats)
                rows.append(
                    {
                        "method": m,
                        "L": L,
                        "B": args.batch,
                        "Hq": args.heads,
                        "Hkv": args.kv_heads,
                        "D": args.dim,
                        "dtype": args.dtype,
                        "keys_read": reads.get(m, L),
                        "cache_bytes": cache.memory_bytes() if m == "bounded" else full,
                        "ms_median": sorted(times)[len(times) // 2],
                        "ms_min": min(times),
                        "repeats": args.repeats,
                    }
                )
                bar.update()
            del cache, fns
    memory = [
        {
            "L": L,
            "bounded_bytes": bounded_bytes(L, args, esize),
            "full_bytes": 2 * args.batch * args.kv_heads * L * args.dim * esize,
        }
        for L in sorted(set(args.memory_lengths) | set(args.lengths))
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "memory": memory}, f, indent=1)
    written = [stem + ".csv", stem + ".json"]
    if plot(stem + ".png", rows, memory, meta):
        written.append(stem + ".png")
    print_table(rows, memory)
    print("wrote " + ", ".join(written))
    return 0


# ------------------------------------------------------------------------------------------------
# --generate
# ------------------------------------------------------------------------------------------------


def _status(key: str) -> int:
    """A field of /proc/self/status in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def generate(args: argparse.Namespace) -> int:
    """--generate: the memory of HuggingFace generate() on the bounded (or dynamic) cache."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, LlamaConfig, StoppingCriteria

    import dilated_attention.transformers_cache as dtc

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=args.generate + 64, bos_token_id=None, eos_token_id=None,
        dilated_attention={"segment_lengths": args.segments, "dilation_rates": args.rates},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dilated_attention").eval()
    cache = dtc.BoundedDilatedCache(model.config) if args.cache == "bounded" else None
    rows: list[dict] = []
    start = time.perf_counter()
    meta = lib.machine_info(torch.device("cpu"))
    meta.update(
        segments=args.segments, rates=args.rates, cache=args.cache, tokens=args.generate, note=args.note
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, (args.tag or f"decode-generate-{args.cache}") + ".json")

    def save() -> None:  # after every record: a run cut short keeps what it measured
        with open(path, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    class Record(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> torch.Tensor:
            n = input_ids.shape[1] - 16
            if n % args.every == 0:
                held = cache.memory_bytes() if cache is not None else 0
                rows.append(
                    {
                        "tokens": n,
                        "rss_bytes": _status("VmRSS"),
                        "peak_rss_bytes": _status("VmHWM"),
                        "cache_bytes": held,
                        "s_per_token": (time.perf_counter() - start) / n,
                    }
                )
                print(
                    f"{n:>7} tokens  RSS {rows[-1]['rss_bytes'] / 2**20:8.1f} MiB  peak "
                    f"{rows[-1]['peak_rss_bytes'] / 2**20:8.1f} MiB  cache {held / 2**20:6.1f} MiB  "
                    f"{1e3 * rows[-1]['s_per_token']:.1f} ms/token",
                    flush=True,
                )
                save()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.randint(1, 256, (1, 16))
    kw = {"past_key_values": cache} if cache is not None else {}
    with torch.no_grad():
        model.generate(
            ids, max_new_tokens=args.generate, min_new_tokens=args.generate, do_sample=False, pad_token_id=0,
            stopping_criteria=[Record()], **kw,
        )  # fmt: skip
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
