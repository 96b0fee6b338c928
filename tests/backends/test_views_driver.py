"""The sdpa backend's C++ driver (dilated_attention::views_fwd / views_bwd): against the float64
reference on every geometry of the Python driver's tests, the number of operators one forward and
backward dispatch, opcheck, torch.compile in one graph, and its errors."""

from __future__ import annotations

import pytest
import torch
from common import assert_grad_and_vjp_agree, grads, make_inputs
from reference import reference_attention
from test_backends_views import GEOMETRIES, _check
from test_varlen import cu_of
from torch.utils._python_dispatch import TorchDispatchMode

from dilated_attention import dilated_attention as dattn
from dilated_attention import dilated_attention_varlen
from dilated_attention.backends import sdpa_kernels
from dilated_attention.backends.sdpa import SdpaBackend
from dilated_attention.op import views as _views_op

pytestmark = pytest.mark.skipif(not _views_op.available("cpu"), reason="the extension lacks the views driver")


class OpCounter(TorchDispatchMode):
    """Counts the ATen (and custom) operators dispatched, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _op(segs, rates, is_causal, scale=None):
    def run(q, k, v):
        s = q.shape[-1] ** -0.5 if scale is None else scale
        return _views_op.views_attention(q, k, v, segs, rates, is_causal, s)

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", GEOMETRIES)
def test_matches_the_reference(B, N, Hq, Hkv, D, segs, rates, is_causal, dtype):
    """out, lse and dq, dk, dv (the lse gradient included) within SPEC section 4's rule."""
    _check(_op(segs, rates, is_causal), B, N, Hq, Hkv, D, segs, rates, is_causal, dtype)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", GEOMETRIES)
def test_python_driver_still_matches(monkeypatch, B, N, Hq, Hkv, D, segs, rates, is_causal):
    """backend='sdpa' with the C++ driver switched off: the Python driver, as dropout, packed
    sequences and torch.func run it."""
    monkeypatch.setattr(SdpaBackend, "cpp_driver", False)

    def run(q, k, v):
        return dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend="sdpa")

    _check(run, B, N, Hq, Hkv, D, segs, rates, is_causal, torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not _views_op.available("cuda"), reason="needs a CUDA GPU and CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", GEOMETRIES)
