"""Attention dropout in the native op's CPU kernels (SPEC section 3: drop entries of the normalised
weights, rescale by 1 / (1 - p), as FlashAttention does), against references that apply the
kernels' own keep mask (``dilated_attention.op.dropout_mask``)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from common import make_inputs, one_thread  # noqa: F401
from reference import reference_attention, reference_varlen
from tolerance import assert_within_rule

import dilated_attention
from dilated_attention import dilated_attention as dattn
from dilated_attention import op as _ops
from dilated_attention.backends import registry
from dilated_attention.backends.base import BackendRequest
from dilated_attention.backends.native import NativeBackend

P, SEED, OFFSET = 0.2, 1234567, 89


def test_mask_keeps_one_minus_p_and_is_a_function_of_its_arguments():
    mask = _ops.dropout_mask(2, 3, 64, 96, P, SEED, OFFSET)
    assert mask.shape == (2, 3, 64, 96) and mask.dtype == torch.bool
    n = mask.numel()
    kept = mask.double().mean().item()
    assert abs(kept - (1 - P)) < 5 * math.sqrt(P * (1 - P) / n)  # five standard errors
    # unbiased: the kept weight, rescaled, has mean 1
    assert abs(kept / (1 - P) - 1) < 5 * math.sqrt(P * (1 - P) / n) / (1 - P)
    assert torch.equal(mask, _ops.dropout_mask(2, 3, 64, 96, P, SEED, OFFSET))
    for other in (
        _ops.dropout_mask(2, 3, 64, 96, P, SEED + 1, OFFSET),
        _ops.dropout_mask(2, 3, 64, 96, P, SEED, 7),
    ):
        assert 0.25 < (other != mask).double().mean().item() < 0.4  # independent: 2 p (1 - p) = 0.32
    # a sub-block is the same mask (rows are absolute)
    assert torch.equal(_ops.dropout_mask(1, 2, 10, 20, P, SEED, OFFSET), mask[:1, :2, :10, :20])
    assert _ops.dropout_mask(1, 1, 4, 4, 0.0, SEED, OFFSET).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B,N,Hq,Hkv,D,segs,rates,causal",
    [
        (2, 37, 4, 2, 16, [8, 16], [1, 2], True),
        (1, 70, 2, 1, 8, [32, 64], [1, 4], False),
        (1, 16, 2, 2, 8, [8], [4], False),  # uncovered rows
    ],
)
def test_forward_and_gradients_match_the_masked_reference(B, N, Hq, Hkv, D, segs, rates, causal, dtype):
    q, k, v = make_inputs(B, N, Hq, Hkv, D, dtype, seed=N)
    scale = D**-0.5
    out, lse = torch.ops.dilated_attention.fwd(q, k, v, segs, rates, causal, scale, True, P, SEED, OFFSET)
    keep = _ops.dropout_mask(B, Hq, N, N, P, SEED, OFFSET)
    leaves64 = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_attention(*leaves64, segs, rates, causal, scale, keep=keep, dropout_p=P)
    plain = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, _ = reference_attention(*plain, segs, rates, causal, scale, dtype, keep=keep, dropout_p=P)
    assert_within_rule("out", out, out64, outl, dtype)
    torch.testing.assert_close(lse, lse64, rtol=1e-6, atol=1e-6)  # lse is that before dropout
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * dout).sum(), (q, k, v))
    ref = torch.autograd.grad((out64 * dout).sum(), leaves64)
    pl = torch.autograd.grad((outl.double() * dout).sum(), plain)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, pl, strict=True):
        assert_within_rule(name, a, e, p, dtype)


def test_gradcheck_with_dropout():
    q, k, v = make_inputs(1, 11, 4, 2, 3, torch.float64, seed=5)

    def f(q, k, v):
        return torch.ops.dilated_attention.fwd(q, k, v, [4, 8], [1, 2], True, 0.5, True, P, SEED, OFFSET)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)
    args = (q.detach(), k.detach(), v.detach(), [4, 8], [1, 2], True, 0.5, True, P, SEED, OFFSET)
    torch.library.opcheck(torch.ops.dilated_attention.fwd.default, args)


def test_packed_sequences_use_the_rows_of_the_packed_tensor():
    """varlen_fwd with dropout: sequence i, rows [c_i, c_i+1), reads the mask at those rows."""
    cu = [0, 13, 13, 40]
    q, k, v = (t[0] for t in make_inputs(1, 40, 2, 1, 8, torch.float64, seed=7))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out, _ = torch.ops.dilated_attention.varlen_fwd(
        q, k, v, cu_t, 27, [8, 16], [1, 2], True, 0.3, False, P, SEED, OFFSET
    )
    keep = _ops.dropout_mask(1, 2, 40, 40, P, SEED, OFFSET)
    ref, _ = reference_varlen(q, k, v, cu, [8, 16], [1, 2], True, 0.3, keep=keep, dropout_p=P)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("p", [0.3, 0.1, 1 / 3])
def test_float64_scale_is_exact(p):
    """1 / (1 - p) rounded to float would put 1e-7 relative error into every kept weight of a
    float64 call (p = 0.3): float64 kernels scale by the double."""
    q, k, v = make_inputs(1, 24, 2, 2, 8, torch.float64, requires_grad=False)
    out, _ = torch.ops.dilated_attention.fwd(q, k, v, [8, 24], [1, 2], True, 0.35, False, p, SEED, OFFSET)
    keep = _ops.dropout_mask(1, 2, 24, 24, p, SEED, OFFSET)
    ref, _ = reference_attention(q, k, v, [8, 24], [1, 2], True, 0.35, keep=keep, dropout_p=p)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_unbiased_on_average():
    """Averaged over many masks, the dropped output is the output without dropout."""
    q, k, v = make_inputs(1, 24, 2, 2, 8, torch.float64, requires_grad=False)
    plain, _ = torch.ops.dilated_attention.fwd(q, k, v, [8, 24], [1, 2], False, 0.35)
    runs = torch.stack(
        [
            torch.ops.dilated_attention.fwd(q, k, v, [8, 24], [1, 2], False, 0.35, False, P, s, 0)[0]
            for s in range(400)
        ]
    )
    err = (runs.mean(0) - plain).abs()
    stderr = runs.std(0) / math.sqrt(len(runs))
    assert (err <= 5 * stderr + 1e-12).all()


def test_manual_seed_makes_the_native_backend_reproducible():
    q, k, v = make_inputs(1, 32, 2, 2, 8, torch.float32)

    def run(seed):
        torch.manual_seed(seed)
        return dattn(q, k, v, [8, 16], [1, 2], dropout_p=P, backend="native")

    with warnings.catch_warnings():
        warnings.simplefilter("error", dilated_attention.DilatedAttentionWarning)  # native runs it
        a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    a.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_auto_keeps_native_for_dropout_on_cpu():
    q, k, _ = make_inputs(1, 32, 2, 2, 8, torch.float32, requires_grad=False)
    assert registry.BackendSelector().select("auto", q, k, 0.2).name == "native"
    assert registry.BackendSelector().select("native", q, k, 0.2).name == "native"


def test_native_takes_dropout_on_cuda(fake_gpu, monkeypatch):
    """The CUDA kernels draw the CPU kernels' mask (tests/cuda/test_cuda.py checks them, emulated and on a
    GPU): dropout changes none of native's reasons on either device, and a CUDA request with dropout
    runs native wherever one without would (explicitly, or first in auto's order)."""
    monkeypatch.setattr(_ops, "has_kernel", lambda device: True)
    monkeypatch.setattr(registry.hardware, "recommended_backends", lambda *a: ["native", "manual"])
    for device in ("cpu", "cuda"):

        def request(dropout, device=device):
            return BackendRequest(torch.device(device), torch.float32, 8, dropout)

        assert NativeBackend().reasons(request(True)) == NativeBackend().reasons(request(False)) == []
        with warnings.catch_warnings():
            warnings.simplefilter("error", dilated_attention.DilatedAttentionWarning)
            for requested in ("native", "auto"):
                assert registry.resolve(requested, request(True)).name == "native"


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_bad_dropout_p_is_a_value_error(p):
    q, k, v = make_inputs(1, 8, 2, 2, 4, torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got"):
        torch.ops.dilated_attention.fwd(q, k, v, [4], [1], False, 0.5, False, p, 0, 0)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got"):
        _ops.dropout_mask(1, 1, 2, 2, p, 0, 0)
