"""RingDilatedAttention (SPEC section 5) across 2 and 4 gloo processes on the CPU.

Every rank compares its chunk of out, lse, dq, dk and dv with the float64 dense reference run on
the whole sequence, under the tolerance rule of SPEC section 4. The processes are started with
``torch.multiprocessing`` (spawn) on a free port; every run has a deadline after which the
processes are killed and the test fails, and the process group has a short timeout, so nothing
can hang.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from reference import reference_attention
from tolerance import assert_within_rule

from dilated_attention import dilated_attention as dattn
from dilated_attention.ring import (
    RingDilatedAttention,
    RingDilatedAttentionV2Collective,
    RingMultiheadDilatedAttention,
    StandardizedRingConfig,
    comm_stats,
    reset_comm_stats,
    shard_sequence,
)
from dilated_attention.ring.geometry import make_layout

RUN_DEADLINE_S = 180.0  # a whole multi-process run; the processes are killed after it
PG_TIMEOUT_S = 60.0  # the process group's timeout in the correctness runs

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# ---------------------------------------------------------------------------------------------
# Running functions on P gloo processes
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, P: int, port: int, tasks: Any, results: Any) -> None:
    """A rank of the cluster: joins the gloo group, then runs ``fn(rank, P, *args)`` for every task."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=P,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
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
    """``P`` spawned processes in one gloo group (on a free port), kept for several tasks.

    :meth:`run` fails the test when a rank raises, and kills every process when the deadline
    passes, so that no test can hang."""

    def __init__(self, P: int) -> None:
        ctx = mp.get_context("spawn")
        self.P, self.results, self.broken = P, ctx.Queue(), None
        self.tasks = [ctx.Queue() for _ in range(P)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_serve, args=(r, P, port, self.tasks[r], self.results), daemon=True)
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


@pytest.fixture(scope="module")
def cluster2():
    cluster = Cluster(2)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def cluster4():
    cluster = Cluster(4)
    yield cluster
    cluster.close()


# ---------------------------------------------------------------------------------------------
# Correctness against the float64 reference
# ---------------------------------------------------------------------------------------------


def _inputs(B: int, N: int, Hq: int, Hkv: int, D: int, seed: int = 0):
    """Full-sequence q, k, v and output/lse cotangents, float64, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, N, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, N, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, N, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, N, generator=g, dtype=torch.float64)
    return q, k, v, dout, dlse


def _loss(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor) -> torch.Tensor:
    """<out, dout> + <lse, dlse>, with lse's -inf entries left out."""
    lse = lse.double()
    return (out.double() * dout).sum() + (
        torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse
    ).sum()