def test_cuda_matches_the_reference(B, N, Hq, Hkv, D, segs, rates, is_causal, dtype):
    """cuDNN (sm_90+) or flash attention under the C++ driver, every gradient, SPEC section 4."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs an sm_80+ GPU")
    q, k, v = make_inputs(B, N, Hq, Hkv, D * 8, dtype, device="cuda")
    assert sdpa_kernels.cpp_driver_runs(q, k, v, 0.0)
    _check(_op(segs, rates, is_causal), B, N, Hq, Hkv, D * 8, segs, rates, is_causal, dtype, q, k, v)


_LAYOUT_DEVICES = [("cpu", torch.float32), ("cpu", torch.bfloat16)] + (
    [
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),
        pytest.param("cuda", torch.float32, marks=pytest.mark.cuda),  # the efficient kernel
    ]
    if _views_op.available("cuda")
    else []
)


@pytest.mark.parametrize("device,dtype", _LAYOUT_DEVICES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_views_of_a_fused_projection(device, dtype, is_causal):
    """q, k, v as the example GPT makes them, views of one fused projection (qkv.split(...).view):
    the driver reads them in place (their rows 3 E apart, batch and sequence still folding) and
    matches the reference as contiguous inputs do, forward and every gradient."""
    B, N, Hq, Hkv, D, segs, rates = 2, 40, 4, 2, 16, [8, 16, 40], [1, 2, 4]
    torch.manual_seed(3)
    qkv = torch.randn(B, N, (Hq + 2 * Hkv) * D, dtype=torch.float64)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (qkv,)]
    q, k, v = ref_leaves[0].split([Hq * D, Hkv * D, Hkv * D], dim=2)
    q, k, v = q.view(B, N, Hq, D), k.view(B, N, Hkv, D), v.view(B, N, Hkv, D)
    out64, _ = reference_attention(q, k, v, segs, rates, is_causal)
    dout = torch.randn(B, N, Hq, D, dtype=torch.float64)
    (g64,) = torch.autograd.grad((out64 * dout).sum(), ref_leaves)
    fused = qkv.to(device=device, dtype=dtype).requires_grad_()
    q, k, v = fused.split([Hq * D, Hkv * D, Hkv * D], dim=2)
    q, k, v = q.view(B, N, Hq, D), k.view(B, N, Hkv, D), v.view(B, N, Hkv, D)
    assert not q.is_contiguous() and q.stride(1) == (Hq + 2 * Hkv) * D
    out, _ = _op(segs, rates, is_causal)(q, k, v)
    (g,) = torch.autograd.grad((out.double() * dout.to(device)).sum(), fused)
    # the same values given contiguous
    leaves = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    out_c, _ = _op(segs, rates, is_causal)(*leaves)
    gc = torch.autograd.grad((out_c.double() * dout.to(device)).sum(), leaves)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.double().cpu(), out64, **tol)
    torch.testing.assert_close(g.double().cpu(), g64, **tol)
    torch.testing.assert_close(out, out_c, **tol)
    torch.testing.assert_close(g, torch.cat(gc, dim=2).flatten(2), **tol)


@pytest.mark.parametrize("device,dtype", _LAYOUT_DEVICES)
def test_inputs_whose_batch_does_not_fold_are_copied(device, dtype):
    """The first N positions of longer sequences (x[:, :N]): batch entries are not N rows apart,
    so the folded views of the segments would read the wrong rows; the driver copies such inputs
    (and matches the reference)."""
    B, N, H, D, segs, rates = 2, 24, 2, 16, [8, 24], [1, 2]
    torch.manual_seed(4)
    longer = torch.randn(B, 2 * N, H, D, dtype=torch.float64)
    out64, _ = reference_attention(*(longer[:, :N],) * 3, segs, rates, True)
    xs = longer.to(device=device, dtype=dtype)[:, :N]  # sliced after the conversion: still strided
    assert xs.stride(0) != N * xs.stride(1)
    out, _ = _op(segs, rates, True)(xs, xs, xs)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(out.double().cpu(), out64, **tol)


@pytest.mark.parametrize("scale", [-0.4, 0.0])
def test_non_positive_scale(scale):
    B, N, Hq, Hkv, D, segs, rates = 2, 37, 4, 2, 8, [8, 16], [1, 2]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, torch.float64)
    out, lse = _op(segs, rates, True, scale)(q, k, v)
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_attention(q64, k64, v64, segs, rates, True, softmax_scale=scale)
    torch.testing.assert_close(out, out64, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse64, rtol=0, atol=1e-12)
    dout = torch.randn(out.shape, dtype=torch.float64)
    dlse = torch.randn(lse.shape, dtype=torch.float64)
    for a, e in zip(
        grads(out, lse, (q, k, v), dout, dlse), grads(out64, lse64, (q64, k64, v64), dout, dlse), strict=True
    ):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-11)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_backend_runs_it(is_causal):
    """backend='sdpa' goes through the C++ driver (one op each way) and agrees with the Python one."""
    segs, rates = [8, 16], [1, 2]
    q, k, v = make_inputs(2, 37, 4, 2, 8, torch.float32)
    with OpCounter() as c:
        out, lse = dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend="sdpa")
    assert "dilated_attention.views_fwd" in c.names
    try:
        SdpaBackend.cpp_driver = False
        ref, ref_lse = dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend="sdpa")
    finally:
        SdpaBackend.cpp_driver = True
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def _count(N: int, device: str, dtype: torch.dtype) -> list[str]:
    """The operators one forward and backward of backend='sdpa' dispatch (B=1, H=12, D=64, the
    LongNet branches [256, 512, 1024, 2048] x [1, 2, 4, 8]), causal."""
    q, k, v = make_inputs(1, N, 12, 12, 64, dtype, device=device)
    dout = torch.randn(q.shape, dtype=dtype, device=device)
    with OpCounter() as c:
        out = dattn(q, k, v, [256, 512, 1024, 2048], [1, 2, 4, 8], is_causal=True, backend="sdpa")
        torch.autograd.backward(out, dout)
    return c.names


_DEVICES = [
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param(
        "cuda",
        torch.bfloat16,
        id="cuda-bfloat16",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not _views_op.available("cuda"), reason="needs a CUDA GPU and CUDA kernels"),
        ],
    ),
]


@pytest.mark.parametrize("device,dtype", _DEVICES)
def test_dispatch_count(device, dtype):
    """At most 10 operators for a forward and backward through the C++ driver (the Python driver's
    count printed beside it)."""
    # float32 on the CPU runs in float64 for the accuracy rule: the driver's own operators in float32
    SdpaBackend.cpu_float32_in_float64 = False
    try:
        names = _count(2048, device, dtype)
        SdpaBackend.cpp_driver = False
        python_names = _count(2048, device, dtype)
    finally:
        SdpaBackend.cpp_driver = True
        SdpaBackend.cpu_float32_in_float64 = True
    print(
        f"\nops dispatched, forward + backward, N=2048, {device} {dtype}: C++ driver {len(names)} "
        f"{names}; Python driver {len(python_names)}"
    )
    assert names.count("dilated_attention.views_fwd") == 1
    assert names.count("dilated_attention.views_bwd") == 1
    assert len(names) <= 10, names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    q, k, v = make_inputs(2, 19, 4, 2, 8, dtype)
    args = (q, k, v, [4, 8], [1, 2], True, 0.35)
    torch.library.opcheck(torch.ops.dilated_attention.views_fwd.default, args)
    out, lse = torch.ops.dilated_attention.views_fwd(*args)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    bargs = (
        dout,
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse.detach(),
        dlse,
        [4, 8],
        [1, 2],
        True,
        0.35,
    )
    torch.library.opcheck(torch.ops.dilated_attention.views_bwd.default, bargs)


def test_compiled_in_one_graph():
    """torch.compile(fullgraph=True): one views_fwd node in Dynamo's graph, out, lse and the
    gradients as eager."""
    torch._dynamo.reset()
    segs, rates = [8, 16], [1, 2]
    targets = []

    def recording(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def f(q, k, v):
        return dattn(q, k, v, segs, rates, is_causal=True, return_lse=True, backend="sdpa")

    q, k, v = make_inputs(2, 37, 4, 2, 8, torch.float32)
    out, lse = torch.compile(f, backend=recording, fullgraph=True)(q, k, v)
    assert sum("views_fwd" in t for t in targets) == 1, targets
    got = torch.autograd.grad((out.square().sum() + lse.sum()), (q, k, v))
    out_e, lse_e = f(q, k, v)
    ref = torch.autograd.grad((out_e.square().sum() + lse_e.sum()), (q, k, v))
    torch.testing.assert_close(out, out_e, rtol=0, atol=0)
    for a, e in zip(got, ref, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    out2, _ = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(out2, out_e, rtol=0, atol=0)
    torch._dynamo.reset()


def test_errors_name_the_bad_values():
    q, k, v = make_inputs(1, 16, 4, 2, 8, torch.float32, requires_grad=False)
    with pytest.raises(RuntimeError, match="segment_lengths and dilation_rates must have the same length"):
        torch.ops.dilated_attention.views_fwd(q, k, v, [4, 8], [1], False, 0.3)
    with pytest.raises(
        RuntimeError, match=r"dilation_rates\[0\] = 8 must not exceed segment_lengths\[0\] = 4"
    ):
        torch.ops.dilated_attention.views_fwd(q, k, v, [4], [8], False, 0.3)
    with pytest.raises(RuntimeError, match="multiple of the number of key/value heads"):
        torch.ops.dilated_attention.views_fwd(q[:, :, :3], k, v, [4], [1], False, 0.3)


def test_backward_ops_record_no_history_of_their_own_work():
    """views_bwd and views_varlen_bwd (ops without an autograd formula) called on tensors that
    require grad, with grouped-query heads run on repeated k and v (12 query and 4 key/value heads,
    r = 2): their results carry only PyTorch's not-implemented node, none of the op's inner adds,
    and are the float64 reference's gradients."""
    q, k, v = make_inputs(1, 32, 12, 4, 8, torch.float64)
    segs, rates = [8, 16], [1, 2]
    out, lse = torch.ops.dilated_attention.views_fwd(q, k, v, segs, rates, True, 0.3)
    dout = torch.randn_like(out)
    got = torch.ops.dilated_attention.views_bwd(
        dout, q, k, v, out.detach(), lse.detach(), None, segs, rates, True, 0.3
    )
    ref, _ = reference_attention(q, k, v, segs, rates, True, 0.3)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w in zip(got, want, strict=True):
        assert g.grad_fn is None or "NotImplemented" in g.grad_fn.name(), g.grad_fn.name()
        torch.testing.assert_close(g.detach(), w, rtol=1e-10, atol=1e-10)
    cu = torch.tensor([0, 32], dtype=torch.int32)
    packed = torch.ops.dilated_attention.views_varlen_bwd(
        dout[0], q[0], k[0], v[0], out[0].detach(), lse[0].detach(), None, cu, 32, segs, rates, True, 0.3
    )
    for g, w in zip(packed, want, strict=True):
        assert g.grad_fn is None or "NotImplemented" in g.grad_fn.name(), g.grad_fn.name()
        torch.testing.assert_close(g.detach(), w[0], rtol=1e-10, atol=1e-10)


