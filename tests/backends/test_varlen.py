"""Packed sequences and padding masks (SPEC section 7) against a float64 reference that runs each
sequence alone: the native varlen op, every backend, the functional API, the modules'
``key_padding_mask``, and bad input."""

from __future__ import annotations

import sys

import pytest
import torch
from common import grads, make_inputs
from reference import reference_attention, reference_varlen
from test_backends_adapters import FakeFlashAttn, FakeFlashAttn3, FakeXformers
from tolerance import assert_within_rule

from dilated_attention import (
    DilatedAttention,
    MultiheadDilatedAttention,
    backends,
    dilated_attention,
    dilated_attention_varlen,
)
from dilated_attention.backends import get_backend
from dilated_attention.backends.base import Packed

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def fresh_selection():
    backends.default_selector().clear()
    yield
    backends.default_selector().clear()


def cu_of(lengths):
    """cu_seqlens (int32) of the given lengths, and the host list."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32), cu


# (lengths, Hq, Hkv, D, segment_lengths, dilation_rates): empty sequences, length 1, lengths that
# are no multiple of any w, one sequence longer than every w, grouped-query attention.
CONFIGS = [
    pytest.param([5, 0, 1, 37, 20], 4, 2, 8, [8, 16], [1, 2], id="empty-and-one-gqa"),
    pytest.param([70, 3, 0, 0, 11], 2, 1, 16, [4, 8, 16], [1, 2, 4], id="longer-than-every-w"),
    pytest.param([1, 1, 1], 2, 2, 4, [2], [1], id="all-length-1"),
    pytest.param([13, 29, 7], 6, 3, 8, [5, 10, 20, 40], [1, 2, 3, 4], id="four-branches-ragged"),
    pytest.param([0], 2, 1, 8, [4], [2], id="only-empty"),
    pytest.param([16, 9], 2, 2, 8, [8], [4], id="uncovered-rows"),
]


def check_varlen(run, lengths, Hq, Hkv, D, segs, rates, is_causal, dtype, scale=None, with_dlse=True):
    """``run(q, k, v, cu_seqlens, max_seqlen) -> (out, lse)`` against the per-sequence float64
    reference, forward and backward, within the tolerance rule of SPEC section 4."""
    cu, cu_list = cu_of(lengths)
    T = cu_list[-1]
    q, k, v = (t[0] for t in make_inputs(1, T, Hq, Hkv, D, dtype, requires_grad=False))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = run(q, k, v, cu, max(lengths))
    assert out.dtype == dtype and out.shape == (T, Hq, D)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (Hq, T)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_varlen(q64, k64, v64, cu_list, segs, rates, is_causal, scale)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_varlen(ql, kl, vl, cu_list, segs, rates, is_causal, scale, dtype=dtype)
    assert_within_rule("out", out, out64, outl, dtype)
    assert_within_rule("lse", lse, lse64, lsel, dtype)
    if T == 0:
        return
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64) if with_dlse else None
    got = grads(out, lse, (q, k, v), dout, dlse)
    ref = grads(out64, lse64, (q64, k64, v64), dout, dlse)
    plain = grads(outl, lsel, (ql, kl, vl), dout, dlse)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert a.dtype == dtype
        assert_within_rule(name, a, e, p, dtype)


# ----------------------------------------------------------------------------------------------
# The native op and every backend, against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths,Hq,Hkv,D,segs,rates", CONFIGS)
def test_native_matches_reference(lengths, Hq, Hkv, D, segs, rates, is_causal, dtype):
    def run(q, k, v, cu, max_seqlen):
        return dilated_attention_varlen(
            q, k, v, cu, max_seqlen, segs, rates, is_causal=is_causal, return_lse=True, backend="native"
        )

    check_varlen(run, lengths, Hq, Hkv, D, segs, rates, is_causal, dtype, with_dlse=dtype != torch.float16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths,Hq,Hkv,D,segs,rates", CONFIGS[:4])
@pytest.mark.parametrize("backend", ["sdpa", "manual"])
def test_gathered_backends_match_reference(backend, lengths, Hq, Hkv, D, segs, rates, is_causal, dtype):
    def run(q, k, v, cu, max_seqlen):
        return dilated_attention_varlen(
            q, k, v, cu, max_seqlen, segs, rates, is_causal=is_causal, return_lse=True, backend=backend
        )

    check_varlen(run, lengths, Hq, Hkv, D, segs, rates, is_causal, dtype)


@pytest.fixture
def doubles(monkeypatch):
    """The flash_attn, flash_attn_interface and xformers test doubles of test_backends."""
    flash, flash3, xf = FakeFlashAttn(lse_pad=5), FakeFlashAttn3(), FakeXformers()
    monkeypatch.setitem(sys.modules, "flash_attn", flash.module)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", flash3.module)
    monkeypatch.setitem(sys.modules, "xformers", xf.pkg)
    monkeypatch.setitem(sys.modules, "xformers.ops", xf.ops)
    monkeypatch.setitem(sys.modules, "xformers.ops.fmha", xf.fmha)
    return {"flash_attn_2": flash, "flash_attn_3": flash3, "xformers": xf}


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["flash_attn_2", "flash_attn_3", "xformers"])
def test_adapters_with_doubles_match_reference(doubles, name, is_causal):
    lengths, Hq, Hkv, D, segs, rates = [5, 0, 1, 37, 20], 4, 2, 8, [8, 16], [1, 2]
    impl = get_backend(name)

    def run(q, k, v, cu, max_seqlen):
        return impl.forward_varlen(
            q, k, v, Packed(cu, max_seqlen, lengths), segs, rates, is_causal=is_causal, softmax_scale=D**-0.5
        )

    check_varlen(run, lengths, Hq, Hkv, D, segs, rates, is_causal, torch.float64)
    assert doubles[name].calls


def test_fixed_length_batch_is_the_packed_special_case():
    """B sequences of N rows packed: the same result as the (B, N) op (within float32 rounding: the
    two shapes may be split over threads differently)."""
    B, N, Hq, Hkv, D, segs, rates = 3, 45, 4, 2, 16, [8, 32], [1, 4]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, torch.float32, requires_grad=False)
    cu, _ = cu_of([N] * B)
    out, lse = dilated_attention(q, k, v, segs, rates, is_causal=True, return_lse=True, backend="native")
    flat = (t.reshape(B * N, *t.shape[2:]) for t in (q, k, v))
    out_p, lse_p = dilated_attention_varlen(
        *flat, cu, N, segs, rates, is_causal=True, return_lse=True, backend="native"
    )
    torch.testing.assert_close(out_p, out.reshape(B * N, Hq, D), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse_p, lse.permute(1, 0, 2).reshape(Hq, B * N), rtol=1e-5, atol=1e-6)


def test_sequences_do_not_see_each_other():
    """Changing one sequence's keys changes no other sequence's output."""
    cu, _ = cu_of([10, 17, 6])
    q, k, v = (t[0] for t in make_inputs(1, 33, 2, 2, 8, torch.float64, requires_grad=False))
    a = dilated_attention_varlen(q, k, v, cu, 17, [64], [1])
    k2 = k.clone()
    k2[10:27] += 5
    b = dilated_attention_varlen(q, k2, v, cu, 17, [64], [1])
    torch.testing.assert_close(a[:10], b[:10], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a[27:], b[27:], rtol=1e-12, atol=1e-12)
    assert not torch.equal(a[10:27], b[10:27])


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck(is_causal):
    cu, _ = cu_of([4, 0, 7, 1])
    q, k, v = (t[0].detach().requires_grad_() for t in make_inputs(1, 12, 4, 2, 3, torch.float64, seed=5))

    def f(q, k, v):
        return dilated_attention_varlen(q, k, v, cu, 7, [2, 4], [1, 2], is_causal=is_causal, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_opcheck(dtype):
    cu, _ = cu_of([3, 0, 9, 7])
    q, k, v = (t[0].detach().requires_grad_() for t in make_inputs(1, 19, 4, 2, 8, dtype))
    args = (q, k, v, cu, 9, [4, 8], [1, 2], True, 0.35)
    torch.library.opcheck(torch.ops.dilated_attention.varlen_fwd.default, args)
    out, lse = torch.ops.dilated_attention.varlen_fwd(*args)
    bargs = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach())
    bargs += (torch.randn_like(lse), cu, 9, [4, 8], [1, 2], True, 0.35)
    torch.library.opcheck(torch.ops.dilated_attention.varlen_bwd.default, bargs)


def test_torch_compile_fullgraph_forward_and_backward():
    cu, cu_list = cu_of([11, 5, 17])
    q, k, v = (t[0].detach().requires_grad_() for t in make_inputs(1, 33, 4, 2, 8, torch.float32))

    def f(q, k, v, cu):
        out = dilated_attention_varlen(q, k, v, cu, 17, [8, 16], [1, 2], is_causal=True, backend="native")
        return out.square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, cu)
    got = torch.autograd.grad(loss, (q, k, v))
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, _ = reference_varlen(q2, k2, v2, cu_list, [8, 16], [1, 2], True)
    loss64 = out64.square().sum()
    want = torch.autograd.grad(loss64, (q2, k2, v2))
    torch.testing.assert_close(loss.double(), loss64, rtol=1e-5, atol=1e-5)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4)


def test_varlen_patterns_are_cached(monkeypatch):
    """The Python driver (which runs dropout, and every packed call with the C++ driver off) plans
    a packing once."""
    from dilated_attention import get_pattern_cache
    from dilated_attention.backends.sdpa import SdpaBackend

    monkeypatch.setattr(SdpaBackend, "cpp_driver", False)
    cu, _ = cu_of([9, 30, 4])
    q = torch.randn(43, 2, 8)
    dilated_attention_varlen(q, q, q, cu, 30, [8], [2], backend="sdpa")
    before = get_pattern_cache().info()
    dilated_attention_varlen(q, q, q, cu, 30, [8], [2], backend="sdpa")
    after = get_pattern_cache().info()
    assert after.hits > before.hits and after.misses == before.misses


def test_empty_batch():
    q = torch.randn(0, 2, 4, requires_grad=True)
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse = dilated_attention_varlen(q, q, q, cu, 0, [4], [1], return_lse=True)
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)
    out.sum().backward()
    assert q.grad.shape == (0, 2, 4)


# ----------------------------------------------------------------------------------------------
# Padding masks in the modules
# ----------------------------------------------------------------------------------------------


def padded_mask(B, N, runs):
    """(B, N) bool mask whose row b is True on [start, end) = runs[b]."""
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b, (s, e) in enumerate(runs):
        mask[b, s:e] = True
    return mask


@pytest.mark.parametrize("backend", ["native", "sdpa", "manual"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_padding_mask_left_and_right(backend, is_causal):
    B, N, Hq, Hkv, D, segs, rates = 4, 21, 4, 2, 8, [4, 8], [1, 2]
    runs = [(0, 13), (6, 21), (0, 0), (0, 21)]  # right padded, left padded, all padding, none
    mask = padded_mask(B, N, runs)
    q, k, v = make_inputs(B, N, Hq, Hkv, D, torch.float64)
    attn = DilatedAttention(segs, rates, softmax_scale=0.4, attention_backend=backend)
    out = attn(q, k, v, is_causal=is_causal, key_padding_mask=mask.int())  # 0/1 works as bool
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    for b, (s, e) in enumerate(runs):
        assert (out[b, ~mask[b]] == 0).all()  # padded positions: output 0 ...
        for t in got:
            assert (t[b, ~mask[b]] == 0).all()  # ... and no gradient
        if e == s:
            continue
        sl = (slice(b, b + 1), slice(s, e))
        q1, k1, v1 = (t[sl].detach().requires_grad_() for t in (q, k, v))
        ref, _ = reference_attention(q1, k1, v1, segs, rates, is_causal, 0.4)  # the run alone, from 0
        torch.testing.assert_close(out[sl], ref, rtol=1e-10, atol=1e-10)
        want = torch.autograd.grad((ref * g[sl]).sum(), (q1, k1, v1))
        for a, w in zip(got, want, strict=True):
            torch.testing.assert_close(a[sl], w, rtol=1e-9, atol=1e-10)


def test_full_mask_is_the_unmasked_call():
    q, k, v = make_inputs(2, 17, 2, 2, 8, torch.float32, requires_grad=False)
    attn = DilatedAttention([4, 8], [1, 2])
    full = torch.ones(2, 17, dtype=torch.bool)
    assert torch.equal(attn(q, k, v, key_padding_mask=full), attn(q, k, v))


def test_multihead_padding_mask_matches_each_row_alone():
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(32, 4, [4, 8], [1, 2], dtype=torch.float64)
    x = torch.randn(2, 15, 32, dtype=torch.float64)
    mask = padded_mask(2, 15, [(0, 9), (4, 15)])
    y, none = mha(x, key_padding_mask=mask, is_causal=True)
    assert none is None
    for b, (s, e) in enumerate([(0, 9), (4, 15)]):
        alone, _ = mha(x[b : b + 1, s:e], is_causal=True)
        torch.testing.assert_close(y[b : b + 1, s:e], alone, rtol=1e-10, atol=1e-10)
    y1, _ = mha(x[1], key_padding_mask=mask[1], is_causal=True)  # unbatched, (N,) mask
    torch.testing.assert_close(y1, y[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "mask,match",
    [
        (
            padded_mask(2, 8, [(0, 8), (0, 3)]) ^ padded_mask(2, 8, [(0, 0), (1, 2)]),
            "row 1 is not one contiguous",
        ),
        (torch.ones(2, 7, dtype=torch.bool), r"shape \(B, N\) = \(2, 8\)"),
        (torch.full((2, 8), 2), "only 0 and 1"),
        (torch.tensor([[1] * 8, [1, 1, 1, 3, 0, 0, 0, 0]]), r"only 0 and 1 .*got 3 at \[1, 3\]"),
        ([[1] * 8] * 2, "must be a torch.Tensor"),
    ],
    ids=["gap", "shape", "values", "value-named", "not-a-tensor"],
)
def test_bad_padding_masks(mask, match):
    q = torch.randn(2, 8, 2, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        DilatedAttention([4], [1])(q, q, q, key_padding_mask=mask)


def test_padding_mask_with_hilbert_order_is_refused():
    attn = DilatedAttention([4], [1], ordering="hilbert", grid=(2, 4))
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="hilbert"):
        attn(q, q, q, key_padding_mask=torch.ones(1, 8, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def _packed(T=10, H=2, D=4):
    return torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, H, D)


BAD = [
    ("int64", lambda: torch.tensor([0, 4, 10]), 10, r"cu_seqlens must be int32, got (torch\.)?int64"),
    ("2-D", lambda: torch.tensor([[0, 10]], dtype=torch.int32), 10, "1-D"),
    ("device", lambda: torch.tensor([0, 10], dtype=torch.int32, device="meta"), 10, "q's device"),
    ("first", lambda: torch.tensor([1, 4, 10], dtype=torch.int32), 10, r"cu_seqlens\[0\] must be 0, got 1"),
    (
        "decreasing",
        lambda: torch.tensor([0, 6, 4, 10], dtype=torch.int32),
        10,
        r"non-decreasing, got cu_seqlens\[1\] = 6 > cu_seqlens\[2\] = 4",
    ),
    (
        "jump back",  # the first wrong value is a length above max_seqlen: the order is named first
        lambda: torch.tensor([0, 2, 1000, 6, 10], dtype=torch.int32),
        6,
        r"non-decreasing, got cu_seqlens\[2\] = 1000 > cu_seqlens\[3\] = 6",
    ),
    ("last", lambda: torch.tensor([0, 4, 9], dtype=torch.int32), 10, r"must equal T = 10.*got 9"),
    ("last before length", lambda: torch.tensor([0, 9], dtype=torch.int32), 5, r"must equal T = 10.*got 9"),
    (
        "max_seqlen",
        lambda: torch.tensor([0, 4, 10], dtype=torch.int32),
        5,
        "sequence 1 has length 6 > max_seqlen = 5",
    ),
    ("negative max", lambda: torch.tensor([0, 10], dtype=torch.int32), -1, "max_seqlen must be >= 0"),
    ("huge max", lambda: torch.tensor([0, 10], dtype=torch.int32), 2**40, r"below 2\^40 .* 1099511627776"),
    ("int64 max", lambda: torch.tensor([0, 10], dtype=torch.int32), 2**63, r"2\^40 .* 9223372036854775808"),
]


@pytest.mark.parametrize("name,make_cu,max_seqlen,match", BAD, ids=[b[0] for b in BAD])
def test_bad_cu_seqlens(name, make_cu, max_seqlen, match):
    q, k, v = _packed()
    cu = make_cu()
    for backend in ("native", "sdpa"):
        with pytest.raises(ValueError, match=match):
            dilated_attention_varlen(q, k, v, cu, max_seqlen, [4], [1], backend=backend)
    if name not in ("device", "huge max", "int64 max"):  # the op: a RuntimeError with the same words
        with pytest.raises(RuntimeError, match=match):
            torch.ops.dilated_attention.varlen_fwd(q, k, v, cu, max_seqlen, [4], [1], False, 0.5)


def test_bad_shapes():
    q, k, v = _packed()
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be 3-D"):
        dilated_attention_varlen(q[None], k, v, cu, 10, [4], [1])
    with pytest.raises(ValueError, match="agree in B, N and D"):
        dilated_attention_varlen(q, k[:5], v[:5], cu, 10, [4], [1])
    with pytest.raises(RuntimeError, match="q must be 3-D"):
        torch.ops.dilated_attention.varlen_fwd(q[None], k, v, cu, 10, [4], [1], False, 0.5)
    out, lse = torch.ops.dilated_attention.varlen_fwd(q, k, v, cu, 10, [4], [1], False, 0.5)
    with pytest.raises(RuntimeError, match=r"lse must have shape \(Hq, T\)"):
        torch.ops.dilated_attention.varlen_bwd(out, q, k, v, out, lse[:1], None, cu, 10, [4], [1], False, 0.5)


@pytest.mark.parametrize("backend", ["native", "sdpa", "manual"])
def test_which_backends_compile_without_reading_cu_seqlens(backend):
    """Under torch.compile(fullgraph=True) cu_seqlens has no values: the native op and sdpa's C++
    driver read it in their ops and compile; manual, which needs the lengths on the host, breaks
    the graph to read them, which fullgraph refuses with the reason; without fullgraph it runs and
    equals eager, forward and backward (it was a ValueError). On fake tensors outside
    torch.compile it is a ValueError naming the backends that read cu_seqlens themselves."""
    cu, cu_list = cu_of([6, 10])
    q = torch.randn(cu_list[-1], 2, 8)

    def f(q):
        return dilated_attention_varlen(q, q, q, cu, 10, [4, 8], [1, 2], is_causal=True, backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    if backend == "manual":
        with pytest.raises(Exception, match="reads the lengths of cu_seqlens on the host"):
            compiled(q)
        torch._dynamo.reset()
        leaf = q.clone().requires_grad_()
        got = torch.compile(f, backend="aot_eager")(leaf)
        torch.testing.assert_close(got, f(q), rtol=1e-5, atol=1e-5)
        want = torch.autograd.grad(f(leaf).sum(), leaf)[0]
        torch.testing.assert_close(torch.autograd.grad(got.sum(), leaf)[0], want, rtol=1e-5, atol=1e-5)
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fq, fcu = mode.from_tensor(q), mode.from_tensor(cu)
            with pytest.raises(ValueError, match="'manual' backend reads the sequence lengths of cu_seqlens"):
                dilated_attention_varlen(fq, fq, fq, fcu, 10, [4, 8], [1, 2], backend="manual")
        return
    torch.testing.assert_close(compiled(q), f(q), rtol=1e-5, atol=1e-5)