def _reference(q, k, v, dout, dlse, segs, rates, causal, dtype):
    """(out, lse, dq, dk, dv) of the dense reference on the whole sequence, computed in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*leaves, segs, rates, causal, dtype=dtype)
    grads = torch.autograd.grad(_loss(out, lse, dout, dlse), leaves)
    return (out.detach(), lse.detach(), *grads)


def check_cases(rank: int, P: int, cases: list[tuple], backend: str = "auto") -> dict[str, str | None]:
    """Run every case on this rank (the local pieces on ``backend``); map its id to None (pass) or
    the failure message."""
    report: dict[str, str | None] = {}
    for case_id, B, N, Hq, Hkv, D, segs, rates, causal, comm, dtype_name, layout in cases:
        try:
            dtype = DTYPES[dtype_name]
            q, k, v, dout, dlse = _inputs(B, N, Hq, Hkv, D, seed=N + Hq)
            expected = _reference(q, k, v, dout, dlse, segs, rates, causal, torch.float64)
            plain = _reference(q, k, v, dout, dlse, segs, rates, causal, dtype)
            chunk = N // P
            sl = make_layout(layout, P, chunk).positions(rank)  # this rank's positions
            mine = [t[:, sl].to(dtype).requires_grad_() for t in (q, k, v)]
            module = RingDilatedAttention(segs, rates, comm=comm, attention_backend=backend, layout=layout)
            out, lse = module(*mine, is_causal=causal, return_lse=True)
            assert out.dtype == dtype and out.shape == mine[0].shape
            assert lse.shape == (B, Hq, chunk)
            grads = torch.autograd.grad(_loss(out, lse, dout[:, sl], dlse[:, :, sl]), mine)
            got = (out, lse, *grads)
            for name, a, e, p in zip(("out", "lse", "dq", "dk", "dv"), got, expected, plain, strict=True):
                seq = slice(None), slice(None), sl  # lse is (B, H, N)
                idx = seq if name == "lse" else (slice(None), sl)
                assert a.dtype == (
                    dtype if name != "lse" else (torch.float64 if dtype == torch.float64 else torch.float32)
                ), f"{name} dtype {a.dtype}"
                assert_within_rule(name, a, e[idx], p[idx], dtype)
            report[case_id] = None
        except Exception:
            report[case_id] = traceback.format_exc()
    return report


def _grid(
    base: list[tuple],
    comms=("all_gather", "ring"),
    causals=(False, True),
    dtypes=("float64", "float32"),
    layout: str = "contiguous",
) -> list[tuple]:
    cases = []
    for name, B, N, Hq, Hkv, D, segs, rates in base:
        for comm in comms:
            for causal in causals:
                for dt in dtypes:
                    cid = f"{name}-{comm}-{'causal' if causal else 'full'}-{dt}"
                    if layout != "contiguous":
                        cid += f"-{layout}"
                    cases.append((cid, B, N, Hq, Hkv, D, segs, rates, causal, comm, dt, layout))
    return cases


# (name, B, N, Hq, Hkv, D, segment_lengths, dilation_rates)
BASE_2 = [
    ("local", 1, 16, 2, 2, 8, [4, 8], [1, 2]),  # segments tile each chunk: no exchange
    ("straddle-gqa", 2, 24, 4, 2, 8, [10], [2]),  # l=12: the segment [10, 20) crosses the boundary
    ("span-w-gt-l", 1, 32, 4, 4, 8, [16, 32], [1, 2]),  # l=16: [32] spans both ranks
    ("mixed-w-gt-N", 1, 20, 6, 3, 8, [3, 8, 40], [1, 2, 4]),  # local, straddling and whole-sequence
    ("mqa-ragged", 1, 36, 4, 1, 8, [5, 12], [2, 3]),  # one kv head, ragged last segments
]
BASE_4 = [
    ("span4-gqa", 1, 32, 4, 2, 8, [8, 16, 64], [1, 2, 4]),  # l=8: local, 2-rank and 4-rank segments
    ("straddle4", 1, 36, 4, 4, 8, [6, 12], [1, 3]),  # l=9: every segment boundary straddles
]
CASES_2 = _grid(BASE_2, dtypes=tuple(DTYPES)) + _grid(BASE_2, dtypes=("float64", "float32"), layout="zigzag")
CASES_4 = _grid(BASE_4, dtypes=("float64", "float32", "bfloat16")) + _grid(BASE_4[:1], layout="zigzag")


def _merge_reports(reports: list[dict[str, str | None]]) -> dict[str, str | None]:
    merged: dict[str, str | None] = {}
    for rank, report in enumerate(reports):
        for cid, err in report.items():
            if err is not None and merged.get(cid) is None:
                merged[cid] = f"rank {rank}: {err}"
            merged.setdefault(cid, None)
    return merged


@pytest.fixture(scope="module")
def results_2(cluster2) -> dict[str, str | None]:
    return _merge_reports(cluster2.run(check_cases, CASES_2))


@pytest.fixture(scope="module")
def results_4(cluster4) -> dict[str, str | None]:
    return _merge_reports(cluster4.run(check_cases, CASES_4))


@pytest.mark.parametrize("case_id", [c[0] for c in CASES_2])
def test_two_ranks_match_reference(results_2, case_id):
    assert case_id in results_2
    assert results_2[case_id] is None, results_2[case_id]


@pytest.mark.parametrize("backend", ["manual", "sdpa"])
def test_other_local_backends_match_reference(cluster2, backend):
    cases = [c for c in CASES_2 if c[0].startswith("mixed-w-gt-N") and c[-2] in ("float64", "float32")]
    report = _merge_reports(cluster2.run(check_cases, cases, backend))
    assert len(report) == len(cases)
    assert all(err is None for err in report.values()), report


@pytest.mark.parametrize("case_id", [c[0] for c in CASES_4])
def test_four_ranks_match_reference(results_4, case_id):
    assert case_id in results_4
    assert results_4[case_id] is None, results_4[case_id]


def multihead(rank: int, P: int, comm: str) -> list[tuple[str, float]]:
    """RingMultiheadDilatedAttention on chunks against projections + the dense reference on the
    whole sequence (float64): the output chunk, the input gradient chunk, and the weight gradients
    summed over ranks (as data parallelism would)."""
    torch.manual_seed(0)
    E, H, B, N = 16, 4, 2, 24
    config = StandardizedRingConfig(
        dim=E,
        heads=H,
        segment_lengths=[6, 16],
        dilation_rates=[1, 2],
        ring_size=P,
        dtype=torch.float64,
        comm=comm,
    )
    module = RingMultiheadDilatedAttention.from_config(config)
    x = torch.randn(B, N, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(B, N, E, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    chunk = N // P
    sl = slice(rank * chunk, (rank + 1) * chunk)
    xs = x[:, sl].clone().requires_grad_()
    out, weights = module(xs, is_causal=True)
    assert weights is None
    (out * dy[:, sl]).sum().backward()
    params = dict(module.named_parameters())
    for p in params.values():
        dist.all_reduce(p.grad)

    ref_params = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
    xr = x.clone().requires_grad_()

    def proj(name: str, t: torch.Tensor) -> torch.Tensor:
        return F.linear(t, ref_params[f"{name}.weight"], ref_params[f"{name}.bias"])

    q, k, v = (proj(n, xr).view(B, N, H, E // H) for n in ("q_proj", "k_proj", "v_proj"))
    att, _ = reference_attention(q, k, v, [6, 16], [1, 2], True)
    y = F.layer_norm(att.reshape(B, N, E), (E,), ref_params["norm.weight"], ref_params["norm.bias"])
    y = proj("out_proj", y)
    (y * dy).sum().backward()
    errors = [
        ("out", (out - y[:, sl]).abs().max().item()),
        ("dx", (xs.grad - xr.grad[:, sl]).abs().max().item()),
    ]
    errors += [(name, (p.grad - ref_params[name].grad).abs().max().item()) for name, p in params.items()]
    return errors


@pytest.mark.parametrize("comm", ["all_gather", "ring"])
def test_multihead_matches_reference(cluster2, comm):
    for rank, errors in enumerate(cluster2.run(multihead, comm)):
        for name, err in errors:
            assert err < 1e-10, f"rank {rank}: {name} differs by {err:.3e}"


# ---------------------------------------------------------------------------------------------
# Communication volume: grows with w / r, not with N
# ---------------------------------------------------------------------------------------------

# (N, w, r) on 2 ranks: the segment that crosses the boundary is split in the same proportion.
VOLUME_CONFIGS = [(36, 12, 2), (1212, 12, 2), (72, 24, 2), (72, 24, 4)]
VOL_B, VOL_HQ, VOL_HKV, VOL_D = 1, 4, 2, 8


def measure_bytes(rank: int, P: int, configs: list[tuple[int, int, int]]) -> list[dict]:
    rows = []
    for comm in ("all_gather", "ring"):
        for N, w, r in configs:
            q, k, v, dout, _ = _inputs(VOL_B, N, VOL_HQ, VOL_HKV, VOL_D)
            chunk = N // P
            mine = [t[:, rank * chunk : (rank + 1) * chunk].float().requires_grad_() for t in (q, k, v)]
            module = RingDilatedAttention([w], [r], comm=comm)
            reset_comm_stats()
            out = module(*mine)
            torch.autograd.grad((out.double() * dout[:, rank * chunk : (rank + 1) * chunk]).sum(), mine)
            stats = comm_stats()
            rows.append(
                {
                    "comm": comm,
                    "N": N,
                    "w": w,
                    "r": r,
                    "forward": stats["forward"]["sent"] + stats["forward"]["received"],
                    "backward": stats["backward"]["sent"] + stats["backward"]["received"],
                    "forward_received": stats["forward"]["received"],
                }
            )
    return rows


def _expected_received(rank: int, N: int, w: int, r: int) -> int:
    """Bytes of k and v (float32) rank ``rank`` of 2 needs from the other: the positions of the
    other chunk in the segment that crosses the boundary, per head phase, times the key/value
    heads that the query heads of that phase read."""
    chunk = N // 2
    seg_lo = (chunk // w) * w
    seg = range(seg_lo, min(seg_lo + w, N))
    theirs = [x for x in seg if (x >= chunk) == (rank == 0)]
    G = VOL_HQ // VOL_HKV
    total = 0
    for o in range(min(r, VOL_HQ)):
        kv_heads = {h // G for h in range(VOL_HQ) if h % r == o}
        total += sum(1 for x in theirs if (x - seg_lo) % r == o) * len(kv_heads)
    return 2 * VOL_B * VOL_D * 4 * total


def test_bytes_grow_with_w_over_r_not_with_N(cluster2):
    per_rank = cluster2.run(measure_bytes, VOLUME_CONFIGS)
    for rank, rows in enumerate(per_rank):
        by = {(row["comm"], row["N"], row["w"], row["r"]): row for row in rows}
        for comm in ("all_gather", "ring"):
            for N, w, r in VOLUME_CONFIGS:
                assert by[comm, N, w, r]["forward_received"] == _expected_received(rank, N, w, r)
            small, large = by[comm, 36, 12, 2], by[comm, 1212, 12, 2]
            # N grows 33x: not one byte more, forward or backward
            assert large["forward"] == small["forward"] > 0
            assert large["backward"] == small["backward"] > 0
            # w / r doubles: twice the bytes; w and r both double: the same bytes
            assert by[comm, 72, 24, 2]["forward"] == 2 * small["forward"]
            assert by[comm, 72, 24, 4]["forward"] == small["forward"]
            # far less than gathering the other chunk whole (k and v, all heads, float32)
            assert large["forward_received"] < 2 * (1212 // 2) * VOL_HKV * VOL_D * 4 / 20


# ---------------------------------------------------------------------------------------------
# Misuse and faults
# ---------------------------------------------------------------------------------------------


def misuse(rank: int, P: int) -> dict[str, str]:
    """Calls that must raise ValueError on every rank; returns {scenario: message}."""
    messages = {}
    x = torch.randn(1, 8, 2, 4)

    def expect(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except ValueError as err:
            messages[name] = str(err)
            return
        raise AssertionError(f"{name}: no ValueError on rank {rank}")

    segs = [8] if rank == 0 else [16]
    expect("segments", lambda: RingDilatedAttention(segs, [1])(x, x, x))
    n = 3 if rank == 0 else 2  # a sequence of 5 split unevenly
    expect("chunk", lambda: RingDilatedAttention([4], [1])(x[:, :n], x[:, :n], x[:, :n]))
    y = x if rank == 0 else x.double()
    expect("dtype", lambda: RingDilatedAttention([4], [1])(y, y, y))
    expect("causal", lambda: RingDilatedAttention([4], [1])(x, x, x, is_causal=rank == 1))
    hkv = x if rank == 0 else x[:, :, :1]
    expect("heads", lambda: RingDilatedAttention([4], [1])(x, hkv, hkv))
    expect("comm", lambda: RingDilatedAttention([4], [1], comm="ring" if rank else "all_gather")(x, x, x))
    expect("shard", lambda: shard_sequence(torch.randn(1, 5, 2, 4)))
    scale = 0.5 if rank == 0 else 0.25
    expect("scale", lambda: RingDilatedAttention([4], [1], softmax_scale=scale)(x, x, x))
    expect(
        "layout", lambda: RingDilatedAttention([4], [1], layout="zigzag" if rank else "contiguous")(x, x, x)
    )
    # the group still works afterwards
    q, k, v, _, _ = _inputs(1, 16, 2, 2, 4)
    out = RingDilatedAttention([16], [2])(*(shard_sequence(t) for t in (q, k, v)))
    ref, _ = reference_attention(q, k, v, [16], [2])
    torch.testing.assert_close(out, shard_sequence(ref), rtol=0, atol=1e-12)
    return messages


def test_mismatched_ranks_raise_everywhere(cluster2):
    reports = cluster2.run(misuse)
    for messages in reports:
        assert "segment_lengths[0]: rank 0: 8, rank 1: 16" in messages["segments"]
        assert "chunk length N/P: rank 0: 3, rank 1: 2" in messages["chunk"]
        assert "divisible" in messages["chunk"]
        assert "dtype: rank 0: float32, rank 1: float64" in messages["dtype"]
        assert "is_causal" in messages["causal"]
        assert "key/value heads" in messages["heads"]
        assert "comm: rank 0: all_gather, rank 1: ring" in messages["comm"]
        assert "N = 5" in messages["shard"] and "P = 2" in messages["shard"]
        assert "softmax_scale: rank 0: 0.5, rank 1: 0.25" in messages["scale"]
        assert "layout: rank 0: contiguous, rank 1: zigzag" in messages["layout"]


def subgroup_mismatch(rank: int, P: int) -> str | None:
    """Ranks 2 and 3 share a group and disagree; the message numbers them globally."""
    groups = [dist.new_group(ranks=[0, 1]), dist.new_group(ranks=[2, 3])]
    if rank < 2:
        return None
    x = torch.randn(1, 8, 2, 4)
    segs = [8] if rank == 2 else [16]
    try:
        RingDilatedAttention(segs, [1], process_group=groups[1])(x, x, x)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"no ValueError on rank {rank}")


def test_mismatch_names_global_ranks(cluster4):
    reports = cluster4.run(subgroup_mismatch)
    for msg in reports[2:]:
        assert "segment_lengths[0]: rank 2: 8, rank 3: 16" in msg, msg


def outside_group(rank: int, P: int) -> str | None:
    """Rank 1 is not in the group: it may build the module but its forward says so."""
    group = dist.new_group(ranks=[0])
    module = RingDilatedAttention([4], [1], process_group=group)
    if rank == 0:
        return None
    x = torch.randn(1, 8, 2, 4)
    try:
        module(x, x, x)
    except RuntimeError as err:
        return str(err)
    raise AssertionError("no error outside the group")


def test_rank_outside_group_is_told(cluster2):
    _, msg = cluster2.run(outside_group)
    assert "not a member of the process_group" in msg and "global rank 1" in msg


def check_once(rank: int, P: int, check: bool) -> list[int]:
    """Calls of the consistency check over four forward calls: two shapes, each called twice."""
    module = RingDilatedAttention([16], [2], check_consistency=check)
    reset_comm_stats()
    calls = []
    for n in (8, 8, 12, 12):
        q, k, v, _, _ = _inputs(1, 2 * n, 2, 2, 4)
        out = module(*(t[:, rank * n : (rank + 1) * n] for t in (q, k, v)))
        ref, _ = reference_attention(q, k, v, [16], [2])
        torch.testing.assert_close(out, ref[:, rank * n : (rank + 1) * n], rtol=0, atol=1e-12)
        calls.append(int(comm_stats().get("check", {}).get("calls", 0)))
    return calls


def test_consistency_check_runs_once_per_shape(cluster2):
    for calls in cluster2.run(check_once, True):
        assert calls == [1, 1, 2, 2]
    for calls in cluster2.run(check_once, False):  # unsafe, but nothing moves for the check
        assert calls == [0, 0, 0, 0]


def silent_peer(rank: int, P: int, where: str, comm: str) -> float | str:
    """On a new group with a 2 s timeout, rank 1 skips the forward (or the backward); rank 0 must
    raise a RuntimeError once the timeout has passed."""
    timeout = 2.0
    group = dist.new_group(ranks=list(range(P)), timeout=datetime.timedelta(seconds=timeout))
    x = [torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(3)]
    module = RingDilatedAttention([16], [1], comm=comm, process_group=group)
    if rank == 1:
        if where == "backward":
            module(*x)
        time.sleep(timeout + 2.0)  # alive but silent
        return "silent"
    start = time.monotonic()
    try:
        out = module(*x)
        out.sum().backward()
    except RuntimeError as err:
        assert "does not answer" in str(err), str(err)
        return time.monotonic() - start
    raise AssertionError("rank 0 did not raise although its peer never answered")


@pytest.mark.parametrize("where,comm", [("forward", "all_gather"), ("backward", "ring")])
def test_silent_peer_raises_after_timeout(cluster2, where, comm):
    elapsed, silent = cluster2.run(silent_peer, where, comm, deadline=60.0)
    assert silent == "silent"
    assert 1.5 <= elapsed < 10.0  # the group's timeout is 2 s


# ---------------------------------------------------------------------------------------------
# A group of one, no group, and the constructor
# ---------------------------------------------------------------------------------------------


def double_backward(rank: int, P: int) -> str:
    """A second backward through the spanning pieces (the local runs on manual, which has one):
    the message of the error it raises."""
    q, k, v, _, _ = _inputs(1, 32, 2, 2, 8)
    sl = slice(rank * 16, (rank + 1) * 16)
    mine = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
    module = RingDilatedAttention([32], [1], attention_backend="manual")
    out = module(*mine, is_causal=True)
    grads = torch.autograd.grad(out.square().sum(), mine, create_graph=True)
    try:
        sum(g.square().sum() for g in grads).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_double_backward_through_spanning_pieces_says_how_to_get_it(cluster2):
    for msg in cluster2.run(double_backward):
        assert "ring (" in msg and "no second-order gradients" in msg and "backend='manual'" in msg, msg


def group_of_one(rank: int, P: int) -> float | None:
    """Rank 0 runs the module on a group of one (rank 1 only takes part in creating the group)."""
    group = dist.new_group(ranks=[0])
    if rank != 0:
        return None
    q, k, v, _, _ = _inputs(2, 20, 4, 2, 8)
    out = RingDilatedAttention([4, 8], [1, 2], process_group=group)(q, k, v, is_causal=True)
    ref, _ = reference_attention(q, k, v, [4, 8], [1, 2], True)
    return (out - ref).abs().max().item()


def test_group_of_one_runs_the_local_op(cluster2):
    err, _ = cluster2.run(group_of_one)
    assert err < 1e-12


def test_without_process_group_equals_local_op():
    assert not (dist.is_available() and dist.is_initialized())
    q, k, v, dout, dlse = _inputs(1, 24, 4, 2, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = RingDilatedAttention([6, 24], [1, 3])(*leaves, is_causal=True, return_lse=True)
    got = (out, lse, *torch.autograd.grad(_loss(out, lse, dout, dlse), leaves))
    expected = _reference(q, k, v, dout, dlse, [6, 24], [1, 3], True, torch.float64)
    for a, e in zip(got, expected, strict=True):
        assert_within_rule("single", a, e, e, torch.float64)


def test_spec_configurations_construct_and_run():
    device = torch.device("cpu")
    module = RingDilatedAttentionV2Collective(
        segment_lengths=[2048, 4096],
        dilation_rates=[1, 2],
        device=device,
        dtype=torch.float32,
        use_pattern_cache=True,
        enable_memory_pool=True,
        memory_pool_threshold_mb=16.0,
    )
    assert RingDilatedAttentionV2Collective is RingDilatedAttention
    q, k, v, _, _ = _inputs(1, 64, 4, 4, 16)
    q, k, v = q.float(), k.float(), v.float()
    out = module(q, k, v)
    torch.testing.assert_close(out, dattn(q, k, v, [2048, 4096], [1, 2]))
    config = StandardizedRingConfig(
        dim=768,
        heads=12,
        segment_lengths=[2048, 4096],
        dilation_rates=[1, 2],
        ring_size=2,
        dtype=torch.float32,
    )
    assert (config.embed_dim, config.num_heads, config.head_dim) == (768, 12, 64)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"unknown_option": 1}, TypeError, "unknown_option"),
        ({"attention_dropout": 0.1}, ValueError, "dropout"),
        ({"comm": "tree"}, ValueError, "comm"),
        ({"process_group": "world"}, TypeError, "process_group"),
        ({"segment_lengths": [4], "dilation_rates": [8]}, ValueError, "dilation_rates"),
        ({"memory_pool_threshold_mb": -1}, ValueError, "memory_pool_threshold_mb"),
        ({"attention_backend": "fastest"}, ValueError, "fastest"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = {"segment_lengths": [4], "dilation_rates": [1]}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        RingDilatedAttention(**args)


def test_split_without_a_group_warns(monkeypatch):
    """Under torchrun without init_process_group, or with ring_size > 1 and no group, every
    process would treat its chunk as the whole sequence: that warns."""
    assert not (dist.is_available() and dist.is_initialized())
    x = torch.randn(1, 8, 2, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(RuntimeWarning, match="WORLD_SIZE=2, but no process group"):
        RingDilatedAttention([4], [1])(x, x, x)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.warns(RuntimeWarning, match="ring_size=2"):
        RingDilatedAttention([4], [1], ring_size=2)(x, x, x)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RingDilatedAttention([4], [1])(x, x, x)


def test_shard_without_group_is_identity():
    x = torch.randn(1, 5, 2, 4)
    assert shard_sequence(x) is x or torch.equal(shard_sequence(x), x)


if os.environ.get("DILATED_ATTENTION_SLOW") == "1":
    SLOW_CASES = _grid([("slow-big", 2, 96, 8, 2, 16, [7, 24, 48, 200], [1, 2, 3, 8])])
else:
    SLOW_CASES = []


@pytest.mark.skipif(os.environ.get("DILATED_ATTENTION_SLOW") != "1", reason="set DILATED_ATTENTION_SLOW=1")
@pytest.mark.parametrize("P", [2, 3, 4])
def test_slow_sweep(P):
    cluster = Cluster(P)
    try:
        reports = cluster.run(check_cases, SLOW_CASES, deadline=600.0)
    finally:
        cluster.close()
    for rank, report in enumerate(reports):
        bad = {cid: err for cid, err in report.items() if err is not None}
        assert not bad, f"rank {rank}: {bad}"