def test_nonfinite_rows_as_the_python_driver():
    """A NaN in q and an inf in v reach the same rows through both drivers (causal)."""
    q, k, v = make_inputs(1, 24, 4, 2, 8, torch.float32, requires_grad=False)
    q[0, 5, 1, 3] = float("nan")
    v[0, 13, 0, 0] = float("inf")
    out, lse = dattn(q, k, v, [8, 16], [1, 2], is_causal=True, return_lse=True, backend="sdpa")
    try:
        SdpaBackend.cpp_driver = False
        ref, ref_lse = dattn(q, k, v, [8, 16], [1, 2], is_causal=True, return_lse=True, backend="sdpa")
    finally:
        SdpaBackend.cpp_driver = True
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_packed_nonfinite_rows_as_the_python_driver(monkeypatch):
    """Packed sequences of two lengths (two runs of the C++ op), a NaN in the first sequence's q
    and an inf in the last one's v: the packed op checks its whole inputs once and every run
    applies the corrections, as the Python driver's rows show (causal)."""
    lengths = [10, 10, 7]
    cu, cu_list = cu_of(lengths)
    T = cu_list[-1]
    torch.manual_seed(6)
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    q[3, 1, 2] = float("nan")
    v[T - 2, 0, 0] = float("inf")

    def run():
        return dilated_attention_varlen(
            q, k, v, cu, max(lengths), [4, 8], [1, 2], is_causal=True, return_lse=True, backend="sdpa"
        )

    out, lse = run()
    monkeypatch.setattr(SdpaBackend, "cpp_driver", False)
    ref, ref_lse = run()
    assert out.isnan().any() and not out[:3].isnan().any()  # the rows before the NaN stay finite
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_large_logits_gqa_bfloat16_within_the_rule():
    B, N, Hq, Hkv, D, segs, rates = 2, 256, 4, 2, 32, [128, 256], [1, 2]
    q, k, v = make_inputs(B, N, Hq, Hkv, D, torch.float64, seed=3, requires_grad=False)
    q = (q * 12).to(torch.bfloat16).requires_grad_()
    k, v = k.to(torch.bfloat16).requires_grad_(), v.to(torch.bfloat16).requires_grad_()
    _check(_op(segs, rates, True), B, N, Hq, Hkv, D, segs, rates, True, torch.bfloat16, q, k, v)


