"""Sequence parallelism on the CPU: P gloo processes against one process, side by side in one run.

For every combination of causal masking, exchange mode (``all_gather``, ``ring``) and layout
(``contiguous``, ``zigzag``), it times the forward+backward of

* ``single``: the one-process op (``dilated_attention``, backend ``native``) on the whole sequence
  with all the cores (``--threads``), in this process;
* ``split``: :class:`dilated_attention.ring.RingDilatedAttention` on ``P`` spawned processes in one
  gloo group, the cores split evenly between them (``--threads / P`` intra-op threads each, and
  each process pinned to its own cores where the OS allows), each holding ``N / P`` positions;

rounds of the two interleaved, and reports the ratio split / single (the parallel overhead: 1.0
is perfect scaling of the work, the target is at most 1.15), the share of the split run's wall
time that the slowest rank spent in communication calls and waiting for their completion
(``comm_stats()['...']['wait_s']``, transfers not hidden behind computation), the busiest and
idlest rank's time, and the bytes each rank sent and received per forward+backward. It also
prints, from the exchange plans alone (no processes), the bytes per rank at ``N``, ``2N`` and ``4N``
with ``2P`` and ``4P`` ranks (the same positions per rank): they do not grow with ``N``.

    python benchmarks/bench_ring.py                           # the problem of the target: N = 32768
    python benchmarks/bench_ring.py --n 8192 --segments 512 2048 8192 --tag reduced

It writes ``<out>/<tag>.txt`` (the table), ``.json`` and ``.csv``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # benchlib, and the package of this checkout
import benchlib as lib  # noqa: E402  (benchmarks/ is not a package)

from dilated_attention import dilated_attention  # noqa: E402
from dilated_attention.ring import COMM_MODES, RingDilatedAttention, comm_stats, reset_comm_stats  # noqa: E402
from dilated_attention.ring.geometry import LAYOUTS, Plan, make_layout  # noqa: E402

DTYPES = {name: lib.DTYPES[name] for name in ("float32", "bfloat16", "float64")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=lib.positive_int, default=32768, help="sequence length N")
    p.add_argument("--batch", type=lib.positive_int, default=1)
    p.add_argument("--heads", type=lib.positive_int, default=8)
    p.add_argument("--head-dim", type=lib.positive_int, default=64)
    p.add_argument("--segments", type=lib.positive_int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--rates", type=lib.positive_int, nargs="+", default=[1, 2, 4])
    p.add_argument("--procs", type=lib.positive_int, default=2, help="P, the processes of the split run")
    p.add_argument(
        "--threads",
        type=lib.positive_int,
        default=os.cpu_count(),
        help="cores in all; P processes get 1/P each",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--comms", nargs="+", choices=COMM_MODES, default=list(COMM_MODES))
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--rounds", type=lib.positive_int, default=3, help="timed rounds (median)")
    p.add_argument("--warmup", type=lib.nonnegative_int, default=1)
    p.add_argument("--tag", default=None, help="output name; default: ring-<machine>-N<n>")
    p.add_argument("--note", default="", help="a line about the conditions, written with the results")
    p.add_argument("--out", default=str(lib.RESULTS))
    args = p.parse_args(argv)
    if len(args.segments) != len(args.rates) and args.rates == p.get_default("rates"):
        p.error(
            f"--segments {' '.join(map(str, args.segments))}: give --rates too (one rate per segment; "
            f"the default --rates {' '.join(map(str, args.rates))} has {len(args.rates)})"
        )
    lib.check_branches(p, args.segments, args.rates)
    lib.check_head_dim(p, args.head_dim, "--head-dim")
    if args.n % (2 * args.procs):
        p.error(f"--n {args.n} must be divisible by 2 * --procs = {2 * args.procs}")
    return args


def _inputs(args: argparse.Namespace, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[args.dtype]
    shape_q = (args.batch, args.n, args.heads, args.head_dim)
    q, k, v, dout = (torch.randn(shape_q, generator=g).to(dt) for _ in range(4))
    return q, k, v, dout


def _pin(rank: int, P: int, threads: int) -> None:
    """Use ``threads // P`` cores, and the rank's own ones where the OS lets us pin."""
    per = max(1, threads // P)
    torch.set_num_threads(per)
    try:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= per * P:
            os.sched_setaffinity(0, cores[rank * per : (rank + 1) * per])
    except (AttributeError, OSError):
        pass


# ------------------------------------------------------------------------------------------------
# The split run: P processes
# ------------------------------------------------------------------------------------------------


def _split_case(rank: int, P: int, args: argparse.Namespace, causal: bool, comm: str, layout: str) -> dict:
    from dilated_attention.ring import shard_sequence

    q, k, v, dout = (shard_sequence(t, layout=layout).contiguous() for t in _inputs(args))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attn = RingDilatedAttention(
        args.segments, args.rates, comm=comm, layout=layout, attention_backend="native"
    )
    times, waits, nbytes = [], [], []
    for i in range(args.warmup + args.rounds):
        dist.barrier()
        reset_comm_stats(timing=True)
        t0 = time.perf_counter()
        out = attn(q, k, v, is_causal=causal)
        out.backward(dout)
        elapsed = time.perf_counter() - t0
        stats = comm_stats()
        if i >= args.warmup:
            times.append(elapsed)
            waits.append(sum(stats.get(ph, {}).get("wait_s", 0.0) for ph in ("forward", "backward")))
            nbytes.append(
                sum(
                    stats.get(ph, {}).get(x, 0)
                    for ph in ("forward", "backward")
                    for x in ("sent", "received")
                )
            )
        q.grad = k.grad = v.grad = None
    return {"times": times, "waits": waits, "bytes": nbytes}


def _serve(rank: int, P: int, port: int, args: argparse.Namespace, tasks: Any, results: Any) -> None:
    _pin(rank, P, args.threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
            timeout=datetime.timedelta(seconds=1800),
        )  # fmt: skip
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            dist.destroy_process_group()
            return
        try:
            results.put((rank, "ok", _split_case(rank, P, args, *task)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))


class Workers:
    """P processes in one gloo group, kept for all the cases."""

    def __init__(self, args: argparse.Namespace) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.P, self.results = args.procs, ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.P)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.P, port, args, self.tasks[r], self.results), daemon=True)
            for r in range(self.P)
        ]
        for p in self.procs:
            p.start()

    def run(self, *task: Any) -> list[dict]:
        for t in self.tasks:
            t.put(task)
        got, errors = {}, []
        while len(got) + len(errors) < self.P:
            rank, status, payload = self.results.get(timeout=3600)
            if status == "ok":
                got[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return [got[r] for r in range(self.P)]

    def close(self) -> None:
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# ------------------------------------------------------------------------------------------------
# The single-process run, and the bytes from the plans
# ------------------------------------------------------------------------------------------------


def _single_round(args: argparse.Namespace, inputs: tuple[torch.Tensor, ...], causal: bool) -> float:
    q, k, v, dout = inputs
    t0 = time.perf_counter()
    out = dilated_attention(q, k, v, args.segments, args.rates, is_causal=causal, backend="native")
    out.backward(dout)
    elapsed = time.perf_counter() - t0
    q.grad = k.grad = v.grad = None
    return elapsed


def plan_bytes(args: argparse.Namespace, P: int, N: int, layout: str, causal: bool) -> int:
    """Most bytes any rank sends plus receives per forward+backward, from the exchange plans
    (keys and values forward in the input dtype, their gradients back in the accumulation dtype)."""
    itemsize = DTYPES[args.dtype].itemsize
    acc = 8 if args.dtype == "float64" else 4
    L = make_layout(layout, P, N // P)
    worst = 0
    for j in range(P):
        plan = Plan(L, j, args.segments, args.rates, args.heads, args.heads, causal)
        elems = 0
        for items in [*plan.recv_items.values(), *plan.send_items.values()]:
            elems += sum(2 * plan.item_numel(p, b, args.batch, args.head_dim) for p, b in items)
        worst = max(worst, elems * (itemsize + acc))
    return worst


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    info = lib.machine_info(torch.device("cpu"))
    tag = args.tag or f"ring-cpu-{args.threads}core-N{args.n}"
    cases = [(c, m, lay) for c in causals for m in args.comms for lay in args.layouts]
    workers = Workers(args)
    rows = []
    try:
        inputs = tuple(t.requires_grad_(i < 3) for i, t in enumerate(_inputs(args)))
        for causal in causals:
            single: list[float] = []
            for _ in range(args.warmup):
                _single_round(args, inputs, causal)
            for causal_, comm, layout in [c for c in cases if c[0] == causal]:
                split = workers.run(causal_, comm, layout)
                single.append(_single_round(args, inputs, causal))  # interleaved with the split runs
                wall = [max(r["times"][i] for r in split) for i in range(args.rounds)]
                slowest = max(range(args.procs), key=lambda r: statistics.median(split[r]["times"]))
                rank_med = [statistics.median(r["times"]) for r in split]
                rows.append(
                    {
                        "causal": causal,
                        "comm": comm,
                        "layout": layout,
                        "split_s": statistics.median(wall),
                        "rank_s": rank_med,
                        "comm_share": statistics.median(split[slowest]["waits"]) / rank_med[slowest],
                        "bytes_per_rank": max(statistics.median(r["bytes"]) for r in split),
                    }
                )
            single_s = statistics.median(single)
            for row in rows:
                if row["causal"] == causal:
                    row["single_s"] = single_s
                    row["ratio"] = row["split_s"] / single_s
            print(f"causal={causal}: one process {single_s:.2f} s", flush=True)
    finally:
        workers.close()
    scaling = {
        f"N={args.n * m}, P={args.procs * m}": plan_bytes(
            args, args.procs * m, args.n * m, "contiguous", True
        )
        for m in (1, 2, 4)
    }
    meta = {"args": vars(args), "machine": info, "note": args.note, "plan_bytes_causal_contiguous": scaling}
    write(args, tag, rows, meta)
    return 0


def _fmt_table(args: argparse.Namespace, rows: list[dict], meta: dict) -> str:
    m = meta["machine"]
    lines = [
        "python benchmarks/bench_ring.py " + " ".join(sys.argv[1:]),
        f"({m['date']}, commit {m.get('git_commit')}, {m.get('cpu')}, {m.get('cpu_count')} cores, torch {m['torch']})",
    ]
    if meta["note"]:
        lines.append(meta["note"])
    lines += [
        f"problem: B={args.batch}, N={args.n}, H={args.heads}, D={args.head_dim}, {args.dtype}, "
        f"w={args.segments}, r={args.rates}; forward+backward; P={args.procs} gloo processes x "
        f"{max(1, args.threads // args.procs)} threads against 1 process x {args.threads} threads; "
        f"median of {args.rounds} rounds",
        "",
        f"{'causal':>6}  {'comm':>10}  {'layout':>10}  {'1 proc s':>8}  {'split s':>8}  {'ratio':>6}  "
        f"{'comm %':>6}  {'ranks s (each)':>18}  {'MiB/rank':>8}",
    ]
    for r in rows:
        ranks = "/".join(f"{t:.2f}" for t in r["rank_s"])
        lines.append(
            f"{'yes' if r['causal'] else 'no':>6}  {r['comm']:>10}  {r['layout']:>10}  {r['single_s']:8.2f}  "
            f"{r['split_s']:8.2f}  {r['ratio']:6.2f}  {100 * r['comm_share']:6.1f}  {ranks:>18}  "
            f"{r['bytes_per_rank'] / 2**20:8.1f}"
        )
    best = {
        c: min((r for r in rows if r["causal"] == c), key=lambda r: r["ratio"])
        for c in {r["causal"] for r in rows}
    }
    lines.append("")
    for c, r in sorted(best.items()):
        verdict = "met" if r["ratio"] <= 1.15 else "not met"
        lines.append(
            f"{'causal' if c else 'not causal'}: best split/single {r['ratio']:.2f} ({r['comm']}, {r['layout']}); "
            f"target <= 1.15: {verdict}"
        )
    lines.append("bytes per rank (sent + received, forward+backward, causal, contiguous, from the plans):")
    for k, b in meta["plan_bytes_causal_contiguous"].items():
        lines.append(f"  {k}: {b / 2**20:.1f} MiB")
    return "\n".join(lines) + "\n"


def write(args: argparse.Namespace, tag: str, rows: list[dict], meta: dict) -> None:
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, tag)
    text = _fmt_table(args, rows, meta)
    print(text)
    with open(stem + ".txt", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump({"rows": rows, **meta}, f, indent=1)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "rank_s"])
        w.writeheader()
        for r in rows:
            w.writerow({k: v for k, v in r.items() if k != "rank_s"})
    print(f"wrote {stem}.txt, .json, .csv")


if __name__ == "__main__":
    sys.exit(main())
