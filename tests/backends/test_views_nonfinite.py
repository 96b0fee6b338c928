"""Non-finite inputs in the sdpa backend's C++ driver without a read back to the host: one pass
flags the rows of q, k and v that hold a NaN or an infinity (on CUDA the kernel of
csrc/views/rows_kernel.cuh, run here through its CPU emulation) and the merge of every call
corrects its rows from the flags (csrc/views/merge_rule.h, the same code on the CPU and CUDA).
The driver's out and lse are compared with the Python driver's, whose corrections
(gathered.py's _NonFinite) read the inputs on the host, on geometries that take every kind of
kernel call (one phase per call, grouped-query heads, one head per phase, batch entries that do
not fold), NaN and infinities in each input."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from common import build_emulation, make_inputs, row_meta

from dilated_attention import dilated_attention as dattn
from dilated_attention.backends.sdpa import SdpaBackend
from dilated_attention.op import views as _views_op


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    so = build_emulation("run_rows", tmp_path_factory.mktemp("emu"))
    so.da_emu_rows_any.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_void_p] * 2
    return so


def mark_rows(so, xs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(any, per-row flags of xs) from the emulated check kernel, as rows_cuda.cu launches it:
    each row's int flag read at every element of the row (stride 0), one flag for all pairs."""
    flags = [torch.zeros(x.shape[:-1], dtype=torch.int32) for x in xs]
    any_flag = torch.zeros(1, dtype=torch.int32)
    meta = [v for f, x in zip(flags, xs, strict=True) for v in row_meta(f.unsqueeze(-1).expand(x.shape), x)]
    meta_t = torch.tensor(meta, dtype=torch.int64)
    ptrs = (ctypes.c_void_p * (2 * len(xs)))(
        *[p for f, x in zip(flags, xs, strict=True) for p in (f.data_ptr(), x.data_ptr())]
    )
    rc = so.da_emu_rows_any(2, len(xs), meta_t.data_ptr(), ptrs, any_flag.data_ptr())
    assert rc == 0
    return any_flag, flags


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
def test_rows_holding_nonfinite_entries_are_flagged_in_one_launch(emu, dtype, bad):
    """q, k, v as strided views of a fused projection: exactly the rows holding a NaN or an
    infinity are flagged, and the flag for all of them is set exactly when one is."""
    B, N, Hq, Hkv, D = 2, 9, 4, 2, 40
    torch.manual_seed(3)
    qkv = torch.randn(B, N, (Hq + 2 * Hkv) * D).to(dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=2)
    q, k, v = q.view(B, N, Hq, D), k.view(B, N, Hkv, D), v.view(B, N, Hkv, D)
    if bad is not None:
        q[1, 4, 3, 39] = bad
        k[0, 0, 1, 0] = bad
        v[1, 8, 0, 17] = bad
        v[0, 2, 1, 33] = bad
    any_flag, flags = mark_rows(emu, [q, k, v])
    for f, x in zip(flags, (q, k, v), strict=True):
        torch.testing.assert_close(f, (~torch.isfinite(x).all(-1)).to(torch.int32), rtol=0, atol=0)
    assert int(any_flag.item()) == int(bad is not None)


def _both_drivers(q, k, v, segs, rates, is_causal):
    """(out, lse) of the C++ driver and of the Python driver (the reference here)."""
    got = dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend="sdpa")
    try:
        SdpaBackend.cpp_driver = False
        want = dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend="sdpa")
    finally:
        SdpaBackend.cpp_driver = True
    return got, want


# B, N, Hq, Hkv, D, segment lengths, dilation rates: one phase per call (r < Hq), grouped-query
# heads, a head per phase (r >= Hq), a short last part, batch entries that do not fold, branches
# on k and v repeated to Hq heads (their flags and values repeated too)
GEOMETRIES = [
    (1, 24, 4, 2, 8, [8, 16], [1, 2]),
    (2, 20, 4, 4, 8, [8, 16], [1, 2]),
    (2, 21, 4, 1, 8, [6, 12, 24], [1, 2, 4]),
    (1, 32, 2, 2, 8, [8, 32], [2, 4]),
    (3, 13, 6, 3, 4, [4, 13], [1, 3]),
    (1, 24, 6, 3, 8, [12, 24], [2, 3]),  # the phases of one segment in one call
    (2, 24, 6, 2, 8, [8, 24], [2, 4]),  # irregular grouped-query heads: k and v repeated
    (1, 32, 12, 4, 4, [16, 32], [2, 4]),  # every branch on k and v repeated
]


@pytest.mark.skipif(not _views_op.available("cpu"), reason="the extension lacks the views driver")
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g[:5])))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "tensor,value", [("q", math.nan), ("k", math.inf), ("v", math.inf), ("v", -math.inf), ("v", math.nan)]
)
def test_corrections_in_the_merge_as_the_python_driver(geometry, is_causal, tensor, value):
    """Non-finite entries at a few places of one input, float64 (bit-level effects of the kernels
    aside, the two drivers differ only in where the corrections are made): the same out and lse,
    NaN and infinities at the same places."""
    B, N, Hq, Hkv, D, segs, rates = geometry
    q, k, v = make_inputs(B, N, Hq, Hkv, D, torch.float64, requires_grad=False)
    x = {"q": q, "k": k, "v": v}[tensor]
    g = torch.Generator().manual_seed(N * 7 + Hq)
    for _ in range(3):
        b, n, h, d = (int(torch.randint(s, (1,), generator=g)) for s in x.shape)
        x[b, n, h, d] = value
    (out, lse), (ref, ref_lse) = _both_drivers(q, k, v, segs, rates, is_causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10, equal_nan=True)
    assert (out.isnan() | out.isinf()).any()  # the entries reach some rows