# torch.func: the C++ driver under grad, vjp, jacrev and vmap
# ----------------------------------------------------------------------------------------------


def _counting(monkeypatch, name: str = "views_attention") -> list[int]:
    """Counts the sdpa backend's calls of the C++ driver's ``name`` (views_attention, or
    views_varlen_attention for packed sequences)."""
    calls = [0]
    real = getattr(_views_op, name)

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(_views_op, name, counted)
    return calls


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_torch_func_runs_the_cpp_driver(monkeypatch, is_causal):
    """grad, vjp, jacrev, vmap (over any input) and vmap of grad through backend='sdpa' take the C++
    driver (its vmap rules fold the vmapped dimension into the batch) and match the float64
    reference under the same transform."""
    from torch.func import grad, jacrev, vmap

    calls = _counting(monkeypatch)
    segs, rates = [4, 8], [1, 2]
    q, k, v = make_inputs(2, 13, 4, 2, 8, torch.float64, requires_grad=False)

    def f(q, k, v):
        out, lse = dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend="sdpa")
        return out.sin().sum() + lse.cos().sum()

    def ref(q, k, v):
        out, lse = reference_attention(q, k, v, segs, rates, is_causal)
        return out.sin().sum() + lse.cos().sum()

    assert_grad_and_vjp_agree(f, ref, q, k, v)
    x0 = q[:1, :8].clone()  # jacrev: a vmap over the vjps of one small call
    k0, v0 = k[:1, :8], v[:1, :8]
    torch.testing.assert_close(
        jacrev(lambda x: dattn(x, k0, v0, segs, rates, is_causal=is_causal, backend="sdpa"))(x0),
        jacrev(lambda x: reference_attention(x, k0, v0, segs, rates, is_causal)[0])(x0),
    )
    ks = torch.randn(3, *k.shape, dtype=torch.float64)
    out = vmap(lambda kk: dattn(q, kk, v, segs, rates, is_causal=is_causal, backend="sdpa"))(ks)
    torch.testing.assert_close(
        out, torch.stack([reference_attention(q, x, v, segs, rates, is_causal)[0] for x in ks])
    )
    qs = torch.randn(3, *q.shape, dtype=torch.float64)
    torch.testing.assert_close(
        vmap(grad(f), in_dims=(0, None, None))(qs, k, v), torch.stack([grad(ref)(x, k, v) for x in qs])
    )
    assert calls[0] >= 5


