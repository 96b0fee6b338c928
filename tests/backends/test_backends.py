"""The attention backends against the float64 dense reference, dropout, and the plan cache.
Selection and fallback: test_backends_selection.py; the flash_attn and xformers adapters through
test doubles: test_backends_adapters.py; the view driver: test_backends_views.py."""

from __future__ import annotations

import math

import pytest
import torch
from backend_fixtures import DTYPES, LOGGER, RUNNABLE, fresh_selection, one_thread  # noqa: F401
from common import grads, make_inputs
from reference import reference_attention
from tolerance import assert_within_rule

from dilated_attention import backends, dilated_attention_varlen
from dilated_attention import dilated_attention as dattn
from dilated_attention.backends import BackendRequest, get_backend, select_backend

# (B, N, Hq, Hkv, D, segment_lengths, dilation_rates)
CONFIGS = [
    pytest.param(1, 16, 1, 1, 8, [4], [1], id="one-branch"),
    pytest.param(2, 37, 4, 2, 16, [8, 16], [1, 2], id="odd-N-gqa-ragged"),
    pytest.param(1, 64, 4, 4, 16, [16, 32, 64], [1, 2, 4], id="three-branches"),
    pytest.param(2, 50, 6, 3, 8, [5, 10, 20, 40], [1, 2, 3, 4], id="four-branches-ragged"),
    pytest.param(1, 20, 2, 1, 8, [32], [2], id="w-greater-than-N"),
    pytest.param(1, 30, 4, 2, 16, [6, 12], [6, 3], id="r-equals-w"),
    pytest.param(1, 16, 2, 2, 8, [8], [4], id="uncovered-rows"),
    pytest.param(1, 24, 6, 2, 8, [8, 12], [2, 4], id="gqa-heads-not-grouped"),
    pytest.param(1, 23, 4, 4, 8, [6, 7], [4, 3], id="w-not-multiple-of-r"),
    pytest.param(1, 1, 2, 1, 4, [1, 4], [1, 2], id="N-1"),
    pytest.param(2, 24, 4, 1, 8, [8, 8], [1, 1], id="repeated-branch"),
]


def check_against_reference(
    run,
    B,
    N,
    Hq,
    Hkv,
    D,
    segs,
    rates,
    is_causal,
    dtype,
    scale=None,
    with_dlse=True,
    seed=0,
    dout_scale=1.0,
    ref=reference_attention,
):
    """``run(q, k, v) -> (out, lse)`` against the float64 reference, forward and backward, within
    the tolerance rule of SPEC section 4. ``seed`` picks the inputs, ``dout_scale`` multiplies the
    output gradients (large gradients stand above the rule's absolute floor), and ``ref`` stands
    for :func:`reference_attention` (same signature)."""
    q, k, v = make_inputs(B, N, Hq, Hkv, D, dtype, seed=seed)
    out, lse = run(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (B, Hq, N)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = ref(q64, k64, v64, segs, rates, is_causal, scale)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, lsel = ref(ql, kl, vl, segs, rates, is_causal, scale, dtype=dtype)
    assert_within_rule("out", out, out64, outl, dtype)
    assert_within_rule("lse", lse, lse64, lsel, dtype)

    g = torch.Generator().manual_seed(seed + 1)
    dout = dout_scale * torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = dout_scale * torch.randn(lse.shape, generator=g, dtype=torch.float64) if with_dlse else None
    got = grads(out, lse, (q, k, v), dout, dlse)
    ref = grads(out64, lse64, (q64, k64, v64), dout, dlse)
    plain = grads(outl, lsel, (ql, kl, vl), dout, dlse)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert a.dtype == dtype
        assert_within_rule(name, a, e, p, dtype)


# ----------------------------------------------------------------------------------------------
# Every backend that runs here, against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", CONFIGS)
@pytest.mark.parametrize("backend", RUNNABLE)
def test_backend_matches_reference(backend, B, N, Hq, Hkv, D, segs, rates, is_causal, dtype):
    def run(q, k, v):
        return dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend=backend)

    check_against_reference(run, B, N, Hq, Hkv, D, segs, rates, is_causal, dtype)
    # No fallback happened: the backend asked for is the one that ran.
    assert [s.name for s in backends.default_selector().selections()] == [backend]


