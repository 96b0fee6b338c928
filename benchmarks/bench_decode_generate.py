"""Memory of HuggingFace ``generate()`` on the bounded cache over a long generation.

A tiny Llama (random weights, ``attn_implementation="dilated_attention"``) generates ``--tokens``
new tokens greedily with ``dilated_attention.transformers_cache.BoundedDilatedCache``; every
``--every`` tokens it records the process's resident memory (VmRSS, Linux), its peak (VmHWM), the
cache's bytes and the time per token. The cache's bytes stop growing at the largest segment; the
RSS should too. For comparison, ``--cache dynamic`` runs transformers' own cache (every position
kept). It writes ``<out>/<tag>.json`` and prints a table.

    python benchmarks/bench_decode_generate.py --tokens 32768 --threads 1
    python benchmarks/bench_decode_generate.py --tokens 8192 --cache dynamic
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args as ba
from bench import machine_info


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=ba.positive_int, default=32768, help="new tokens to generate")
    p.add_argument("--every", type=ba.positive_int, default=2048, help="record every this many tokens")
    p.add_argument("--segments", type=ba.positive_int_list, default=[512, 2048, 8192])
    p.add_argument("--rates", type=ba.positive_int_list, default=[1, 4, 16])
    p.add_argument("--cache", choices=["bounded", "dynamic"], default="bounded")
    p.add_argument("--threads", type=ba.nonnegative_int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--note", default="")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    ba.check_branches(p, args.segments, args.rates)
    if args.every > args.tokens:
        p.error(f"--every {args.every} records nothing in --tokens {args.tokens}: give at most --tokens")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, LlamaConfig, StoppingCriteria

    import dilated_attention.transformers_cache as dtc

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=args.tokens + 64, bos_token_id=None, eos_token_id=None,
        dilated_attention={"segment_lengths": args.segments, "dilation_rates": args.rates},
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dilated_attention").eval()
    cache = dtc.BoundedDilatedCache(model.config) if args.cache == "bounded" else None
    rows: list[dict] = []
    start = time.perf_counter()
    meta = machine_info(torch.device("cpu"))
    meta.update(
        segments=args.segments, rates=args.rates, cache=args.cache, tokens=args.tokens, note=args.note
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
            ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0,
            stopping_criteria=[Record()], **kw,
        )  # fmt: skip
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