def test_forward_mode_is_refused_by_name():
    """torch.func.jvp and torch.autograd.forward_ad through the C++ driver raise an error that
    names the backend (no silent zero tangent)."""
    q, k, v = make_inputs(1, 16, 2, 2, 4, torch.float64, requires_grad=False)

    def f(q):
        return dattn(q, k, v, [4, 8], [1, 2], backend="sdpa")

    with pytest.raises(RuntimeError, match="'sdpa' backend has no forward-mode gradients"):
        torch.func.jvp(f, (q,), (torch.ones_like(q),))
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), pytest.raises(RuntimeError, match="'sdpa' backend has no forward-mode gradients"):
        f(fwAD.make_dual(q, torch.ones_like(q)))


# Packed sequences: views_varlen_fwd / views_varlen_bwd
# ----------------------------------------------------------------------------------------------

# (lengths, Hq, Hkv, D, segment_lengths, dilation_rates): empty sequences and one of one row,
# lengths that end inside a segment, grouped-query heads, a dilation rate above the head count.
PACKINGS = [
    pytest.param([5, 0, 1, 37, 20], 4, 2, 8, [8, 16], [1, 2], id="gqa-empty-one-row"),
    pytest.param([29, 13], 2, 2, 16, [4, 8, 32], [1, 2, 4], id="three-branches"),
    pytest.param([17, 0, 23], 3, 1, 8, [8, 16], [1, 5], id="mqa-r-above-heads"),
    # runs of equal lengths (one batched call each), an empty sequence inside a run
    pytest.param([9, 9, 0, 9, 4, 4, 11], 2, 1, 8, [4, 8], [1, 2], id="equal-length-runs"),
    # key/value heads 0, 0, 1, 2, 2, 3 along a phase: branches on k and v repeated to Hq heads
    pytest.param([24, 0, 40, 40, 7], 12, 4, 8, [8, 16, 40], [1, 2, 4], id="irregular-gqa"),
]


_CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _views_op.available("cuda"), reason="needs a CUDA GPU and CUDA kernels"),
]
VARLEN_DEVICES = [
    pytest.param("cpu", torch.float32, id="cpu-float32"),
    pytest.param("cpu", torch.float64, id="cpu-float64"),
    pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
    pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=_CUDA),
    pytest.param("cuda", torch.float16, id="cuda-float16", marks=_CUDA),
    pytest.param("cuda", torch.float32, id="cuda-float32", marks=_CUDA),  # the efficient kernel
]


@pytest.mark.parametrize("device,dtype", VARLEN_DEVICES)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths,Hq,Hkv,D,segs,rates", PACKINGS)
def test_varlen_matches_the_reference(
    monkeypatch, lengths, Hq, Hkv, D, segs, rates, is_causal, device, dtype
):
    """dilated_attention_varlen(backend='sdpa') runs views_varlen_fwd/bwd (one call each way) and
    its out, lse and dq, dk, dv (the lse gradient included) are within SPEC section 4's rule of the
    per-sequence float64 reference (on CUDA: cuDNN or flash attention, the efficient kernel for
    float32; head dims times 8)."""
    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0)):
        pytest.skip("needs an sm_80+ GPU")
    if device == "cuda":
        D *= 8
    from reference import reference_varlen
    from tolerance import assert_within_rule

    from dilated_attention import dilated_attention_varlen

    calls = _counting(monkeypatch, "views_varlen_attention")
    cu, cu_list = cu_of(lengths)
    T = cu_list[-1]
    q, k, v = (t[0] for t in make_inputs(1, T, Hq, Hkv, D, dtype, requires_grad=False, device=device))
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    out, lse = dilated_attention_varlen(
        *leaves,
        cu.to(device),
        max(lengths),
        segs,
        rates,
        is_causal=is_causal,
        return_lse=True,
        backend="sdpa",
    )
    assert calls[0] == 1
    out, lse = out.cpu(), lse.cpu()
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_varlen(q64, k64, v64, cu_list, segs, rates, is_causal)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_varlen(ql, kl, vl, cu_list, segs, rates, is_causal, dtype=dtype)
    assert_within_rule("out", out, out64, outl, dtype)
    assert_within_rule("lse", lse, lse64, lsel, dtype)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    got = [t.cpu() for t in grads(out, lse, leaves, dout, dlse)]
    ref = grads(out64, lse64, (q64, k64, v64), dout, dlse)
    plain = grads(outl, lsel, (ql, kl, vl), dout, dlse)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(name, a, e, p, dtype)


