"""The row moves of the C++ views driver's CUDA backward (csrc/views/rows_kernel.cuh), run on the
CPU through the kernels' emulation (tests/cuda_emulation/run_rows.cpp): the copies that give cuDNN's
backward contiguous dout, out and statistics from a call's strided views, and the adds of a call's
gradients into strided views of the float32 accumulators, several tensors in one launch. Each is
compared with what PyTorch's own copy_ and add_ make of the same views, element by element, and
every element outside the views must keep its value. The same kernel checks the forward's inputs
for non-finite entries (one flag for q, k and v), against torch.isfinite."""

from __future__ import annotations

import ctypes

import pytest
import torch
from common import build_emulation, row_meta

from dilated_attention.op.library import _C


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    so = build_emulation("run_rows", tmp_path_factory.mktemp("emu"))
    so.da_emu_rows.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    so.da_emu_rows_shape.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 4
    return so


def job(dst: list[torch.Tensor], src: list[torch.Tensor], grouped: bool) -> tuple[torch.Tensor, ctypes.Array]:
    """The pairs as run_rows.cpp reads them: their meta (row_meta) and pointers. grouped: a source
    of one more dim than its dst adds the sum over its dim -2 (as rows_cuda.cu)."""
    meta = []
    for d, s in zip(dst, src, strict=True):
        g = grouped and s.dim() == d.dim() + 1
        meta += row_meta(d, s.select(-2, 0), s.shape[-2], s.stride(-2)) if g else row_meta(d, s)
    ptrs = (ctypes.c_void_p * (2 * len(dst)))(
        *[p for d, s in zip(dst, src, strict=True) for p in (d.data_ptr(), s.data_ptr())]
    )
    return torch.tensor(meta, dtype=torch.int64), ptrs


def move(so, dst: list[torch.Tensor], src: list[torch.Tensor], add: bool, op: int | None = None) -> int:
    """Runs the kernel on (dst, src) pairs: op 0 copy, 1 add (``add`` picks one of the two), 2 check."""
    meta, ptrs = job(dst, src, add and op is None)
    return so.da_emu_rows(int(add) if op is None else op, len(dst), meta.data_ptr(), ptrs)


