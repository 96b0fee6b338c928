"""The pieces of sequence parallelism, in one process: the piece op of ``native``
(``dilated_attention::piece_fwd/piece_bwd``, on the CPU and, with a GPU, on CUDA in both kernel
families) and the gather-based fallback that runs them where ``native`` cannot, all against the
float64 reference; and the ring's geometry and transfer schedule, which need no processes.
"""

from __future__ import annotations

import pytest
import torch
from common import needs_cuda_kernels
from reference import reference_piece
from tolerance import assert_within_rule

from dilated_attention import op as _ops
from dilated_attention.backends import get_backend
from dilated_attention.merge import merge
from dilated_attention.ring.geometry import Layout, Plan, causal_pairs, make_layout
from dilated_attention.ring.geometry import _progression as progression
from dilated_attention.ring.mode_ring import batch_items, posting_order
from dilated_attention.ring.pieces import PieceAttention

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)

needs_piece_op = pytest.mark.skipif(
    not _ops.has_piece_kernel("cpu"), reason="extension built without piece op"
)
needs_gpu = needs_cuda_kernels(_ops.has_piece_kernel("cuda"))


def _devices():
    return [
        pytest.param("cpu", marks=needs_piece_op),
        pytest.param("cuda", marks=[needs_gpu, pytest.mark.cuda]),
    ]


def _piece_inputs(B, nq, nk, Hq, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nq, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, nk, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, nk, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, nq, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, nq, generator=g, dtype=torch.float64)
    return q, k, v, dout, dlse


def _loss(out, lse, dout, dlse):
    finite = torch.isfinite(lse)
    return (out.double() * dout).sum() + (torch.where(finite, lse.double(), 0) * dlse).sum()


def _reference(q, k, v, dout, dlse, offset, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference_piece(*leaves, offset, dtype=dtype)
    return (out.detach(), lse.detach(), *torch.autograd.grad(_loss(out, lse, dout, dlse), leaves))


# (B, nq, nk, Hq, Hkv, D, causal offset): unmasked, the ring's shapes (own keys last: offset =
# nk - nq; a square diagonal block: 0), rows that see no key (negative offset), tiles of several
# vector widths, grouped-query heads, an odd head dim
PIECES = [
    (1, 5, 7, 2, 2, 8, None),
    (2, 70, 130, 4, 2, 16, 60),
    (1, 67, 67, 2, 1, 12, 0),
    (1, 40, 20, 2, 2, 8, -5),
    (1, 129, 200, 3, 3, 33, 150),
    (1, 9, 100, 4, 4, 8, None),
]


def _check_piece_op(case, dtype, device):
    """The piece op on ``device``: forward, and the backward through autograd (out and lse both
    carry gradients), against the float64 reference under the tolerance rule."""
    B, nq, nk, Hq, Hkv, D, offset = case
    q, k, v, dout, dlse = _piece_inputs(B, nq, nk, Hq, Hkv, D)
    expected = _reference(q, k, v, dout, dlse, offset, torch.float64)
    plain = _reference(q, k, v, dout, dlse, offset, dtype)
    leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    out, lse = _ops.piece_forward(*leaves, offset is not None, offset or 0, D**-0.5)
    assert out.device.type == device and out.dtype == dtype and out.shape == (B, nq, Hq, D)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (B, Hq, nq)
    grads = torch.autograd.grad(_loss(out, lse, dout.to(device), dlse.to(device)), leaves)
    got = (out, lse, *grads)
    for name, a, e, p in zip(("out", "lse", "dq", "dk", "dv"), got, expected, plain, strict=True):
        assert a.device.type == device and a.dtype == (lse.dtype if name == "lse" else dtype)
        assert_within_rule(name, a.cpu(), e, p, dtype)


@needs_piece_op
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PIECES, ids=[str(c) for c in PIECES])
def test_piece_op_matches_reference(case, dtype):
    _check_piece_op(case, dtype, "cpu")


# On CUDA, also head dims that the tensor-core kernels take (32 <= D <= 256, D % 8 == 0), pieces
# of several thread blocks on both sides, and causal offsets far outside [-nq, nk] (every key, or
# no key, visible to every query).
CUDA_PIECES = [
    *PIECES,
    (2, 70, 130, 4, 2, 64, 60),
    (1, 300, 500, 4, 1, 128, 200),
    (1, 200, 90, 2, 2, 32, -20),
    (1, 3, 300, 2, 2, 256, None),
    (1, 20, 30, 2, 1, 40, 10**12),
    (1, 20, 30, 2, 1, 40, -(10**12)),
]

