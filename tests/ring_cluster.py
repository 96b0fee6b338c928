"""Running test functions on ``P`` gloo processes, for the sequence-parallel tests.

The processes are started with ``torch.multiprocessing`` (spawn) and meet through a file store in
a fresh temporary directory, so that clusters of tests running at the same time cannot meet each
other (no port to race for). Every run has a deadline after which the processes are killed and
the test fails, and the process group has a short timeout, so nothing can hang.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RUN_DEADLINE_S = 180.0  # a whole multi-process run; the processes are killed after it
PG_TIMEOUT_S = 60.0  # the process group's timeout in the correctness runs


def _serve(rank: int, P: int, store: str, timeout_s: float, tasks: Any, results: Any) -> None:
    """A rank of the cluster: joins the gloo group, then runs ``fn(rank, P, *args)`` for every task."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=P,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            dist.destroy_process_group()
            return
        fn, args = task
        try:
            results.put((rank, "ok", fn(rank, P, *args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))


class Cluster:
    """``P`` spawned processes in one gloo group, kept for several tasks.

    :meth:`run` fails the test when a rank raises, and kills every process when the deadline
    passes, so that no test can hang. ``timeout_s`` is the process group's timeout."""

    def __init__(self, P: int, timeout_s: float = PG_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")
        self.P, self.results, self.broken = P, ctx.Queue(), None
        self.tasks = [ctx.Queue() for _ in range(P)]
        self.dir = tempfile.mkdtemp(prefix="da_ring_")
        store = os.path.join(self.dir, "store")
        self.procs = [
            ctx.Process(
                target=_serve, args=(r, P, store, timeout_s, self.tasks[r], self.results), daemon=True
            )
            for r in range(P)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any, deadline: float = RUN_DEADLINE_S) -> list[Any]:
        """``fn(rank, P, *args)`` on every rank; the results by rank."""
        if self.broken:
            pytest.fail(f"the {self.P}-process group is unusable: {self.broken}")
        for q in self.tasks:
            q.put((fn, args))
        got: dict[int, Any] = {}
        errors = []
        end = time.monotonic() + deadline
        while len(got) + len(errors) < self.P:
            try:
                rank, status, payload = self.results.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                self.broken = (
                    f"{fn.__name__} did not finish within {deadline:.0f} s (finished: {sorted(got)})"
                )
                self.close()
                pytest.fail(self.broken)
            if status == "ok":
                got[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
        if errors:
            pytest.fail("\n".join(errors))
        return [got[r] for r in range(self.P)]

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        end = time.monotonic() + 2.0  # then kill: interpreter shutdown is slow on a loaded machine
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)


def inputs(B: int, N: int, Hq: int, Hkv: int, D: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v and output/lse cotangents, float64, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, N, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, N, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, N, generator=g, dtype=torch.float64)
    return q, k, v, dout, dlse


def loss(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor) -> torch.Tensor:
    """<out, dout> + <lse, dlse>, with lse's -inf entries left out."""
    lse = lse.double()
    return (out.double() * dout).sum() + (
        torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse
    ).sum()
