"""The ``sdpa`` backend on the CPU before and after the strided-view driver: time and peak memory.

Each measurement runs in a fresh process (peak resident memory is per process): forward, then
backward of ``out.sum()``, on q, k, v of shape (1, N, 8, 64), LongNet branches w = [2048, 8192,
32768] (cut to N), r = [1, 2, 4]. ``--baseline DIR`` is a checkout of the commit before the view
driver (``git worktree add DIR <commit>``, with the compiled extension copied in); its package is imported
instead of this tree's for the "before" rows.

    python benchmarks/bench_sdpa_views.py --baseline /tmp/da_base --n 16384 65536 \\
        --dtype float32 bfloat16 --out benchmarks/results/sdpa-views-cpu.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as lib  # noqa: E402  (benchmarks/ is not a package; benchlib does not import the package)

VARIANTS = ("before", "after", "after-op-bwd")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def _measure(n: int, dtype_name: str, checkout: str) -> dict:
    """One measurement, of the package of ``checkout`` (first on the path: it wins over this tree)."""
    import resource

    sys.path.insert(0, checkout)

    import torch

    from dilated_attention import dilated_attention
    from dilated_attention.backends import get_backend

    if os.environ.get("DA_BENCH_OP_BWD"):  # the fused CPU operator's backward (outside the rule)
        type(get_backend("sdpa")).cpu_kernel_backward = True
    dtype = getattr(torch, dtype_name)
    segs = [min(w, n) for w in (2048, 8192, 32768)]
    q, k, v = (torch.randn(1, n, 8, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    small = [t[:, :512].detach().requires_grad_() for t in (q, k, v)]
    dilated_attention(*small, [min(s, 512) for s in segs], [1, 2, 4], backend="sdpa").sum().backward()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = dilated_attention(q, k, v, segs, [1, 2, 4], backend="sdpa")
    t1 = time.perf_counter()
    out.float().sum().backward()
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"fwd_s": t1 - t0, "bwd_s": t2 - t1, "peak_mib": (peak - base) / 1024}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--baseline", type=lib.existing_dir, help="checkout of the commit before (the 'before' rows)"
    )
    p.add_argument("--n", type=lib.positive_int, nargs="+", default=[16384])
    p.add_argument("--dtype", nargs="+", choices=DTYPE_NAMES, default=["float32"])
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="before: the baseline checkout; after: this tree; after-op-bwd: this tree with the fused "
        "CPU backward operator (SdpaBackend.cpu_kernel_backward = True)",
    )
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # N DTYPE CHECKOUT: in the child
    a = p.parse_args(argv)
    if a.one:
        return a
    if a.baseline is not None:
        if not (Path(a.baseline) / "dilated_attention").is_dir():
            p.error(f"--baseline {a.baseline}: not a checkout of the project (no dilated_attention/ in it)")
        a.baseline = Path(a.baseline)
    elif "before" in a.variants and a.variants != p.get_default("variants"):
        p.error("--variants before needs --baseline DIR (a checkout of the commit before)")
    if a.out is not None and not a.out.parent.is_dir():
        p.error(f"--out {a.out}: the directory {a.out.parent} does not exist")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.one:
        print(json.dumps(_measure(int(a.one[0]), a.one[1], a.one[2])))
        return
    paths = {"before": a.baseline, "after": ROOT, "after-op-bwd": ROOT}
    impls = [(v, paths[v]) for v in a.variants if paths[v] is not None]
    lines = [
        f"sdpa backend, CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
        "(1, N, 8, 64), w=[2048, 8192, 32768], r=[1, 2, 4], non-causal, fwd + bwd; peak = growth of "
        "the process's peak resident memory during the step",
        f"{'N':>6} {'dtype':>9} {'impl':>12} {'fwd s':>8} {'bwd s':>8} {'total s':>8} {'peak MiB':>9}",
    ]
    for n in a.n:
        for dt in a.dtype:
            for name, path in impls:
                env = dict(os.environ)
                if name == "after-op-bwd":
                    env["DA_BENCH_OP_BWD"] = "1"
                res = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--one", str(n), dt, str(path)],
                    env=env,
                    cwd="/tmp",
                    capture_output=True,
                    text=True,
                    check=True,
                )
                r = json.loads(res.stdout.strip().splitlines()[-1])
                lines.append(
                    f"{n:>6} {dt:>9} {name:>12} {r['fwd_s']:>8.2f} {r['bwd_s']:>8.2f} "
                    f"{r['fwd_s'] + r['bwd_s']:>8.2f} {r['peak_mib']:>9.0f}"
                )
                print(lines[-1], flush=True)
                if a.out:
                    a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
