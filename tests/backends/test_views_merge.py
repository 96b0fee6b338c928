"""The log-sum-exp merge of the C++ views driver's kernel calls into its accumulators on CUDA
(csrc/views/merge_kernel.cuh), run on the CPU through the kernels' emulation
(tests/cuda_emulation/run_merge.cpp): the calls of a branch (strided five-dim views of the
accumulators, as views.cpp's Run::view gives them, and the calls' transposed outputs) merged
several at a time, one launch for up to kMergeCalls calls, with and without the non-finite
corrections. Each is compared with a float64 reference of the merge formula written here

    lse = logaddexp(lse_acc, lse_c),  out = exp(lse_acc - lse) out_acc + exp(lse_c - lse) out_c

(weights 0 where both are -inf; a call's values copied where the accumulators hold nothing yet),
and every element outside the calls' views must keep its value."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import pytest
import torch
from common import build_emulation

ACC = {torch.float32: 0, torch.float64: 1}
SRC = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    so = build_emulation("run_merge", tmp_path_factory.mktemp("emu"))
    so.da_emu_merge.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 2
    so.da_emu_merge_limits.argtypes = [ctypes.c_void_p]
    return so


def limits(so) -> tuple[int, int]:
    """kMergeCalls and the bytes of the kernel's argument."""
    out = torch.zeros(2, dtype=torch.int64)
    so.da_emu_merge_limits(out.data_ptr())
    return int(out[0]), int(out[1])


@dataclass
class Fix:
    """A call's non-finite corrections: flags any (1,), qbad (C, Bb, m, n), kbad and vbad
    (C, Bb, mk, nk), values v (C, Bb, mk, nk, D) in the call's out dtype (vbad, v: causal only)."""

    any: torch.Tensor
    qbad: torch.Tensor
    kbad: torch.Tensor
    vbad: torch.Tensor | None
    v: torch.Tensor | None
    g: int
    causal: bool


@dataclass
class Call:
    out_acc: torch.Tensor  # (C, Bb, m, n, D) view of the accumulator
    lse_acc: torch.Tensor  # (C, Bb, m, n)
    out_c: torch.Tensor  # (C, Bb, n, m, D)
    lse_c: torch.Tensor  # (C, Bb, n, m), in the accumulators' dtype
    fix: Fix | None = None


def list_strides(x: torch.Tensor) -> list[int]:
    return list(x.stride())


def merge(so, calls: list[Call], first: bool) -> int:
    """Runs the emulated kernel on calls (run_merge.cpp's layout); returns the launches taken."""
    meta: list[int] = []
    ptrs: list[int] = []
    for c in calls:
        f = c.fix
        meta += list(c.out_acc.shape) + list_strides(c.out_acc) + list_strides(c.lse_acc)
        meta += list_strides(c.out_c) + list_strides(c.lse_c)
        if f is None:
            meta += [0] * 22
            ptrs += [c.out_acc.data_ptr(), c.lse_acc.data_ptr(), c.out_c.data_ptr(), c.lse_c.data_ptr()]
            ptrs += [0] * 5
            continue
        causal_v = f.vbad is not None
        meta += [1, int(causal_v), f.kbad.shape[2], f.g, int(f.causal)]
        meta += list_strides(f.qbad) + list_strides(f.kbad)
        meta += list_strides(f.vbad) + list_strides(f.v) if causal_v else [0] * 9
        ptrs += [c.out_acc.data_ptr(), c.lse_acc.data_ptr(), c.out_c.data_ptr(), c.lse_c.data_ptr()]
        ptrs += [f.any.data_ptr(), f.qbad.data_ptr(), f.kbad.data_ptr()]
        ptrs += [f.vbad.data_ptr(), f.v.data_ptr()] if causal_v else [0, 0]
    assert len(meta) == 45 * len(calls)
    meta_t = torch.tensor(meta, dtype=torch.int64)
    ptr_arr = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
    acc = ACC[calls[0].out_acc.dtype] if calls else 0
    src = SRC[calls[0].out_c.dtype] if calls else 0
    return so.da_emu_merge(acc, src, len(calls), int(first), meta_t.data_ptr(), ptr_arr)