@pytest.mark.parametrize("backend", RUNNABLE)
def test_uncovered_rows_zero_and_neg_inf_with_finite_grads(backend):
    # r = 4 > Hq = 2: phases 2 and 3 of each segment are read by no head.
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32)
    out, lse = dattn(q, k, v, [8], [4], return_lse=True, backend=backend)
    phase = (torch.arange(16) % 8) % 4
    for h in range(2):
        covered = phase == h
        assert torch.isfinite(lse[0, h, covered]).all()
        assert torch.isneginf(lse[0, h, ~covered]).all()
        assert (out[0, ~covered, h] == 0).all()
    assert not torch.isnan(out).any()
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    (out.sum() + finite.sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("backend", ["sdpa", "manual"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck_out_and_lse(backend, is_causal):
    q, k, v = make_inputs(1, 11, 4, 2, 3, torch.float64, seed=5)

    def f(q, k, v):
        return dattn(q, k, v, [4, 8], [1, 2], is_causal=is_causal, return_lse=True, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


def test_softmax_scale_and_strided_inputs():
    B, N, H, D = 2, 45, 4, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).transpose(1, 2)  # not contiguous
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, N, H, 2 * D, generator=g, dtype=torch.float64)[..., ::2]
    out64, lse64 = reference_attention(q, k, v, [8, 32], [1, 4], True, softmax_scale=0.3)
    for backend in RUNNABLE:
        out, lse = dattn(
            q, k, v, [8, 32], [1, 4], softmax_scale=0.3, return_lse=True, is_causal=True, backend=backend
        )
        torch.testing.assert_close(out, out64, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, lse64, rtol=1e-10, atol=1e-10)


def test_no_grad_and_inference_mode():
    q, k, v = make_inputs(1, 20, 2, 2, 8, torch.float32, requires_grad=False)
    ref, _ = reference_attention(q, k, v, [8, 16], [1, 2])
    for backend in RUNNABLE:
        with torch.inference_mode():
            out = dattn(q, k, v, [8, 16], [1, 2], backend=backend)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "manual"])
def test_dropout_backward_exact_for_a_fixed_mask(backend):
    """With the random state reset before each call the dropout mask is fixed, the function is
    smooth, and its backward must be exact (gradcheck, float64)."""
    q, k, v = make_inputs(1, 9, 4, 2, 3, torch.float64, seed=7)
    impl = get_backend(backend)

    def f(q, k, v):
        torch.manual_seed(123)
        return impl.forward(q, k, v, [4], [1], is_causal=True, softmax_scale=0.5, dropout_p=0.3)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "manual"])
def test_dropout_keeps_lse_and_is_unbiased(backend):
    q, k, v = make_inputs(1, 24, 2, 2, 8, torch.float64, requires_grad=False)
    segs, rates, p = [16], [2], 0.25
    ref_out, ref_lse = reference_attention(q, k, v, segs, rates)
    torch.manual_seed(0)
    outs = []
    for _ in range(400):
        out, lse = dattn(q, k, v, segs, rates, dropout_p=p, return_lse=True, backend=backend)
        torch.testing.assert_close(lse, ref_lse)  # dropout does not change the log-sum-exp
        outs.append(out)
    stack = torch.stack(outs)
    assert not torch.equal(stack[0], stack[1])  # the masks differ from call to call
    assert (stack[0] - ref_out).abs().max() > 1e-3  # and dropout did something
    # E[out] = out without dropout; the mean of 400 draws is within a few standard errors.
    err = (stack.mean(0) - ref_out).abs()
    sem = stack.std(0) / math.sqrt(len(outs))
    assert (err <= 5 * sem + 1e-9).float().mean() > 0.99
    assert err.max() < 0.1


