"""Inputs whose last (head) dimension is not contiguous: ``x[..., ::2]``, a stride-0 expanded head
dim (``x[..., :1].expand(..., D)``) and the unbound views of a packed ``qkv`` (stride 3). Every
entry point that ends in a kernel (the gather-based backends' driver, the native op, packed
sequences, the ring's pieces, decoding) gives what the float64 reference gives on them, and the
driver hands every kernel call what the kernels read: a last dimension with stride 1."""

from __future__ import annotations

import pytest
import torch
from backend_fixtures import RUNNABLE, fresh_selection, one_thread  # noqa: F401
from common import grads
from reference import reference_attention, reference_piece, reference_varlen
from test_backends_cuda_ops import FakeCudaOps
from test_backends_views import _check
from tolerance import assert_within_rule

from dilated_attention import (
    BoundedDilatedKVCache,
    dilated_attention,
    dilated_attention_decode,
    dilated_attention_varlen,
)
from dilated_attention.backends import get_backend, sdpa_kernels

LAYOUTS = ["step2", "expanded", "unbind"]


def _strided(x: torch.Tensor, layout: str, requires_grad: bool = False) -> torch.Tensor:
    """A view of the values of ``x`` (.., D) whose last dimension is not contiguous (``expanded``:
    the first channel repeated, a stride-0 head dim). Its base, the autograd leaf where
    ``requires_grad``, holds NaN in the channels the view skips: a kernel that read the head dim
    as contiguous would read them."""
    nan = torch.full_like(x, float("nan"))
    if layout == "step2":
        base = torch.stack([x, nan], dim=-1).flatten(-2)
        return base.requires_grad_(requires_grad)[..., ::2]
    if layout == "expanded":
        base = torch.cat([x[..., :1], nan[..., :1]], dim=-1)
        return base.requires_grad_(requires_grad)[..., :1].expand(x.shape)
    base = torch.stack([nan, x, nan], dim=-1)  # as qkv.view(B, N, H, D, 3)
    return base.requires_grad_(requires_grad).unbind(-1)[1]


def _views(shapes, dtype, layout, seed=0, requires_grad=True):
    """Random tensors of ``shapes`` (float64 values rounded to ``dtype``) as such views."""
    g = torch.Generator().manual_seed(seed)
    return [
        _strided(torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype), layout, requires_grad)
        for shape in shapes
    ]


def _head_dim_contiguous(*args) -> None:
    """Every (.., m, h, D) tensor among ``args`` has a contiguous last dimension."""
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() == 4:
            assert t.shape[-1] <= 1 or t.stride(-1) == 1, (
                f"a kernel got a tensor {tuple(t.shape)} whose last dim has stride {t.stride(-1)}"
            )


@pytest.fixture
def kernels_check_strides(monkeypatch):
    """The kernel entry points of sdpa and manual assert that every tensor they get has a
    contiguous last dimension: q, k, v, and in the backward dout and out."""

    def checked(fn):
        def run(self, *args, **kwargs):
            _head_dim_contiguous(*args)
            return fn(self, *args, **kwargs)

        return run

    for name in ("sdpa", "manual"):
        cls = type(get_backend(name))
        for method in ("attn_forward", "attn_backward", "row_dots", "attn_autograd"):
            if method in cls.__dict__:
                monkeypatch.setattr(cls, method, checked(cls.__dict__[method]))


GEOMETRIES = [
    pytest.param(2, 32, 4, 4, 8, [8], [1], id="r1"),
    pytest.param(2, 37, 4, 4, 8, [8, 16], [1, 2], id="r-lt-Hq-tail"),
    pytest.param(1, 48, 2, 2, 8, [16, 24], [4, 8], id="r-gt-Hq"),
    pytest.param(2, 29, 6, 3, 8, [8, 16], [3, 8], id="gqa-r-ge-Hq-tail"),
]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", GEOMETRIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", RUNNABLE)
def test_views_of_the_head_dim_match_the_reference(
    kernels_check_strides, backend, layout, B, N, Hq, Hkv, D, segs, rates, is_causal
):
    q, k, v = _views([(B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D)], torch.float32, layout)

    def run(q, k, v):
        return dilated_attention(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend=backend)

    _check(run, B, N, Hq, Hkv, D, segs, rates, is_causal, torch.float32, q, k, v)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", RUNNABLE)