def call_view(x: torch.Tensor, r: int, phase: int, heads: slice) -> torch.Tensor:
    """The (Bb, m, n, D) view of a dilated call as the driver makes it: rows phase::r of x's
    segments of 8 (folded into the batch) at the heads of ``heads``."""
    B, N, H, D = x.shape
    seg = x.view(B * N // 8, 8, H, D)
    return seg[:, phase::r, heads]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "r,phase,heads", [(1, 0, slice(None)), (2, 1, slice(1, None, 2)), (4, 3, slice(3, 4))]
)
def test_cudnn_inputs_are_copied_contiguous_in_one_launch(emu, dtype, r, phase, heads):
    """dout and out (Bb, m, n, D) and the float32 statistics (Bb, m, n) of a call, each into a
    contiguous (Bb, n, m, ...) tensor, as views.cpp hands them to cuDNN: bytes unchanged."""
    torch.manual_seed(r)
    B, N, H, D = 2, 32, 6, 24
    dout, out = torch.randn(B, N, H, D).to(dtype), torch.randn(B, N, H, D).to(dtype)
    lse = torch.randn(B, N, H)
    dv, ov = call_view(dout, r, phase, heads), call_view(out, r, phase, heads)
    lv = call_view(lse.unsqueeze(-1), r, phase, heads).squeeze(-1)
    Bb, m, n, _ = dv.shape
    d_o = torch.full((Bb, n, m, D), float("nan"), dtype=dtype)
    o = torch.full_like(d_o, float("nan"))
    lt = torch.full((Bb, n, m), float("nan"))
    rc = move(
        emu,
        [d_o.transpose(1, 2), o.transpose(1, 2), lt.transpose(1, 2).unsqueeze(-1)],
        [dv, ov, lv.unsqueeze(-1)],
        False,
    )
    assert rc == 0
    assert torch.equal(d_o, dv.transpose(1, 2).contiguous())
    assert torch.equal(o, ov.transpose(1, 2).contiguous())
    assert torch.equal(lt, lv.transpose(1, 2).contiguous())


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "r,phase,heads", [(1, 0, slice(None)), (2, 0, slice(0, None, 2)), (8, 5, slice(5, 6))]
)
def test_gradients_are_added_into_the_accumulators_in_one_launch(emu, src_dtype, r, phase, heads):
    """A call's dq, dk, dv (the kernel's output layout: a transposed (Bb, n, m, D) tensor) added into
    the call's strided views of float32 accumulators that already hold other calls' sums: equal to
    at::add_ of the same views, and nothing outside the views changes."""
    torch.manual_seed(10 * r + phase)
    B, N, H, D = 2, 32, 6, 40
    acc = [torch.randn(B, N, H, D) for _ in range(3)]
    want = [a.clone() for a in acc]
    dst = [call_view(a, r, phase, heads) for a in acc]
    Bb, m, n, _ = dst[0].shape
    grads = [torch.randn(Bb, n, m, D).to(src_dtype).transpose(1, 2) for _ in range(3)]
    for w, g in zip(want, grads, strict=True):
        call_view(w, r, phase, heads).add_(g)
    assert move(emu, dst, grads, True) == 0
    for a, w in zip(acc, want, strict=True):
        torch.testing.assert_close(a, w, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_phases_of_several_segments_gathered_and_added_back(emu, dtype):
    """The gather of a run whose phases and segments both ride in the kernel's batch dim (views.cpp
    Run::operands): q, k, v as five-dim (phase, segment, m, n, D) views into contiguous tensors in
    one launch, and gradients added back into the same views of float32 accumulators."""
    torch.manual_seed(0)
    B, N, H, D, w, r = 1, 48, 4, 8, 16, 2
    xs = [torch.randn(B, N, H, D).to(dtype) for _ in range(3)]

    def phases(x):  # element [o, s, j, t, e] = x[0, s w + o + j r, o + r t, e]
        sN, sH = x.stride(1), x.stride(2)
        return x.as_strided((r, N // w, w // r, H // r, D), (sN + sH, w * sN, r * sN, r * sH, 1))

    dst = [torch.full((r, N // w, w // r, H // r, D), float("nan"), dtype=dtype) for _ in xs]
    assert move(emu, dst, [phases(x) for x in xs], False) == 0
    for d, x in zip(dst, xs, strict=True):
        assert torch.equal(d, phases(x).contiguous())
    accs = [torch.randn(B, N, H, D) for _ in xs]
    want = [a.clone() for a in accs]
    for a, d in zip(want, dst, strict=True):
        phases(a).add_(d.float())
    assert move(emu, [phases(a) for a in accs], dst, True) == 0
    for a, b in zip(accs, want, strict=True):
        assert torch.equal(a, b)


def test_grouped_query_heads_repeated_in_the_gather(emu):
    """The key/value operand of a grouped-query run on CUDA (views.cpp Moves::operand): the
    run's (phase, segment, m, hk, D) view with every head repeated g times, a six-dim source of
    stride 0, moved into q's heads (head u g + j reads key/value head u) in the same launch as q."""
    torch.manual_seed(1)
    N, Hq, Hkv, D, w, r = 32, 6, 2, 8, 8, 2
    g = Hq // Hkv
    q, k = torch.randn(1, N, Hq, D).to(torch.bfloat16), torch.randn(1, N, Hkv, D).to(torch.bfloat16)

    def phases(x, heads):  # element [o, s, j, t, e] = x[0, s w + o + j r, t, e]
        sN, sH = x.stride(1), x.stride(2)
        return x.as_strided((r, N // w, w // r, heads, D), (sN, w * sN, r * sN, sH, 1))

    kv = phases(k, Hkv).unsqueeze(4).expand(r, N // w, w // r, Hkv, g, D)
    dq = torch.empty(r, N // w, w // r, Hq, D, dtype=torch.bfloat16)
    dk = torch.empty(r, N // w, w // r, Hkv, g, D, dtype=torch.bfloat16)
    assert move(emu, [dq, dk], [phases(q, Hq), kv], False) == 0
    assert torch.equal(dq, phases(q, Hq))
    want = phases(k, Hkv).repeat_interleave(g, dim=3)
    assert torch.equal(dk.reshape(want.shape), want)


def test_grouped_query_gradients_summed_and_added_with_mixed_sources(emu):
    """The adds of a grouped-query run (views.cpp views_bwd): dq in bfloat16 and the float32 dk,
    dv of q's heads, summed over the query heads of each key/value head (the source's dim -2), in
    one launch, against PyTorch's float32 sum and add."""
    torch.manual_seed(2)
    C, Bb, m, Hkv, g, D = 2, 3, 5, 2, 3, 8
    gq = torch.randn(C, Bb, m, Hkv * g, D).to(torch.bfloat16)
    gk, gv = torch.randn(C, Bb, m, Hkv * g, D), torch.randn(C, Bb, m, Hkv * g, D).to(torch.bfloat16)
    dq, dk, dv = (
        torch.randn(C, Bb, m, Hkv * g, D),
        torch.randn(C, Bb, m, Hkv, D),
        torch.randn(C, Bb, m, Hkv, D),
    )
    want = (
        dq + gq.float(),
        dk + gk.unflatten(3, (Hkv, g)).sum(4),
        dv + gv.float().unflatten(3, (Hkv, g)).sum(4),
    )
    srcs = [gq, gk.unflatten(3, (Hkv, g)), gv.unflatten(3, (Hkv, g))]
    assert move(emu, [dq, dk, dv], srcs, True) == 0
    for got, ref in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_pairs_of_different_row_counts_and_a_full_job(emu):
    """Pairs of different shapes share a launch (the grid covers the longest); a pair past the
    job's kRowPairs (the extension's row_pairs, which the launch count takes) or sizes that differ
    within a pair are refused (the caller moves those itself)."""
    a, b = torch.randn(3, 5, 7), torch.randn(1, 2, 9)
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    assert move(emu, [da, db], [a, b], False) == 0
    assert torch.equal(da, a) and torch.equal(db, b)
    x, full = torch.randn(2, 3), _C.row_pairs
    dsts = [torch.zeros(2, 3) for _ in range(full)]
    assert move(emu, dsts, [x * i for i in range(full)], False) == 0
    assert all(torch.equal(d, x * i) for i, d in enumerate(dsts))  # each pair its own source
    assert move(emu, [torch.zeros(2, 3) for _ in range(full + 1)], [x] * (full + 1), False) == 1
    assert move(emu, [torch.zeros(2, 4)], [x], False) == 1
    # a copy as words needs rows contiguous in both tensors
    assert move(emu, [torch.zeros(3, 2).t()], [x], False) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_nonfinite_check_of_q_k_v_in_one_launch(emu, dtype, bad, where):
    """q, k, v (strided views, as a fused projection gives them) checked at once: the flag is set
    exactly when one of them holds a NaN or an infinity, wherever it is (here the last element of
    the tensor `where`)."""
    B, N, Hq, Hkv, D = 2, 9, 4, 2, 8
    qkv = torch.randn(B, N, (Hq + 2 * Hkv) * D).to(dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=2)
    q, k, v = q.view(B, N, Hq, D), k.view(B, N, Hkv, D), v.view(B, N, Hkv, D)
    if bad is not None:
        (q, k, v)[where][-1, -1, -1, -1] = bad
    flag = torch.zeros(1, dtype=torch.int32)
    dst = [flag.expand(t.shape) for t in (q, k, v)]  # the flag at every element (zero strides)
    assert move(emu, dst, [q, k, v], False, op=2) == 0
    want = not all(bool(torch.isfinite(t).all()) for t in (q, k, v))
    assert bool(flag.item()) == want


def shape_of(so, dst: list[torch.Tensor], src: list[torch.Tensor], op: int) -> tuple[list[int], list[int]]:
    """The elements a lane moves at once and the row dims left after merging, per pair, of the job
    the kernel would run."""
    meta, ptrs = job(dst, src, op == 1)
    vec, dims = (ctypes.c_int * len(dst))(), (ctypes.c_int * len(dst))()
    assert so.da_emu_rows_shape(op, len(dst), meta.data_ptr(), ptrs, vec, dims) == 0
    return list(vec), list(dims)


def test_gpt_rows_move_sixteen_bytes_a_lane(emu):
    """At the example GPT's shape (head dim 64, bfloat16, 16-byte aligned) a lane moves 16 bytes at
    once: the gather of a run's phases (five dims whose segments and rows merge into one), the add of its float32 gradients from bfloat16 (4 elements) and the non-finite check."""
    N, H, D, w, r = 64, 12, 64, 32, 4
    x = torch.randn(1, N, H, D).to(torch.bfloat16)
    sN, sH = x.stride(1), x.stride(2)
    view = x.as_strided((r, N // w, w // r, H // r, D), (sN + sH, w * sN, r * sN, r * sH, 1))
    dst = torch.empty(view.shape, dtype=torch.bfloat16)
    # the segments tile the sequence: segment and row merge into one dim of m * segments rows
    assert shape_of(emu, [dst], [view], 0) == ([8], [3])
    assert shape_of(emu, [x.view(N, H, D)], [x.view(N, H, D).clone()], 0) == ([8], [1])
    acc = torch.zeros(1, N, H, D)
    a = acc.as_strided(view.shape, view.stride())
    assert shape_of(emu, [a], [dst], 1) == ([4], [3])
    flag = torch.zeros(1, dtype=torch.int32)
    assert shape_of(emu, [flag.expand(x.shape)], [x], 2)[0] == [8]


def strided(
    sizes: list[int], dt: torch.dtype, rint, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A view of `sizes` with a contiguous row into a larger buffer (random padding between rows, a
    random start), and its buffer."""
    pad = [rint(0, 2) * [1, 4][rint(0, 1)] for _ in sizes[:-1]]
    strides, step = [1], sizes[-1]
    for s, p in zip(reversed(sizes[:-1]), reversed(pad), strict=True):
        step += p
        strides.insert(0, step)
        step *= s
    off = rint(0, 7)
    buf = torch.randn(off + step + 8, generator=gen).to(dt)
    return buf.as_strided(sizes, strides, off), buf


@pytest.mark.parametrize("seed", range(6))
def test_random_views_at_every_alignment(emu, seed):
    """Random strided views (up to six dims, rows of any length, storage offsets of any element,
    so that every vector width from 1 to 16 bytes occurs) copied, added and checked as PyTorch's
    copy_, add_ and isfinite do, and nothing outside the views changes."""
    gen = torch.Generator().manual_seed(seed)

    def rint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    for case in range(12):
        dims = rint(1, 6)
        sizes = [rint(1, 3) for _ in range(dims - 1)] + [rint(1, 3) * [1, 2, 4, 8][rint(0, 3)]]
        dtype = [torch.bfloat16, torch.float16, torch.float32][rint(0, 2)]

        src, _ = strided(sizes, dtype, rint, gen)
        dst, dbuf = strided(sizes, dtype, rint, gen)
        before = dbuf.clone()
        assert move(emu, [dst], [src], False) == 0, (case, sizes)
        want = before.clone()
        want.as_strided(dst.shape, dst.stride(), dst.storage_offset()).copy_(src)
        assert torch.equal(dbuf, want), (case, sizes, dtype)
        acc, abuf = strided(sizes, torch.float32, rint, gen)
        want = abuf.clone()
        want.as_strided(acc.shape, acc.stride(), acc.storage_offset()).add_(src.float())
        assert move(emu, [acc], [src], True) == 0
        assert torch.equal(abuf, want), (case, sizes, dtype)
        if dtype != torch.float32 or case % 2:
            src[tuple(rint(0, n - 1) for n in sizes)] = float("nan") if case % 3 else float("inf")
        flag = torch.zeros(1, dtype=torch.int32)
        assert move(emu, [flag.expand(src.shape)], [src], False, op=2) == 0
        assert bool(flag.item()) == (not bool(torch.isfinite(src).all())), (case, sizes)
