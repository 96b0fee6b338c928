"""Host cost of one dilated-attention call: the operations it dispatches, forward and backward.

For each backend it calls ``dilated_attention(q, k, v, segments, rates, is_causal=..., backend=...)``
once on real tensors (B, N, H, D) and then ``out.backward(dout)``, each under a
``torch.utils._python_dispatch.TorchDispatchMode`` that counts every operation that reaches the
dispatcher below autograd: ATen operations (views, copies, matmuls, ...) and the extension's own
ops (``dilated_attention.fwd``, ``dilated_attention.bwd``), each call counted once. Every one of them
is a trip through the dispatcher on the host, and on a GPU most are a kernel launch; the count is a
measure of the host work per call that does not depend on how fast the machine is.

The count depends on the device (the CPU and CUDA paths of a backend differ) and on the shape
(gathering backends dispatch per segment and per phase), so it is quoted with both. The first call
and later calls dispatch the same operations on the CPU here (the caches of index patterns are
built from plain Python); ``--warmup`` counts a call made after that many uncounted ones.

    python benchmarks/bench_dispatch.py                       # N = 16K, H = 12, D = 64, native and sdpa
    python benchmarks/bench_dispatch.py --backends native,sdpa,manual --n 4k
    python benchmarks/bench_dispatch.py --device cuda --dtype bfloat16 --out dispatch-h100.md

It writes nothing unless ``--out FILE`` names a markdown file to write the table to.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib beside this file (it adds the checkout)
import benchlib as lib

from dilated_attention import BACKEND_CHOICES, dilated_attention, select_backend

DTYPES = {name: lib.DTYPES[name] for name in ("float32", "bfloat16", "float16")}
DEFAULT_BACKENDS = ["native", "sdpa"]  # manual materializes each segment's scores: minutes at 16K


class DispatchCounter(TorchDispatchMode):
    """Counts the operations dispatched while it is active, by name (``aten.slice``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


backend_list = lib.names_among(BACKEND_CHOICES)


def count_call(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: argparse.Namespace
) -> tuple[DispatchCounter, DispatchCounter, float]:
    """The counters of one forward and one backward of ``backend``, and their seconds together."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)

    def call() -> torch.Tensor:
        return dilated_attention(
            *leaves, args.segments, args.rates, is_causal=bool(args.causal), backend=backend
        )

    for _ in range(args.warmup):
        call().backward(dout)
    t0 = time.perf_counter()
    with DispatchCounter() as fwd:
        out = call()
    with DispatchCounter() as bwd:
        out.backward(dout)
    if q.device.type == "cuda":
        torch.cuda.synchronize(q.device)
    return fwd, bwd, time.perf_counter() - t0


def ran_as(backend: str, q: torch.Tensor, k: torch.Tensor) -> str:
    """What computes the attention when ``backend`` is asked for (the backend layer's choice)."""
    impl = select_backend(backend, q, k, dropout_p=0.0)
    name = getattr(impl, "name", type(impl).__name__)
    return name if name == backend else f"{name} (asked: {backend})"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of the counts."""
    lines = [
        "| backend | runs as | forward | backward | total | seconds | most dispatched (forward + backward) |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['backend']} | failed: {r['error']} | - | - | - | - | - |")
            continue
        top = ", ".join(f"{name} {n}" for name, n in r["top"])
        lines.append(
            f"| {r['backend']} | {r['ran_as']} | {r['forward']} | {r['backward']} | "
            f"{r['forward'] + r['backward']} | {r['seconds']:.1f} | {top} |"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=lib.positive_int, default=16 * 1024, help="sequence length (e.g. 16k)")
    p.add_argument("--batch", type=lib.positive_int, default=1)
    p.add_argument("--heads", type=lib.positive_int, default=12, help="query heads")
    p.add_argument(
        "--kv-heads", type=lib.positive_int, default=None, help="key/value heads (default: --heads)"
    )
    p.add_argument("--dim", type=lib.positive_int, default=64, help="head dim")
    p.add_argument("--segments", type=lib.positive_int_list, default=[2048, 4096, 8192, 16384])
    p.add_argument("--rates", type=lib.positive_int_list, default=[1, 2, 4, 8])
    p.add_argument("--causal", type=int, choices=(0, 1), default=1)
    p.add_argument(
        "--backends",
        type=backend_list,
        default=DEFAULT_BACKENDS,
        help=f"comma-separated, among {','.join(BACKEND_CHOICES)} (default: native,sdpa)",
    )
    p.add_argument("--device", type=lib.device, default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--warmup", type=lib.nonnegative_int, default=0, help="uncounted calls before the counted one"
    )
    p.add_argument("--top", type=lib.nonnegative_int, default=4, help="most dispatched ops shown per backend")
    p.add_argument("--out", default=None, help="write the table to this markdown file")
    args = p.parse_args(argv)
    lib.check_branches(p, args.segments, args.rates)
    lib.check_heads(p, args.heads, args.kv_heads)
    lib.check_head_dim(p, args.dim, "--dim")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        p.error(f"--out {args.out}: its folder does not exist")
    return args


def count_backends(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per backend of ``args.backends``: its counts, or why it failed."""
    from tqdm import tqdm

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    kv_heads = args.kv_heads or args.heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, args.n, args.heads, args.dim, generator=g).to(device, dtype)
    k, v = (torch.randn(args.batch, args.n, kv_heads, args.dim, generator=g).to(device, dtype) for _ in "kv")
    rows: list[dict[str, Any]] = []
    with tqdm(args.backends, unit="backend", dynamic_ncols=True) as bar:
        for backend in bar:
            bar.set_description(backend)
            row: dict[str, Any] = {"backend": backend, "error": ""}
            try:
                row["ran_as"] = ran_as(backend, q, k)
                fwd, bwd, seconds = count_call(backend, q, k, v, args)
                row.update(forward=fwd.total, backward=bwd.total, seconds=seconds)
                row["top"] = (fwd.counts + bwd.counts).most_common(args.top)
            except Exception as exc:  # a backend that cannot run here is a row saying why
                lines = [s for s in str(exc).splitlines() if s.strip()]
                row["error"] = type(exc).__name__ + (f": {lines[0][:160]}" if lines else "")
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = count_backends(args)
    device = torch.device(args.device)
    kv_heads = args.kv_heads or args.heads
    where = (
        f"{lib.device_name(device)} ({args.device}), {args.dtype}, torch {torch.__version__}, "
        f"commit {lib.git_commit()}, {datetime.datetime.now(datetime.timezone.utc).date()}"
    )
    shape = (
        f"B={args.batch} N={args.n} H={args.heads} Hkv={kv_heads} D={args.dim} causal={bool(args.causal)} "
        f"segments {args.segments} rates {args.rates}"
    )
    lines = table(rows)
    print(f"operations dispatched per dilated_attention call, {shape}\n{where}\n")
    print("\n".join(lines))
    if args.out:
        text = [
            "# Operations dispatched per dilated_attention call",
            "",
            f"{shape}; counted on {where}.",
            "",
            *lines,
            "",
        ]
        Path(args.out).write_text("\n".join(text))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