# (dtype, DILATED_ATTENTION_CUDA_SIMT): float16/bfloat16 in both kernel families (the tensor-core
# kernels where the head dim allows them), float32/float64 on the SIMT kernels.
CUDA_FAMILIES = [
    pytest.param(torch.float64, False, id="float64"),
    pytest.param(torch.float32, False, id="float32"),
    pytest.param(torch.bfloat16, False, id="bfloat16-tc"),
    pytest.param(torch.float16, False, id="float16-tc"),
    pytest.param(torch.bfloat16, True, id="bfloat16-simt"),
    pytest.param(torch.float16, True, id="float16-simt"),
]


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype,simt", CUDA_FAMILIES)
@pytest.mark.parametrize("case", CUDA_PIECES, ids=[str(c) for c in CUDA_PIECES])
def test_cuda_piece_op_matches_reference(case, dtype, simt, monkeypatch):
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_SIMT", "1" if simt else "0")
    _check_piece_op(case, dtype, "cuda")


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("tiling", ["4,1", "3,0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_piece_op_forced_tiling(tiling, dtype, monkeypatch):
    """DILATED_ATTENTION_CUDA_TILING changes how a piece is cut into thread blocks, never what it
    computes."""
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_TILING", tiling)
    _check_piece_op((2, 70, 130, 4, 2, 64, 60), dtype, "cuda")


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("offset", [2**63 - 1, 2**62, -(2**62), -(2**63)])
def test_piece_op_offsets_at_the_int64_limits(offset, device):
    """An offset past every key means every key visible; one below -nq, none (no overflow)."""
    q, k, v, dout, dlse = _piece_inputs(1, 20, 70, 2, 1, 32)
    same = None if offset > 0 else -20  # an in-range offset that means the same
    expected = _reference(q, k, v, dout, dlse, same, torch.float64)
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    out, lse = _ops.piece_forward(*leaves, True, offset, 32**-0.5)
    got = (out, lse, *torch.autograd.grad(_loss(out, lse, dout.to(device), dlse.to(device)), leaves))
    for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), got, expected, strict=True):
        assert_within_rule(name, a.cpu(), e, e, torch.float64)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("nq,nk", [(5, 0), (0, 7), (0, 0)])
def test_piece_op_without_queries_or_keys(nq, nk, device):
    """No key: out = 0 and lse = -inf; no query or no key: zero gradients, of the inputs' shapes."""
    q, k, v, dout, dlse = (t.to(device) for t in _piece_inputs(2, nq, nk, 4, 2, 32))
    out, lse = _ops.piece_forward(q, k, v, True, 3, 0.5)
    assert out.shape == q.shape and lse.shape == (2, 4, nq) and lse.dtype == torch.float64
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -torch.inf).all())
    dq, dk, dv = _ops.piece_backward(dout, q, k, v, out, lse, dlse, True, 3, 0.5)
    for g, like in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == like.shape and g.dtype == like.dtype and g.device == like.device
        assert torch.equal(g, torch.zeros_like(like))


def _split_run(attend, backward, q, k, v, dout, dlse, offset, cut):
    """Keys cut in two at ``cut``: each part's forward, the merge, then each part's backward fed
    the *merged* out and lse (the ring's scheme). Returns out, lse, dq, dk, dv."""
    parts = [(0, cut), (cut, k.shape[1])]
    results = []
    for lo, hi in parts:
        off = None if offset is None else offset - lo
        results.append(attend(q, k[:, lo:hi], v[:, lo:hi], off))
    out, lse = merge([r[0] for r in results], [r[1] for r in results])
    dq = 0
    dks, dvs = [], []
    for (lo, hi), r in zip(parts, results, strict=True):
        off = None if offset is None else offset - lo
        g = backward(dout, dlse, q, k[:, lo:hi], v[:, lo:hi], out, lse, off, r)
        dq = dq + g[0].double()
        dks.append(g[1])
        dvs.append(g[2])
    return out, lse, dq, torch.cat(dks, 1), torch.cat(dvs, 1)


