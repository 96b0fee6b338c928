"""RingDilatedAttention on layouts where the ranks' shares of the work differ, on 2-4 gloo processes.

Every rank compares its out, lse, dq, dk and dv with the float64 reference on the whole sequence
(SPEC section 4's rule), in these situations:

* some rank has no spanning piece while others exchange (``comm="all_gather"`` is a collective:
  every rank must join it, or the others wait for the group's timeout);
* some rank holds no position any head reads (its out is 0 and its lse -inf, as on one process);
* bfloat16, where a key read by several pieces must collect its gradient in float32 and be rounded
  once.

The process groups have a short timeout, so that a rank left waiting fails the test in seconds.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from reference import multiplicity, reference_attention
from ring_cluster import Cluster, inputs, loss
from tolerance import assert_within_rule

from dilated_attention.ring import RingDilatedAttention
from dilated_attention.ring.geometry import Plan, make_layout

PG_TIMEOUT_S = 20.0  # a rank left waiting in a collective fails after this
DEADLINE_S = 180.0  # the processes are killed after it (a loaded machine starts them slowly)

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _reference(q, k, v, dout, dlse, segs, rates, causal, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*leaves, segs, rates, causal, dtype=dtype)
    grads = torch.autograd.grad(loss(out, lse, dout, dlse), leaves)
    return (out.detach(), lse.detach(), *grads)


def check(rank: int, P: int, cases: list[tuple]) -> dict[str, str | None]:
    """Run every case on this rank; map its id to None (pass) or the failure."""
    report: dict[str, str | None] = {}
    for cid, B, N, Hq, Hkv, D, segs, rates, causal, comm, dtype_name, layout, backend, seed in cases:
        try:
            dtype = DTYPES[dtype_name]
            q, k, v, dout, dlse = inputs(B, N, Hq, Hkv, D, seed=seed)
            expected = _reference(q, k, v, dout, dlse, segs, rates, causal, torch.float64)
            plain = _reference(q, k, v, dout, dlse, segs, rates, causal, dtype)
            sl = make_layout(layout, P, N // P).positions(rank)
            mine = [t[:, sl].to(dtype).requires_grad_() for t in (q, k, v)]
            module = RingDilatedAttention(segs, rates, comm=comm, attention_backend=backend, layout=layout)
            out, lse = module(*mine, is_causal=causal, return_lse=True)
            grads = torch.autograd.grad(loss(out, lse, dout[:, sl], dlse[:, :, sl]), mine)
            for name, a, e, p in zip(
                ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), expected, plain, strict=True
            ):
                idx = (slice(None), slice(None), sl) if name == "lse" else (slice(None), sl)
                assert_within_rule(name, a, e[idx], p[idx], dtype)
            report[cid] = None
        except Exception:
            report[cid] = traceback.format_exc()
    return report


@pytest.fixture(scope="module")
def clusters():
    """Gloo groups of 2, 3 and 4 processes, started on first use and shared by the tests here."""
    started: dict[int, Cluster] = {}

    def get(P: int) -> Cluster:
        if P not in started:
            started[P] = Cluster(P, timeout_s=PG_TIMEOUT_S)
        return started[P]

    yield get
    for cluster in started.values():
        cluster.close()


def _run(cluster: Cluster, cases: list[tuple]) -> None:
    reports = cluster.run(check, cases, deadline=DEADLINE_S)
    failures = _failures(reports)
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())


def _failures(reports: list[dict[str, str | None]]) -> dict[str, str]:
    return {f"{cid} (rank {r})": err for r, rep in enumerate(reports) for cid, err in rep.items() if err}


def _case(
    name,
    P,
    N,
    Hq,
    Hkv,
    segs,
    rates,
    causal,
    comm="all_gather",
    dtype="float64",
    backend="auto",
    layout="contiguous",
):
    cid = f"{name}-P{P}-N{N}-w{segs}-r{rates}-{'causal' if causal else 'full'}-{comm}-{dtype}-{backend}-{layout}"
    return (cid, 1, N, Hq, Hkv, 4, segs, rates, causal, comm, dtype, layout, backend, N + Hq)


# P = 3, N = 6, w = 4, r = 1: rank 2's segment [4, 6) is local, ranks 0 and 1 share [0, 4).
IDLE_RANK_3 = [
    _case("idle", 3, 6, 1, 1, [4], [1], causal, comm, backend=backend)
    for causal in (False, True)
    for comm in ("all_gather", "ring")
    for backend in ("auto", "manual")
] + [_case("idle", 3, 9, 2, 1, [6, 3], [2, 1], True), _case("idle", 3, 6, 2, 2, [4], [2], False)]
# P = 4, N = 8, w = 3 or 6: rank 3 holds only positions of segments inside its chunk.
IDLE_RANK_4 = [_case("idle", 4, 8, 2, 2, [w], [r], c) for w, r in ((3, 1), (6, 2)) for c in (False, True)]
# zigzag, P = 4, N = 8 (chunks of 1): some rank holds no spanning segment of w = 6, r = 3.
IDLE_RANK_4 += [_case("idle", 4, 8, 2, 2, [6], [3], c, layout="zigzag") for c in (False, True)]


def test_the_idle_rank_cases_have_an_idle_rank():
    """Each case has a rank with nothing to exchange while others exchange (the situation of the
    test below), so that the test keeps testing it."""
    for cid, _, N, Hq, Hkv, _, segs, rates, causal, _, _, layout, *_ in IDLE_RANK_3 + IDLE_RANK_4:
        P = int(cid.split("-P")[1].split("-")[0])
        L = make_layout(layout, P, N // P)
        plans = [Plan(L, j, segs, rates, Hq, Hkv, causal) for j in range(P)]
        assert plans[0].steps and any(not p.any_span for p in plans), cid


@pytest.mark.parametrize("P,cases", [(3, IDLE_RANK_3), (4, IDLE_RANK_4)])
def test_a_rank_without_spanning_pieces_joins_the_exchange(clusters, P, cases):
    """``comm="all_gather"`` used to skip the all-to-all on a rank with no spanning piece, and the
    other ranks waited for the group's timeout."""
    _run(clusters(P), cases)


