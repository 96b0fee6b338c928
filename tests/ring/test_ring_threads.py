"""A process group that RingDilatedAttention ran forward and backward on is freed by
``torch.distributed.destroy_process_group``, as one that plain collectives ran on.

The ring's backward kept the merged ``out`` and ``lse`` on its job, as the node's backward unpacks
them: tensors whose ``grad_fn`` is the node, which holds the job. That loop runs through autograd's
C++ graph, which Python's collector cannot follow, so the node, the job, its transport and the
process group were never freed: 3 gloo threads per rank stayed alive for every group a ring
backward ran on, after ``destroy_process_group`` (and the job's float32 out and gradients with
them). Two gloo ranks; every group is made with ``new_group`` and destroyed after use.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from ring_cluster import Cluster

from dilated_attention.ring import RingDilatedAttention
from dilated_attention.ring.node import SpanJob

GROUPS = 3  # groups per kind of work (the ring: per exchange mode)
SETTLE_S = 10.0  # how long a destroyed group's threads may take to end


def _threads() -> int:
    """Threads of this process: the OS's count where it is readable (gloo's threads are not Python
    threads), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _settle(limit: int) -> int:
    """The thread count once it is at most ``limit``, or after SETTLE_S."""
    end = time.monotonic() + SETTLE_S
    while _threads() > limit and time.monotonic() < end:
        time.sleep(0.05)
    return _threads()


def _plain(group: dist.ProcessGroup, rank: int, P: int) -> None:
    """The collectives the ring uses, called directly."""
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    dist.all_to_all_single(torch.empty(2 * P), torch.ones(2 * P), group=group)
    peer = dist.get_global_rank(group, (rank + 1) % P)
    ops = [
        dist.P2POp(dist.irecv, torch.empty(4), dist.get_global_rank(group, (rank - 1) % P), group),
        dist.P2POp(dist.isend, torch.ones(4), peer, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _ring(group: dist.ProcessGroup, comm: str) -> None:
    """A ring forward and backward with local runs and a segment that spans both ranks."""
    module = RingDilatedAttention([8, 32], [1, 2], process_group=group, comm=comm)
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    out, lse = module(q, k, v, is_causal=True, return_lse=True)
    (out.sum() + lse.sum()).backward()


def growth(rank: int, P: int) -> dict[str, int]:
    """Threads left after creating, using and destroying groups: plain collectives, then the ring
    in both exchange modes; and the ring jobs still alive after the last."""
    torch.manual_seed(rank)
    result = {}
    for kind in ("plain", "all_gather", "ring"):
        before = _threads()
        for _ in range(GROUPS):
            group = dist.new_group(list(range(P)), backend="gloo")
            if kind == "plain":
                _plain(group, rank, P)
            else:
                _ring(group, kind)
            dist.destroy_process_group(group)
            del group
        limit = before + result.get("plain", 0)
        result[kind] = _settle(limit) - before
    gc.collect()
    result["jobs"] = sum(type(o) is SpanJob for o in gc.get_objects())
    return result


@pytest.fixture(scope="module")
def cluster2():
    cluster = Cluster(2)
    yield cluster
    cluster.close()


def test_destroyed_groups_leave_no_threads(cluster2):
    for rank, result in enumerate(cluster2.run(growth)):
        for comm in ("all_gather", "ring"):
            assert result[comm] <= result["plain"], (
                f"rank {rank}: {result[comm]} threads left after {GROUPS} groups with a ring forward "
                f"and backward (comm={comm!r}), {result['plain']} after plain collectives: {result}"
            )
        assert result["jobs"] == 0, f"rank {rank}: {result['jobs']} ring jobs alive after their backward"
