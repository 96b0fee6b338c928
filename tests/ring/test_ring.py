"""RingDilatedAttention (SPEC section 5) across 2 and 4 gloo processes on the CPU.

Every rank compares its chunk of out, lse, dq, dk and dv with the float64 dense reference run on
the whole sequence, under the tolerance rule of SPEC section 4. The processes are those of
``ring_cluster.Cluster``: every run has a deadline after which they are killed and the test
fails, so nothing can hang. Misuse, faults and the runs without a process group are in
``test_ring_misuse.py``; layouts where the ranks' shares differ in ``test_ring_layouts.py``.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import reference_attention
from ring_cluster import Cluster, inputs, loss
from tolerance import assert_within_rule

from dilated_attention.ring import (
    RingDilatedAttention,
    RingMultiheadDilatedAttention,
    StandardizedRingConfig,
    comm_stats,
    reset_comm_stats,
)
from dilated_attention.ring.geometry import make_layout

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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


def _reference(q, k, v, dout, dlse, segs, rates, causal, dtype):
    """(out, lse, dq, dk, dv) of the dense reference on the whole sequence, computed in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*leaves, segs, rates, causal, dtype=dtype)
    grads = torch.autograd.grad(loss(out, lse, dout, dlse), leaves)
    return (out.detach(), lse.detach(), *grads)


def check_cases(rank: int, P: int, cases: list[tuple], backend: str = "auto") -> dict[str, str | None]:
    """Run every case on this rank (the local pieces on ``backend``); map its id to None (pass) or
    the failure message."""
    report: dict[str, str | None] = {}
    for case_id, B, N, Hq, Hkv, D, segs, rates, causal, comm, dtype_name, layout in cases:
        try:
            dtype = DTYPES[dtype_name]
            q, k, v, dout, dlse = inputs(B, N, Hq, Hkv, D, seed=N + Hq)
            expected = _reference(q, k, v, dout, dlse, segs, rates, causal, torch.float64)
            plain = _reference(q, k, v, dout, dlse, segs, rates, causal, dtype)
            chunk = N // P
            sl = make_layout(layout, P, chunk).positions(rank)  # this rank's positions
            mine = [t[:, sl].to(dtype).requires_grad_() for t in (q, k, v)]
            module = RingDilatedAttention(segs, rates, comm=comm, attention_backend=backend, layout=layout)
            out, lse = module(*mine, is_causal=causal, return_lse=True)
            assert out.dtype == dtype and out.shape == mine[0].shape
            assert lse.shape == (B, Hq, chunk)
            grads = torch.autograd.grad(loss(out, lse, dout[:, sl], dlse[:, :, sl]), mine)
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
            q, k, v, dout, _ = inputs(VOL_B, N, VOL_HQ, VOL_HKV, VOL_D)
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