def reference(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, c: Call, first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (C, Bb, m, n, D) out and (C, Bb, m, n) lse of call c in float64, from the
    accumulators' float64 values out_acc and lse_acc at its rows."""
    o = c.out_c.double().transpose(2, 3)
    b = c.lse_c.double().transpose(2, 3)
    f = c.fix
    if f is not None and int(f.any) != 0:
        m, mk = o.shape[2], f.kbad.shape[2]
        # rows x <= j of the keys with causal masking (the last row reads every one), every one without
        reads = torch.tensor(
            [[x <= (j if f.causal and j < mk - 1 else mk - 1) for x in range(mk)] for j in range(m)]
        )
        kb = f.kbad.bool().repeat_interleave(f.g, dim=3)  # (C, Bb, mk, n)
        nan_row = f.qbad.bool() | (reads[None, None, :, :, None] & kb[:, :, None]).any(3)
        if f.vbad is not None:
            v = f.v.double()
            bad = f.vbad.bool()[..., None] & ~torch.isfinite(v)
            vals = torch.where(bad, v, 0.0).repeat_interleave(f.g, dim=3)  # (C, Bb, mk, n, D)
            o = o + torch.where(reads[None, None, :, :, None, None], vals[:, :, None], 0.0).sum(3)
        o = torch.where(nan_row[..., None], math.nan, o)
        b = torch.where(nan_row, math.nan, b)
    if first:
        return o, b
    lse = torch.logaddexp(lse_acc, b)
    empty = (lse_acc == -math.inf) & (b == -math.inf)
    wa = torch.where(empty, 0.0, torch.exp(lse_acc - lse))
    wb = torch.where(empty, 0.0, torch.exp(b - lse))
    return wa[..., None] * out_acc + wb[..., None] * o, lse


def view_of(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x's view at the elements of `like`, a view of a buffer of x's sizes and strides."""
    return x.as_strided(like.shape, like.stride(), like.storage_offset())


class Branch:
    """The float accumulators out (B, N, H, D) and lse (B, N, H) of the driver, as strided views
    into larger buffers (padding after the head dim and the heads), and the calls of one branch
    (segment w, dilation r: phase p reads rows p::r of each segment at heads p n .. (p + 1) n)."""

    def __init__(self, B: int, N: int, H: int, D: int, acc: torch.dtype, gen: torch.Generator):
        self.B, self.N, self.H, self.D, self.acc, self.gen = B, N, H, D, acc, gen
        self.obuf = torch.randn(B, N, H, D + 3, generator=gen, dtype=torch.float64).to(acc)
        self.lbuf = (3 * torch.randn(B, N, H + 1, generator=gen, dtype=torch.float64)).to(acc)
        self.out, self.lse = self.obuf[..., :D], self.lbuf[..., :H]

    def views(self, w: int, r: int, p0: int, C: int, b: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's (C, Bb, m, n, D) and (C, Bb, m, n) views (views.cpp Run::view): phases
        p0 .. p0 + C, all batch entries folded with the segments (b None) or batch entry b's segments."""
        n, m = self.H // r, w // r
        out = []
        for x in (self.out, self.lse.unsqueeze(-1)):
            sB, sN, sH, sE = x.stride()
            Bb = self.B * self.N // w if b is None else self.N // w
            off = x.storage_offset() + p0 * (sN + n * sH) + (0 if b is None else b * sB)
            out.append(x.as_strided((C, Bb, m, n, x.shape[3]), (sN + n * sH, w * sN, r * sN, sH, sE), off))
        return out[0], out[1].squeeze(-1)

    def call(
        self, w: int, r: int, p0: int, C: int, b: int | None, src: torch.dtype, transposed: bool
    ) -> Call:
        """A call at those views with random out (C, Bb, n, m, D) (the kernel's layout, or a transpose
        of (C, Bb, m, n, D)) and lse (C, Bb, n, m) narrowed from a longer last dim, some rows -inf."""
        oa, la = self.views(w, r, p0, C, b)
        C, Bb, m, n, D = oa.shape
        gen = self.gen
        if transposed:
            oc = torch.randn(C, Bb, m, n, D, generator=gen, dtype=torch.float64).to(src).transpose(2, 3)
        else:
            oc = torch.randn(C, Bb, n, m, D, generator=gen, dtype=torch.float64).to(src)
        lc = (3 * torch.randn(C, Bb, n, m + 2, generator=gen, dtype=torch.float64)).to(self.acc)[..., :m]
        lc[torch.rand(lc.shape, generator=gen) < 0.15] = -math.inf
        return Call(oa, la, oc, lc)

    def uncover(self, frac: float) -> None:
        """Rows the accumulators hold nothing at yet: lse -inf and out 0."""
        hole = torch.rand(self.lse.shape, generator=self.gen) < frac
        self.lse[hole] = -math.inf
        self.out[hole] = 0


def check(so, br: Branch, calls: list[Call], first: bool, launches: int | None = None) -> None:
    """Merges calls with the emulated kernel and compares both whole buffers with the reference."""
    if first:  # what the accumulators hold at the calls' rows must not be read
        for c in calls:
            c.out_acc.fill_(math.nan)
            c.lse_acc.fill_(math.nan)
    want_o, want_l = br.obuf.double().clone(), br.lbuf.double().clone()
    for c in calls:
        o, lse = reference(view_of(want_o, c.out_acc), view_of(want_l, c.lse_acc), c, first)
        view_of(want_o, c.out_acc).copy_(o)
        view_of(want_l, c.lse_acc).copy_(lse)
    got = merge(so, calls, first)
    if launches is not None:
        assert got == launches
    tol = {"rtol": 1e-5, "atol": 1e-5} if br.acc == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(br.obuf.double(), want_o, equal_nan=True, **tol)
    torch.testing.assert_close(br.lbuf.double(), want_l, equal_nan=True, **tol)


def test_limits(emu):
    """Several calls a launch, and the kernel's argument within the 4 KiB every toolkit takes."""
    calls, size = limits(emu)
    assert calls >= 2
    assert size <= 4096


@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("first", [False, True])
def test_runs_of_a_branch_merged_in_one_launch(emu, acc, src, first):
    """The runs of a branch (phases in calls of one and two, a batch entry's segments or every
    batch entry's, of different row counts) in one launch: each call's rows get its own values."""
    gen = torch.Generator().manual_seed(7 * ACC[acc] + SRC[src] + 100 * first)
    br = Branch(2, 16, 8, 20, acc, gen)
    br.uncover(0.2)
    w, r = 8, 4
    calls = [
        br.call(w, r, 0, 1, None, src, False),  # phase 0, every batch entry
        br.call(w, r, 1, 2, 0, src, True),  # phases 1, 2 of batch entry 0
        br.call(w, r, 1, 2, 1, src, False),  # and of batch entry 1
        br.call(w, r, 3, 1, 1, src, True),  # phase 3 of batch entry 1 (entry 0's left out)
    ]
    check(emu, br, calls, first, launches=1)


@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
def test_more_calls_than_a_launch_takes(emu, acc):
    """More calls than kMergeCalls: several launches (the calls in order), every call merged once."""
    k, _ = limits(emu)
    gen = torch.Generator().manual_seed(11 + ACC[acc])
    B, w, r = 3, 4, 4
    br = Branch(B, 8, 4, 33, acc, gen)
    br.uncover(0.1)
    calls = [br.call(w, r, p, 1, b, torch.bfloat16, (p + b) % 2 == 0) for p in range(r) for b in range(B)]
    assert len(calls) > k
    check(emu, br, calls, False, launches=-(-len(calls) // k))


def test_calls_of_no_rows_take_no_launch(emu):
    """A call of no rows takes no place in a launch; calls that are all empty take none."""
    gen = torch.Generator().manual_seed(3)
    br = Branch(1, 8, 4, 8, torch.float32, gen)
    empty = br.call(4, 2, 0, 0, None, torch.float32, False)
    assert empty.out_acc.numel() == 0
    assert merge(emu, [empty, empty], False) == 0
    check(emu, br, [empty, br.call(4, 2, 1, 1, None, torch.float32, False), empty], False, launches=1)


def fix_for(call: Call, g: int, causal: bool, gen: torch.Generator, active: bool = True) -> Fix:
    """Random corrections for call: flagged query and key rows (strided: transposed flags), and with
    causal masking flagged value rows that hold NaN or infinities among finite entries."""
    C, Bb, m, n, D = call.out_acc.shape
    nk = n // g
    qbad = (torch.rand(C, Bb, n, m, generator=gen) < 0.04).int().transpose(2, 3)
    qbad[0, -1, 1, -1] = 1  # one at least
    kbad = (torch.rand(C, Bb, m, nk, generator=gen) < 0.03).int()
    vbad = v = None
    if causal:
        v = torch.randn(C, Bb, m, nk, D, generator=gen, dtype=torch.float64)
        pick = torch.rand(v.shape, generator=gen)
        v[pick < 0.01] = math.inf
        v[(pick >= 0.01) & (pick < 0.02)] = -math.inf
        v[(pick >= 0.02) & (pick < 0.025)] = math.nan
        v = v.to(call.out_c.dtype)
        vbad = (~torch.isfinite(v)).any(-1).int()
    any_flag = torch.tensor([int(active)], dtype=torch.int32)
    return Fix(any_flag, qbad, kbad, vbad, v, g, causal)


@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("first", [False, True])
def test_nonfinite_corrections_per_call(emu, acc, src, causal, first):
    """Calls with their own corrections (grouped-query heads g = 2 in one, 1 in another, a call with
    the flags set but no non-finite input (any 0), a call without corrections) in one launch: the
    rows that read a flagged query or key row are NaN, and with causal masking the non-finite values
    of the rows read are added to the out."""
    gen = torch.Generator().manual_seed(5 + 2 * causal + 4 * first + 8 * SRC[src] + 32 * ACC[acc])
    br = Branch(2, 16, 8, 16, acc, gen)
    br.uncover(0.15)
    w, r = 8, 2
    calls = [br.call(w, r, 0, 1, b, src, b == 1) for b in range(2)] + [br.call(w, r, 1, 1, None, src, True)]
    calls.append(br.call(16, 4, 0, 0, None, src, False))  # an empty call among them
    calls[0].fix = fix_for(calls[0], 2, causal, gen)
    calls[1].fix = fix_for(calls[1], 1, causal, gen, active=False)
    calls[2].fix = fix_for(calls[2], 4, causal, gen)
    check(emu, br, calls, first, launches=1)
    assert torch.isnan(view_of(br.lbuf, calls[0].lse_acc)).any()  # the corrections did act