def test_varlen_opcheck_and_errors():
    """opcheck of both packed ops (fake kernels, autograd, schema), and the errors of a bad
    cu_seqlens, named as the native packed op names them."""
    cu, cu_list = cu_of([5, 0, 9])
    q, k, v = (t[0] for t in make_inputs(1, cu_list[-1], 4, 2, 8, torch.float64))
    args = (q, k, v, cu, 9, [4, 8], [1, 2], True, 0.35)
    torch.library.opcheck(torch.ops.dilated_attention.views_varlen_fwd.default, args)
    out, lse = (t.detach() for t in torch.ops.dilated_attention.views_varlen_fwd(*args))
    dout = torch.randn_like(out)
    rows = (q.detach(), k.detach(), v.detach(), out, lse)
    torch.library.opcheck(
        torch.ops.dilated_attention.views_varlen_bwd.default,
        (dout, *rows, torch.randn_like(lse), cu, 9, [4, 8], [1, 2], True, 0.35),
    )
    bad = torch.tensor([0, 9, 5, 14], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"non-decreasing, got cu_seqlens\[1\] = 9 > cu_seqlens\[2\] = 5"):
        torch.ops.dilated_attention.views_varlen_fwd(q, k, v, bad, 9, [4, 8], [1, 2], True, 0.35)
    with pytest.raises(RuntimeError, match="sequence 2 has length 9 > max_seqlen = 5"):
        torch.ops.dilated_attention.views_varlen_fwd(q, k, v, cu, 5, [4, 8], [1, 2], True, 0.35)


def test_varlen_vmap_and_compile():
    """vmap over q of the packed sdpa call (the packings laid one after the other, one call)
    equals a loop; torch.compile(fullgraph=True) keeps the op as one node each way."""
    from dilated_attention import dilated_attention_varlen

    cu, cu_list = cu_of([7, 12])
    q, k, v = (t[0] for t in make_inputs(1, cu_list[-1], 2, 1, 8, torch.float64, requires_grad=False))

    def f(q):
        return dilated_attention_varlen(q, k, v, cu, 12, [4, 8], [1, 2], is_causal=True, backend="sdpa")

    qs = torch.randn(3, *q.shape, dtype=torch.float64)
    torch.testing.assert_close(torch.func.vmap(f)(qs), torch.stack([f(x) for x in qs]))
    leaf = q.clone().requires_grad_()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(leaf)
    torch.testing.assert_close(out, f(q))
    (g,) = torch.autograd.grad(out.sum(), leaf)
    q2 = q.clone().requires_grad_()
    (g_eager,) = torch.autograd.grad(f(q2).sum(), q2)
    torch.testing.assert_close(g, g_eager)


def test_varlen_under_torch_func(monkeypatch):
    """grad, jacrev and vmap (over v alone) of the packed sdpa call through the C++ driver match the
    per-sequence float64 reference under the same transform."""
    from reference import reference_varlen
    from torch.func import grad, jacrev, vmap

    from dilated_attention import dilated_attention_varlen

    calls = _counting(monkeypatch, "views_varlen_attention")
    cu, cu_list = cu_of([5, 0, 7])
    q, k, v = (t[0] for t in make_inputs(1, 12, 2, 1, 4, torch.float64, requires_grad=False))

    def f(q, k, v):
        return dilated_attention_varlen(q, k, v, cu, 7, [4], [1], is_causal=True, backend="sdpa").sin().sum()

    def ref(q, k, v):
        return reference_varlen(q, k, v, cu_list, [4], [1], True)[0].sin().sum()

    for a, e in zip(grad(f, argnums=(0, 1, 2))(q, k, v), grad(ref, argnums=(0, 1, 2))(q, k, v), strict=True):
        torch.testing.assert_close(a, e)
    torch.testing.assert_close(
        jacrev(lambda x: dilated_attention_varlen(x, k, v, cu, 7, [4], [1], backend="sdpa"))(q),
        jacrev(lambda x: reference_varlen(x, k, v, cu_list, [4], [1], False)[0])(q),
    )
    vs = torch.randn(3, *v.shape, dtype=torch.float64)
    torch.testing.assert_close(
        vmap(lambda x: dilated_attention_varlen(q, k, x, cu, 7, [4], [1], backend="sdpa"))(vs),
        torch.stack([reference_varlen(q, k, x, cu_list, [4], [1], False)[0] for x in vs]),
    )
    assert calls[0] == 3