def test_self_attention_on_one_view(kernels_check_strides, backend, layout):
    """q = k = v, one view: copied once, and right."""
    (x,) = _views([(2, 24, 2, 8)], torch.float64, layout)
    out, lse = dilated_attention(x, x, x, [8, 16], [1, 2], is_causal=True, return_lse=True, backend=backend)
    x64 = x.detach().clone().requires_grad_()
    ref, ref_lse = reference_attention(x64, x64, x64, [8, 16], [1, 2], True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, x, dout)
    (g64,) = torch.autograd.grad(ref, x64, dout)
    torch.testing.assert_close(g, g64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", RUNNABLE)
def test_gradient_of_out_that_is_a_view_of_the_head_dim(kernels_check_strides, backend, layout):
    """The backward given a ``dout`` whose last dimension is not contiguous."""
    B, N, Hq, Hkv, D, segs, rates = 2, 24, 4, 2, 8, [8, 16], [1, 2]
    q, k, v = _views([(B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D)], torch.float64, "step2", seed=1)
    (dout,) = _views([(B, N, Hq, D)], torch.float64, layout, seed=2, requires_grad=False)
    out = dilated_attention(q, k, v, segs, rates, is_causal=True, backend=backend)
    got = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*leaves, segs, rates, True)
    expected = torch.autograd.grad(ref, leaves, dout)
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["cudnn", "flash", "efficient"])
def test_cuda_operators_get_a_contiguous_head_dim(monkeypatch, kind, layout):
    """The sdpa backend's CUDA operators (stand-ins that assert a contiguous last dimension, as the
    fused CUDA kernels read it) under the driver, on views of the head dim, dout included."""
    fake = FakeCudaOps()
    monkeypatch.setattr(sdpa_kernels, "_aten", lambda: fake)
    monkeypatch.setattr(sdpa_kernels, "cuda_kernel", lambda device, dtype, head_dim: kind)
    sdpa = type(get_backend("sdpa"))
    monkeypatch.setattr(sdpa, "native_gqa", lambda self, device: False)
    monkeypatch.setattr(sdpa, "cpp_driver", False)  # the Python driver over the stand-ins
    monkeypatch.setattr(sdpa, "row_dots", lambda self, *args, **kw: None)

    def forward(self, q, k, v, **kw):
        _head_dim_contiguous(q, k, v)
        return sdpa_kernels.cuda_forward(q, k, v, **kw)

    def backward(self, dout, q, k, v, out, lse, extra, **kw):
        _head_dim_contiguous(dout, q, k, v, out)
        return sdpa_kernels.cuda_backward(dout, q, k, v, out, lse, extra, **kw)

    monkeypatch.setattr(sdpa, "attn_forward", forward)
    monkeypatch.setattr(sdpa, "attn_backward", backward)
    monkeypatch.setattr(sdpa, "hides_nonfinite_scores", False)
    B, N, Hq, Hkv, D, segs, rates = 2, 37, 4, 2, 8, [8, 16], [1, 2]
    q, k, v = _views([(B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D)], torch.float32, layout)

    def run(q, k, v):
        return dilated_attention(q, k, v, segs, rates, is_causal=True, return_lse=True, backend="sdpa")

    _check(run, B, N, Hq, Hkv, D, segs, rates, True, torch.float32, q, k, v)
    (dout,) = _views([(B, N, Hq, D)], torch.float32, layout, seed=3, requires_grad=False)
    out, _ = run(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)
    assert fake.calls and set(fake.calls) == {kind}


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", RUNNABLE)
def test_packed_sequences_on_views(kernels_check_strides, backend, layout, is_causal):
    lengths, Hq, Hkv, D, segs, rates = [7, 0, 20, 13], 4, 2, 8, [4, 8], [1, 2]
    T = sum(lengths)
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    q, k, v = _views([(T, Hq, D), (T, Hkv, D), (T, Hkv, D)], torch.float32, layout)
    out, lse = dilated_attention_varlen(
        q, k, v, cu, max(lengths), segs, rates, is_causal=is_causal, return_lse=True, backend=backend
    )
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_varlen(q64, k64, v64, cu_list, segs, rates, is_causal)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_varlen(ql, kl, vl, cu_list, segs, rates, is_causal, dtype=torch.float32)
    assert_within_rule("out", out, out64, outl, torch.float32)
    assert_within_rule("lse", lse, lse64, lsel, torch.float32)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    got = grads(out, lse, (q, k, v), dout, None)
    ref = grads(out64, lse64, (q64, k64, v64), dout, None)
    plain = grads(outl, lsel, (ql, kl, vl), dout, None)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(name, a, e, p, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("engine", ["native", "sdpa"])
def test_ring_pieces_on_views(kernels_check_strides, engine, layout):
    """A piece of sequence parallelism (queries against a run of keys, the queries' own keys last,
    causal) on views of the head dim, dout and the merged out included."""
    from dilated_attention import op as _ops
    from dilated_attention.ring.geometry import HeadSets
    from dilated_attention.ring.pieces import PieceAttention

    if engine == "native" and not _ops.has_piece_kernel("cpu"):
        pytest.skip("extension built without piece op")
    B, nq, nk, Hq, Hkv, D = 2, 9, 20, 4, 2, 8
    offset = nk - nq
    shapes = [(B, nq, Hq, D), (B, nk, Hkv, D), (B, nk, Hkv, D), (B, nq, Hq, D)]
    q, k, v, dout = _views(shapes, torch.float64, layout, requires_grad=False)
    pa = PieceAttention(get_backend(engine), torch.device("cpu"))
    assert pa.name == engine
    hs = HeadSets(torch.arange(Hq), torch.arange(Hkv), torch.arange(Hq) // (Hq // Hkv), True)
    scale = D**-0.5
    out, lse, aux = pa.forward(q, k, v, hs, offset, scale)
    dlse = torch.zeros(lse.shape, dtype=lse.dtype)
    out_view = _strided(out, "step2")
    dq, dk, dv = pa.backward(dout, dlse, q, k, v, hs, out_view, lse, offset, scale, aux)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_piece(*leaves, offset)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    for a, e in zip((dq, dk, dv), torch.autograd.grad(ref, leaves, dout), strict=True):
        torch.testing.assert_close(a.double(), e)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", RUNNABLE)
def test_decode_on_views(kernels_check_strides, backend, layout):
    """A prefill by ``backend``, then one token at a time, with the full cache and with the bounded
    one (fused decode step and plain), q, k and v views of the head dim: the reference of the
    whole causal sequence."""
    B, N, Hq, Hkv, D, segs, rates = 2, 21, 4, 2, 8, (4, 8), (1, 2)
    shapes = [(B, N, Hq, D), (B, N, Hkv, D), (B, N, Hkv, D)]
    q, k, v = _views(shapes, torch.float64, layout, requires_grad=False)
    ref, ref_lse = reference_attention(q, k, v, segs, rates, is_causal=True)
    steps = [(0, 5)] + [(p, p + 1) for p in range(5, N)]
    kc = torch.zeros(B, N, Hkv, D, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    outs, lses = [], []
    for a, b in steps:
        o, s = dilated_attention_decode(
            q[:, a:b], kc, vc, a, segs, rates, k=k[:, a:b], v=v[:, a:b], return_lse=True, backend=backend
        )
        outs.append(o)
        lses.append(s)
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat(lses, -1), ref_lse, rtol=1e-10, atol=1e-10)
    for fused in (True, False):
        cache = BoundedDilatedKVCache(1, B, Hq, Hkv, D, segs, rates, dtype=torch.float64, fused=fused)
        outs, lses = [], []
        for a, b in steps:
            o, s = cache.attend(0, q[:, a:b], k[:, a:b], v[:, a:b], return_lse=True, backend=backend)
            cache.advance(b - a)
            outs.append(o)
            lses.append(s)
        torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(torch.cat(lses, -1), ref_lse, rtol=1e-10, atol=1e-10)
