"""The sdpa backend's CUDA plumbing on the CPU: the cuDNN, flash and efficient operators replaced by
stand-ins that follow their ATen schemas (computed by the CPU flash operator), driven through the
view driver for every geometry, against the float64 reference. What runs on a GPU is in
test_backends_views.py (marked cuda)."""

from __future__ import annotations

import pytest
import torch
from test_backends_views import GEOMETRIES, _check

from dilated_attention import dilated_attention as dattn
from dilated_attention.backends import get_backend, sdpa_kernels

_aten = torch.ops.aten


def _rows_contiguous(**tensors: torch.Tensor) -> None:
    """Every fused CUDA operator reads the last dimension of its tensors as contiguous."""
    for name, x in tensors.items():
        assert x.stride(-1) == 1 or x.shape[-1] == 1, f"{name} has last-dim stride {x.stride(-1)}"


def _fwd(q, k, v, is_causal, scale):
    _rows_contiguous(q=q, k=k, v=v)
    assert q.shape[1] == k.shape[1], "the CUDA operators get as many key/value heads as query heads"
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def _layout(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.stride()


def _bwd(do, q, k, v, out, lse, is_causal, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, is_causal, scale=scale
    )


def _cudnn_stats(lse: torch.Tensor, layout: str) -> torch.Tensor:
    """cuDNN's softmax statistics as PyTorch returns them: (B, H, M) in older versions, (B, H, M, 1)
    in newer ones, and (B, M, H, 1) transposed to (B, H, M, 1) for ragged layouts."""
    if layout == "bhm":
        return lse
    if layout == "bhm1":
        return lse.unsqueeze(-1).contiguous()
    b, h, m = lse.shape
    stats = lse.new_empty((b, m, h, 1)).transpose(1, 2)
    stats.copy_(lse.unsqueeze(-1))
    return stats


class FakeCudaOps:
    """The three fused CUDA operators and their backwards, after their ATen schemas and the rules
    the real kernels hold their inputs to; ``stats``: the layout of cuDNN's softmax statistics (see
    _cudnn_stats).

    cuDNN, as PyTorch runs it: a call of one query row and one key is refused (``s_q = s_kv = 1 is
    not supported``), and the backward keeps one graph per shapes and strides of q, k, v (and the
    causal flag), built with the strides of ``out``, ``dout`` and the statistics of the first call
    with that key: a later call with the same key must hand them in the same layouts, or the real
    graph reads them with the first call's strides."""

    def __init__(self, stats: str = "bhm1"):
        self.calls: list[str] = []
        self.stats = stats
        self.stats_layouts: list[tuple] = []
        self.cudnn_graphs: dict[tuple, tuple] = {}

    def _scaled_dot_product_cudnn_attention(self, q, k, v, bias, lse_, p, is_causal, dbg, *, scale):
        assert bias is None and lse_ and p == 0.0
        if q.shape[2] == 1 and k.shape[2] == 1:
            raise RuntimeError("cuDNN Frontend error: s_q = s_kv = 1 is not supported.")
        self.calls.append("cudnn")
        out, lse = _fwd(q, k, v, is_causal, scale)
        stats = _cudnn_stats(lse, self.stats)
        self.stats_layouts.append((tuple(stats.shape), stats.stride()))
        e = torch.empty(0)
        return out, stats, None, None, q.shape[2], k.shape[2], e, e, e

    def _scaled_dot_product_cudnn_attention_backward(
        self, do, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, p, is_causal, *, scale
    ):
        assert (mq, mk) == (q.shape[2], k.shape[2])
        if mq == 1 and mk == 1:
            raise RuntimeError("cuDNN Frontend error: s_q = s_kv = 1 is not supported.")
        _rows_contiguous(q=q, k=k, v=v, out=out, dout=do)
        # The statistics come back in the layout the forward gave them (cuDNN reads them as such).
        assert (tuple(lse.shape), lse.stride()) in self.stats_layouts, (lse.shape, lse.stride())
        key = (_layout(q), _layout(k), _layout(v), bool(is_causal))
        baked = (_layout(out), _layout(do), _layout(lse))
        first = self.cudnn_graphs.setdefault(key, baked)
        assert first == baked, (
            f"cuDNN's cached backward graph for q, k, v {key} was built for out, dout, stats "
            f"{first} and would read this call's {baked} with those strides"
        )
        if self.stats != "bhm":
            lse = lse.squeeze(-1)
        return _bwd(do, q, k, v, out, lse.contiguous(), is_causal, scale)

    def _scaled_dot_product_flash_attention(self, q, k, v, p, is_causal, dbg, *, scale):
        self.calls.append("flash")
        out, lse = _fwd(q, k, v, is_causal, scale)
        e = torch.empty(0)
        return out, lse, None, None, q.shape[2], k.shape[2], e, e, e

    def _scaled_dot_product_flash_attention_backward(
        self, do, q, k, v, out, lse, cq, ck, mq, mk, p, is_causal, seed, offset, *, scale
    ):
        _rows_contiguous(q=q, k=k, v=v, out=out, dout=do)
        assert lse.dtype == torch.float32 and lse.is_contiguous(), "flash reads lse (B, H, M) contiguous"
        return _bwd(do, q, k, v, out, lse, is_causal, scale)

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, lse_, p, is_causal, *, scale):
        self.calls.append("efficient")
        out, lse = _fwd(q, k, v, is_causal, scale)
        m = lse.shape[-1]
        padded = lse.new_zeros((*lse.shape[:-1], (m + 31) // 32 * 32))  # as the kernel pads it
        padded[..., :m] = lse
        return out, padded, torch.empty(0), torch.empty(0)

    def _scaled_dot_product_efficient_attention_backward(
        self, do, q, k, v, bias, out, lse, seed, offset, p, mask, is_causal, *, scale
    ):
        _rows_contiguous(q=q, k=k, v=v, out=out, dout=do)
        if q.dtype in (torch.float16, torch.bfloat16):  # its kernel then computes delta from out
            assert out.stride(2) == out.shape[1] * out.shape[3], "the kernel steps out's rows by H * D"
        m = q.shape[2]
        assert lse.shape[-1] == (m + 31) // 32 * 32
        dq, dk, dv = _bwd(do, q, k, v, out, lse[..., :m].contiguous(), is_causal, scale)
        return dq, dk, dv, None


@pytest.mark.parametrize("kind", ["cudnn", "cudnn-bhm", "cudnn-ragged", "flash", "efficient"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", GEOMETRIES)
def test_cuda_operators_through_the_driver(monkeypatch, kind, B, N, Hq, Hkv, D, segs, rates, is_causal):
    kind, _, stats = kind.partition("-")
    fake = FakeCudaOps({"": "bhm1", "bhm": "bhm", "ragged": "bhm1t"}[stats])
    monkeypatch.setattr(sdpa_kernels, "_aten", lambda: fake)
    monkeypatch.setattr(sdpa_kernels, "cuda_kernel", lambda device, dtype, head_dim: kind)
    sdpa = type(get_backend("sdpa"))
    monkeypatch.setattr(sdpa, "native_gqa", lambda self, device: False)  # as on CUDA
    monkeypatch.setattr(sdpa, "cpp_driver", False)  # the Python driver over the stand-ins
    monkeypatch.setattr(sdpa, "row_dots", lambda self, *args, **kw: None)  # as on CUDA
    monkeypatch.setattr(
        sdpa, "attn_forward", lambda self, q, k, v, **kw: sdpa_kernels.cuda_forward(q, k, v, **kw)
    )
    monkeypatch.setattr(
        sdpa,
        "attn_backward",
        lambda self, dout, q, k, v, out, lse, extra, **kw: sdpa_kernels.cuda_backward(
            dout, q, k, v, out, lse, extra, **kw
        ),
    )
    monkeypatch.setattr(sdpa, "hides_nonfinite_scores", False)

    def run(q, k, v):
        return dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend="sdpa")

    _check(run, B, N, Hq, Hkv, D, segs, rates, is_causal, torch.float32)
    assert fake.calls and set(fake.calls) == {kind}


def test_efficient_backward_gets_out_packed(monkeypatch):
    """The efficient kernel's backward in half precision computes delta from out, stepping its rows
    by H * D whatever out's strides are: a strided view of the merged out (a call's rows of the
    accumulator) reaches it packed, and the gradients are those of float64 attention."""
    fake = FakeCudaOps()
    monkeypatch.setattr(sdpa_kernels, "_aten", lambda: fake)
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 6, 2, 8, generator=g).to(torch.bfloat16) for _ in range(4))
    out, lse, extra = sdpa_kernels.cuda_forward(q, k, v, is_causal=True, scale=0.3)
    acc = torch.zeros(1, 6, 4, 8, dtype=torch.bfloat16)  # a call's heads 0 and 2 of 4
    acc[:, :, ::2] = out
    got = sdpa_kernels.cuda_backward(dout, q, k, v, acc[:, :, ::2], lse, extra, is_causal=True, scale=0.3)
    x64 = [t.double().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*x64, is_causal=True, scale=0.3)
    want = torch.autograd.grad(ref, x64, dout.double().transpose(1, 2))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e.transpose(1, 2), atol=3e-2, rtol=3e-2)
