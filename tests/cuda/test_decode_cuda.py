"""The CUDA kernels of ``decode_step`` (csrc/cuda/decode.cuh): run on the CPU through the kernels'
emulation (tests/cuda_emulation: threads as fibers, warp shuffles as collectives) against the CPU op
on the same slots, and on a GPU (marked: needs a CUDA GPU and the extension's CUDA kernels) against
the float64 reference through ``BoundedDilatedKVCache``."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from common import build_emulation, make_inputs, needs_cuda_kernels, one_thread  # noqa: F401  (one_thread: autouse)
from reference import reference_attention

from dilated_attention.decode import BoundedDilatedKVCache
from dilated_attention.op.decode import decode_step, has_decode_kernel
from dilated_attention.op.slots import branch_slots

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if not has_decode_kernel("cpu"):
        pytest.skip("the emulation is compared with the CPU decode op, which this build lacks")
    so = build_emulation("run_decode", tmp_path_factory.mktemp("emu"))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    so.da_emu_decode.argtypes = [ctypes.c_int] + [i64] * 7 + [vp] * 3 + [ctypes.c_double] + [vp] * 8
    return so


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def emulate(so, q, k, v, kc, vc, pos, layout, scale, splits):
    B, Hq, D = q.shape
    Hkv, T = kc.shape[1], kc.shape[2]
    w, r, n = (torch.tensor([getattr(b, a) for b in layout], dtype=torch.int64) for a in ("w", "r", "length"))
    out = torch.full_like(q, float("nan"))
    lse = torch.full(
        (B, Hq), float("nan"), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32
    )
    rc = so.da_emu_decode(
        DTYPES[q.dtype], B, Hq, Hkv, D, T, len(layout), splits, _ptr(w), _ptr(r), _ptr(n), scale,
        _ptr(q), _ptr(k), _ptr(v), _ptr(kc), _ptr(vc), _ptr(pos), _ptr(out), _ptr(lse),
    )  # fmt: skip
    assert rc == 0
    return out, lse


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 16), (4, 4, 40), (48, 1, 16), (64, 1, 8)])
def test_emulated_kernels_equal_the_cpu_op(emu, dtype, splits, Hq, Hkv, D):
    """The kernels write the same slots and give the same out and lse as the CPU op, on slots of
    arbitrary values, with rows split into S pieces, a sequence without a token and D not a
    multiple of the warp."""
    segs, rates = (8, 32, 64), (1, 4, 16)
    layout = branch_slots(segs, rates, Hq // Hkv, None)
    T = sum(b.rows * b.length for b in layout)
    gen = torch.Generator().manual_seed(5)
    B = 4
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(B, Hkv, T, D, generator=gen).to(dtype) for _ in range(2))
    pos = torch.tensor([21, -1, 63, 40])
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = emulate(emu, q, k, v, kc, vc, pos, layout, 0.3, splits)
    ref, ref_lse = decode_step(q, k, v, kc2, vc2, pos, layout, 0.3, fused=True)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5 if dtype != torch.float64 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_emulated_kernels_give_nan_for_a_nan_query(emu, dtype, splits):
    """A NaN query (all its scores NaN) gives NaN out and lse, as the reference does, in every
    split; the kernels' running maximum once skipped such keys as empty (out 0, lse -inf)."""
    Hq, Hkv, D, segs, rates = 4, 2, 16, (8, 32), (1, 4)
    layout = branch_slots(segs, rates, Hq // Hkv, None)
    T = sum(b.rows * b.length for b in layout)
    gen = torch.Generator().manual_seed(6)
    B = 3
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(B, Hkv, T, D, generator=gen).to(dtype) for _ in range(2))
    q[0] = float("nan")  # every head
    q[2, 1] = float("nan")  # one head
    pos = torch.tensor([21, 30, 5])
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = emulate(emu, q, k, v, kc, vc, pos, layout, 0.3, splits)
    ref, ref_lse = decode_step(q, k, v, kc2, vc2, pos, layout, 0.3, fused=False)
    nan = torch.zeros(B, Hq, dtype=torch.bool)
    nan[0], nan[2, 1] = True, True
    assert torch.equal(lse.isnan(), nan) and torch.equal(ref_lse.isnan(), nan)
    assert out[nan].isnan().all() and not out[~nan].isnan().any()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.cuda
@needs_cuda_kernels(has_decode_kernel("cuda"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_steps_equal_the_reference(dtype):
    """On a GPU: token by token through the bounded cache, against the float64 reference."""
    segs, rates, N = (8, 16, 32), (1, 2, 4)[:3], 40
    q, k, v = make_inputs(2, N, 8, 2, 16, dtype, seed=4, requires_grad=False)
    ref, _ = reference_attention(q, k, v, segs, rates, is_causal=True)
    cache = BoundedDilatedKVCache(1, 2, 8, 2, 16, segs, rates, dtype=dtype, device="cuda", fused=True)
    outs = []
    for p in range(N):
        outs.append(cache.attend(0, *(t[:, p : p + 1].cuda() for t in (q, k, v))))
        cache.advance(1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(torch.cat(outs, 1).cpu().double(), ref, rtol=tol, atol=tol)