@pytest.mark.parametrize("backend", ["sdpa", "manual"])
def test_dropout_over_several_branches_is_refused_by_the_gather_backends(backend):
    """Dropout drops entries of the merged weights (SPEC section 3); the gather-based kernels drop
    each branch's weights on their own, so a key read through two branches (position 0 of head 0
    always is) would be dropped twice. Selection passes them over for such a call: ``auto`` takes
    native, a gather backend asked for by name is refused with the reason, and so is the backend
    itself, called directly."""
    q, k, v = make_inputs(1, 24, 2, 2, 8, torch.float64, requires_grad=False)
    request = BackendRequest.from_tensors(q, k, 0.25, branches=2)
    assert request.merged_dropout
    assert any("dropout over several branches" in w for w in get_backend(backend).all_reasons(request))
    assert not get_backend("native").all_reasons(request)
    assert select_backend("auto", q, k, dropout_p=0.25, branches=2).name == "native"
    # asked for by name, the call is refused with the reason (its fallbacks cannot run it either)
    with pytest.raises(RuntimeError, match=rf"(?s)requested '{backend}'.*dropout over several branches"):
        dattn(q, k, v, [8, 16], [1, 2], dropout_p=0.25, backend=backend)
    with pytest.raises(RuntimeError, match=r"dropout over several branches.*use native"):
        dilated_attention_varlen(
            q[0], k[0], v[0], torch.tensor([0, 10, 24], dtype=torch.int32), 14, [8, 16], [1, 2],
            dropout_p=0.25, backend=backend,
        )  # fmt: skip
    # auto runs it on native (the lse needs no dropout draw)
    _, lse = dattn(q, k, v, [8, 16], [1, 2], dropout_p=0.25, return_lse=True, backend="auto")
    torch.testing.assert_close(lse, reference_attention(q, k, v, [8, 16], [1, 2])[1])
    match = rf"the '{backend}' backend cannot apply attention dropout \(dropout_p=0.25\) to several branches.*backend='native'"
    with pytest.raises(ValueError, match=match):
        get_backend(backend).forward(
            q, k, v, [8, 16], [1, 2], is_causal=False, softmax_scale=0.3, dropout_p=0.25
        )
    # without dropout, or with one branch, they run
    assert select_backend(backend, q, k, dropout_p=0.25, branches=1).name == backend
    dattn(q, k, v, [8, 16], [1, 2], backend=backend)
    dattn(q, k, v, [16], [2], dropout_p=0.25, backend=backend)
    _, lse = dattn(q, k, v, [8, 16], [1, 2], dropout_p=0.25, return_lse=True, backend="native")
    torch.testing.assert_close(lse, reference_attention(q, k, v, [8, 16], [1, 2])[1])


def test_native_declares_dropout_on_cpu_and_cuda():
    native = get_backend("native")
    assert not native.reasons(BackendRequest(torch.device("cpu"), torch.float32, 8, dropout=True))
    why = native.reasons(BackendRequest(torch.device("cuda"), torch.float32, 8, dropout=True))
    assert not any("dropout" in w for w in why)
    out, _ = native.forward(
        *make_inputs(1, 8, 1, 1, 4, torch.float32),
        [4],
        [1],
        is_causal=False,
        softmax_scale=0.5,
        dropout_p=0.1,
    )
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------------------------
# The plan cache (dilated_attention.get_pattern_cache)
# ----------------------------------------------------------------------------------------------


def test_backends_share_the_plan_cache(monkeypatch):
    """Every driver plans through the one C++ plan cache: sdpa's Python driver, manual and sdpa's
    C++ driver (where the extension has it) hit the plan the first call made."""
    from dilated_attention import get_pattern_cache
    from dilated_attention.backends.sdpa import SdpaBackend
    from dilated_attention.op import views as views_op

    cache = get_pattern_cache()
    cache.clear()
    assert cache.info().hits == 0 and cache.info().misses == 0 and len(cache) == 0
    q, k, v = make_inputs(1, 19, 2, 2, 4, torch.float32, requires_grad=False)
    monkeypatch.setattr(SdpaBackend, "cpp_driver", False)
    dattn(q, k, v, [8], [2], backend="sdpa")
    dattn(q, k, v, [8], [2], backend="manual")
    info = cache.info()
    assert info.misses == 1 and info.hits >= 1 and info.entries == len(cache) == 1
    assert info.max_entries >= 1
    if views_op.available("cpu"):  # sdpa's C++ driver plans the same geometry through it
        monkeypatch.setattr(SdpaBackend, "cpp_driver", True)
        dattn(q, k, v, [8], [2], backend="sdpa")
        assert cache.info().hits > info.hits
    dattn(q, k, v, [8, 16], [2, 4], backend="manual")  # another geometry: a miss
    assert cache.info().misses == 2 and len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.info().hits == 0 and cache.info().misses == 0