# P = 2, N = 4, w = r = 5, one head: only position 0 is read; rank 1 holds positions 2 and 3.
UNREAD = [
    _case("unread", 2, 4, 1, 1, [5], [5], causal, comm, backend=backend)
    for causal in (False, True)
    for comm in ("all_gather", "ring")
    for backend in ("auto", "manual")
] + [_case("unread", 2, 4, 2, 1, [4], [4], True), _case("unread", 3, 6, 2, 2, [6], [5], False)]


def test_the_unread_cases_have_a_rank_holding_no_read_position():
    for cid, _, N, Hq, _, _, segs, rates, causal, *_ in UNREAD:
        P = int(cid.split("-P")[1].split("-")[0])
        read = multiplicity(N, Hq, segs, rates, causal).sum(dim=(0, 2)) > 0  # (N,) read by any head
        assert any(not read[j * N // P : (j + 1) * N // P].any() for j in range(P)), cid


@pytest.mark.parametrize("P", [2, 3])
def test_a_rank_holding_no_read_position_returns_zero_and_minus_inf(clusters, P):
    """Such a rank used to crash in the merge of no parts (``stack expects a non-empty TensorList``)."""
    _run(clusters(P), [c for c in UNREAD if f"-P{P}-" in c[0]])


# bfloat16 on 4 ranks: keys read by several branches' pieces, local runs and other ranks.
BF16_BRANCHES = [([5, 7, 16], [1, 1, 1], "ring", True), ([3, 6, 16], [1, 2, 1], "all_gather", False)]
BF16_BRANCHES += [([5, 9, 13, 16], [1, 1, 1, 1], "all_gather", True)]


def _half_ulp_ratio(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| in units of half a bfloat16 ulp of ref (8 significant bits), with a
    floor of 1e-4 * max|ref| for float32 noise near zero: at most 1 when got is ref rounded once."""
    ref = ref.double()
    half_ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 8)
    return ((got.double() - ref).abs() / (half_ulp + 1e-4 * ref.abs().max())).max().item()


def bf16_rounding(rank: int, P: int, segs, rates, comm: str, causal: bool) -> float:
    """dv of this rank against the float64 reference on the same bfloat16-rounded inputs, in half
    ulps. dv sums softmax weights (from the float32 lse) times dout over every query that reads the
    key, across pieces, local runs and ranks: summed in float32 and rounded once, it is within one
    half ulp; rounded per piece, it is not."""
    n = 4
    q, k, v, dout, dlse = inputs(1, n * P, 2, 1, 8, seed=1)
    leaves = [t.to(torch.bfloat16).double().requires_grad_() for t in (q, k, v)]
    o, lse = reference_attention(*leaves, segs, rates, causal)
    dv_ref = torch.autograd.grad(loss(o, lse, dout.bfloat16().double(), dlse.float().double()), leaves[2])[0]
    sl = slice(rank * n, (rank + 1) * n)
    mine = [t[:, sl].to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    out, lse = RingDilatedAttention(segs, rates, comm=comm)(*mine, is_causal=causal, return_lse=True)
    dv = torch.autograd.grad(loss(out, lse, dout[:, sl], dlse[:, :, sl]), mine[2])[0]
    return _half_ulp_ratio(dv, dv_ref[:, sl])


@pytest.mark.parametrize("segs,rates,comm,causal", BF16_BRANCHES)
def test_bfloat16_key_gradients_are_rounded_once(clusters, segs, rates, comm, causal):
    ratios = clusters(4).run(bf16_rounding, segs, rates, comm, causal, deadline=DEADLINE_S)
    assert max(ratios) <= 1.0, f"dv off by up to {max(ratios):.2f} half ulps (per rank: {ratios})"


BF16_CASES = [
    _case("bf16", 4, 16, Hq, 1, segs, rates, causal, comm, "bfloat16")
    for segs, rates, comm, causal in BF16_BRANCHES
    for Hq in (1, 2)
]


def test_bfloat16_within_the_rule(clusters):
    """SPEC section 4's rule for out, lse, dq, dk and dv in bfloat16 on the cases above."""
    _run(clusters(4), BF16_CASES)