def _engines():
    return [
        pytest.param("native", "cpu", marks=needs_piece_op, id="native-cpu"),
        pytest.param("sdpa", "cpu", id="sdpa-cpu"),
        pytest.param("native", "cuda", marks=[needs_gpu, pytest.mark.cuda], id="native-cuda"),
    ]


@pytest.mark.parametrize("engine,device", _engines())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_merged_backward_of_split_keys(engine, device, dtype, causal):
    """The ring's use: a piece's keys come in blocks; the blocks' backward, fed the merged out and
    lse, sums to the exact gradient of the whole. D = 32: the tensor-core kernels on CUDA."""
    B, nq, nk, Hq, Hkv, D = 2, 37, 90, 4, 2, 32
    offset = nk - nq if causal else None
    q, k, v, dout, dlse = _piece_inputs(B, nq, nk, Hq, Hkv, D, seed=1)
    expected = _reference(q, k, v, dout, dlse, offset, torch.float64)
    plain = _reference(q, k, v, dout, dlse, offset, dtype)
    pa = PieceAttention(get_backend(engine), torch.device(device))
    assert pa.name == engine
    from dilated_attention.ring.geometry import HeadSets

    hs = HeadSets(torch.arange(Hq), torch.arange(Hkv), torch.arange(Hq) // (Hq // Hkv), True)
    scale = D**-0.5

    def attend(qq, kk, vv, off):
        return pa.forward(qq, kk, vv, hs, off, scale)

    def backward(do, dl, qq, kk, vv, out, lse, off, r):
        return pa.backward(do.to(dtype), dl.to(lse.dtype), qq, kk, vv, hs, out, lse, off, scale, r[2])

    qd, kd, vd = (t.to(device, dtype) for t in (q, k, v))
    dd, dl = dout.to(device), dlse.to(device)
    got = _split_run(attend, backward, qd, kd, vd, dd, dl, offset, cut=nk - nq - 3 if causal else 41)
    for name, a, e, p in zip(("out", "lse", "dq", "dk", "dv"), got, expected, plain, strict=True):
        assert a.device.type == device
        assert_within_rule(name, a.cpu(), e, p, dtype)


@pytest.mark.parametrize("device", _devices())
def test_piece_op_gradcheck_and_opcheck(device):
    q, k, v = (t.to(device).requires_grad_() for t in _piece_inputs(1, 6, 9, 2, 1, 4, seed=2)[:3])
    torch.autograd.gradcheck(lambda a, b, c: _ops.piece_forward(a, b, c, True, 4, 0.5), (q, k, v))
    torch.library.opcheck(torch.ops.dilated_attention.piece_fwd.default, (q, k, v, True, 4, 0.5))


def _on_meta(x: torch.Tensor) -> torch.Tensor:
    return x.to("meta")


@needs_piece_op
@pytest.mark.parametrize("mode", ["meta", "fake"])
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=str)
@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 5), (True, -(2**63))])
@pytest.mark.parametrize("float64_lse", [False, True])
def test_piece_op_on_meta_and_fake_tensors(mode, dtype, causal, offset, float64_lse):
    """The raw ops on meta tensors and under FakeTensorMode read no values: out, lse and the
    gradients have the shapes, dtypes and devices of the CPU kernels', also through autograd."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, nq, nk, Hq, Hkv, D = 2, 6, 9, 4, 2, 8
    q, k, v, dout, dlse = _piece_inputs(B, nq, nk, Hq, Hkv, D)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    ops = torch.ops.dilated_attention
    real = ops.piece_fwd(q, k, v, causal, offset, 0.5, float64_lse)
    dlse = dlse.to(real[1].dtype)
    real_grads = ops.piece_bwd(dout, q, k, v, *real, dlse, causal, offset, 0.5)
    if mode == "meta":
        convert, device, context = _on_meta, "meta", None
    else:
        context = FakeTensorMode()
        convert, device = context.from_tensor, "cpu"
    with context if context is not None else torch.no_grad():
        q, k, v, dout, dlse = (convert(t) for t in (q, k, v, dout, dlse))
        out, lse = ops.piece_fwd(q, k, v, causal, offset, 0.5, float64_lse)
        grads = ops.piece_bwd(dout, q, k, v, out, lse, dlse, causal, offset, 0.5)
        for a, e in zip((out, lse, *grads), (*real, *real_grads), strict=True):
            assert (a.shape, a.dtype, a.device.type) == (e.shape, e.dtype, device)
    with context if context is not None else torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = _ops.piece_forward(*leaves, causal, offset, 0.5, float64_lse)
        grads = torch.autograd.grad((out * dout).sum() + lse.sum(), leaves)
        for a, e in zip(grads, leaves, strict=True):
            assert (a.shape, a.dtype, a.device.type) == (e.shape, e.dtype, device)


@needs_piece_op
def test_piece_op_bad_inputs_raise():
    q, k, v, _, _ = _piece_inputs(1, 4, 5, 2, 2, 8)
    with pytest.raises(RuntimeError, match="must agree in B and D"):
        _ops.piece_forward(q, k[..., :4], v[..., :4], False, 0, 1.0)
    with pytest.raises(RuntimeError, match="k and v must have the same shape"):
        _ops.piece_forward(q, k, v[:, :3], False, 0, 1.0)
    with pytest.raises(RuntimeError, match="positive multiple"):
        _ops.piece_forward(
            q,
            k[:, :, :1].expand(1, 5, 3, 8).contiguous(),
            v[:, :, :1].expand(1, 5, 3, 8).contiguous(),
            False,
            0,
            1.0,
        )


# ---------------------------------------------------------------------------------------------
# Geometry (no processes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_layout_deals_every_position_once(kind, P):
    L = make_layout(kind, P, 12)
    got = torch.cat([L.positions(j) for j in range(P)]).sort().values
    assert torch.equal(got, torch.arange(12 * P))
    for c in range(L.num_chunks):
        assert c in L.chunks_of(L.owner(c))


def test_zigzag_needs_even_chunks():
    with pytest.raises(ValueError, match="N / P must be even, got N / P = 5"):
        make_layout("zigzag", 2, 5)
    with pytest.raises(ValueError, match="layout must be one of"):
        make_layout("striped", 2, 4)


def test_zigzag_balances_causal_work():
    """The problem of the benchmark: with causal masking the contiguous layout gives the last rank
    about 17% more pairs than the mean; zigzag gives every rank the same number."""
    segs, rates, H = [2048, 8192, 32768], [1, 2, 4], 8
    for P in (2, 4):
        cont = causal_pairs(Layout("contiguous", P, 32768 // P), segs, rates, H, True)
        zig = causal_pairs(Layout("zigzag", P, 32768 // (2 * P)), segs, rates, H, True)
        assert sum(cont) == sum(zig)
        assert max(cont) > 1.1 * sum(cont) / P
        assert max(zig) == min(zig)


def _plans(P, kind, local_len, segs, rates, Hq, Hkv, causal):
    L = make_layout(kind, P, local_len)
    return [Plan(L, j, segs, rates, Hq, Hkv, causal) for j in range(P)]


GEOMETRIES = [
    (2, "contiguous", 16, [16, 32], [1, 2], 4, 4, True),
    (4, "contiguous", 9, [6, 12], [1, 3], 4, 4, False),
    (4, "zigzag", 8, [8, 16, 64], [1, 2, 4], 4, 2, True),
    (3, "contiguous", 2, [12], [8], 8, 8, True),  # r > N/P: ranks hold none of some heads' positions
    (5, "contiguous", 3, [15, 5], [6, 5], 6, 3, False),
    (4, "zigzag", 4, [32], [16], 16, 16, True),
]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
def test_plans_cover_every_key_a_query_reads(geo):
    """Every rank's local runs and pieces together read exactly the keys SPEC section 2 assigns
    to each of its queries, and what one rank plans to send another plans to receive."""
    P, kind, local_len, segs, rates, Hq, Hkv, causal = geo
    plans = _plans(P, kind, local_len, segs, rates, Hq, Hkv, causal)
    L = plans[0].layout
    for j, plan in enumerate(plans):
        for dst, items in plan.send_items.items():
            assert plans[dst].recv_items[j] == items
        pos = L.positions(j)
        for piece in plan.pieces:
            qpos = pos[plan.query_slice(piece)]
            w = segs[piece.branch]
            seg_hi = min(piece.seg_lo + w, L.N)
            assert torch.equal(qpos, piece.seg_lo + piece.o + piece.r * torch.arange(piece.m0, piece.m1))
            keys = []
            for blk in piece.blocks:
                kpos = L.positions(blk.src)[plans[blk.src].key_slice(piece, blk)]
                keys.append(kpos)
            keys = torch.cat(keys)
            m0, m1 = progression(piece.seg_lo, piece.o, piece.r, piece.seg_lo, seg_hi)
            want = piece.seg_lo + piece.o + piece.r * torch.arange(m0, m1)
            if causal:
                want = want[want <= qpos.max()]
            assert torch.equal(keys, want)


def _simulate(plans, order_of, phase):
    """A model of a library that matches the point-to-point messages between two ranks in the
    order they were posted, ignoring tags (NCCL), runs each rank's batches one after another, and
    completes a send only when the receiver has matched it. Returns None when every batch
    completes with matching kinds and sizes, else what went wrong."""
    P = len(plans)
    queues = []
    for plan in plans:
        batches = []
        for kind, d in order_of(plan, phase):
            sends, recvs = batch_items(plan, kind, d)
            ops = [("send", p, kind, len(items)) for p, items in sends.items()]
            ops += [("recv", p, kind, len(items)) for p, items in recvs.items()]
            if ops:
                batches.append(ops)
        queues.append(batches)
    chan = {(a, b): [] for a in range(P) for b in range(P)}  # messages a -> b: [kind, n, matched]
    taken = dict.fromkeys(chan, 0)
    pos, started = [0] * P, [False] * P
    mine, matched = [[] for _ in range(P)], [set() for _ in range(P)]
    while any(pos[j] < len(queues[j]) for j in range(P)):
        progressed = False
        for j in range(P):
            if pos[j] == len(queues[j]):
                continue
            batch = queues[j][pos[j]]
            if not started[j]:  # post this batch's sends
                for op, peer, kind, n in batch:
                    if op == "send":
                        mine[j].append([kind, n, False])
                        chan[(j, peer)].append(mine[j][-1])
                started[j] = progressed = True
            for i, (op, peer, kind, n) in enumerate(batch):
                if op == "recv" and i not in matched[j] and taken[(peer, j)] < len(chan[(peer, j)]):
                    msg = chan[(peer, j)][taken[(peer, j)]]
                    if (msg[0], msg[1]) != (kind, n):
                        return f"rank {j} expected {kind} x{n} from rank {peer}, got {msg[0]} x{msg[1]}"
                    msg[2] = True
                    taken[(peer, j)] += 1
                    matched[j].add(i)
                    progressed = True
            recvs = {i for i, op in enumerate(batch) if op[0] == "recv"}
            if recvs <= matched[j] and all(m[2] for m in mine[j]):
                pos[j], started[j], mine[j], matched[j] = pos[j] + 1, False, [], set()
                progressed = True
        if not progressed:
            return f"deadlock: batches done per rank {pos} of {[len(q) for q in queues]}"
    return None


def _global_order(plan, phase):
    return posting_order(plan.steps, phase)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=[str(g) for g in GEOMETRIES])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_ring_schedule_matches_in_posting_order(geo, phase):
    """The ring mode's posting order pairs every message with its counterpart and completes on a
    model of in-order matching (NCCL ignores tags), for geometries where some ranks exchange at
    fewer distances than others."""
    plans = _plans(*geo)
    assert len({tuple(p.steps) for p in plans}) == 1  # the same step list on every rank
    assert _simulate(plans, _global_order, phase) is None


def test_per_rank_step_lists_can_deadlock():
    """The model catches a bad order: ranks that walk only the distances at which they themselves
    exchange (the ring's earlier schedule) deadlock on this geometry (6 ranks, zigzag, r = 4 > N/P)."""
    plans = _plans(6, "zigzag", 2, [12, 2], [4, 1], 8, 8, False)

    def own_steps(plan, phase):
        mine = sorted({abs(p - plan.rank) for p in [*plan.recv_items, *plan.send_items]})
        return posting_order(mine, phase)

    assert "deadlock" in (_simulate(plans, own_steps, "backward") or "")
    assert _simulate(plans, _global_order, "backward") is None
