"""The native op under torch.func transforms and torch.export (PyTorch's conventions: results
equal to the same computation without the transform; what has no formula refuses by name)."""

from __future__ import annotations

import pytest
import torch
from common import make_inputs, one_thread  # noqa: F401
from reference import reference_attention, reference_varlen

from dilated_attention import dilated_attention as dattn
from dilated_attention import dilated_attention_varlen as dattn_varlen

SEGS, RATES = [4, 8], [1, 2]


def _native(q, k, v, causal=True):
    return dattn(q, k, v, SEGS, RATES, is_causal=causal, backend="native")


def _reference(q, k, v, causal=True):
    return reference_attention(q, k, v, SEGS, RATES, causal)[0]


def _inputs(dtype=torch.float64, B=1, N=11, Hq=4, Hkv=2, D=3):
    return make_inputs(B, N, Hq, Hkv, D, dtype, seed=3, requires_grad=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_func_grad_matches_reference(dtype):
    q, k, v = _inputs(dtype)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v).double() * w).sum()

    got = torch.func.grad(loss(_native), argnums=(0, 1, 2))(q, k, v)
    ref = torch.func.grad(loss(_reference), argnums=(0, 1, 2))(*(t.double() for t in (q, k, v)))
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for a, e in zip(got, ref, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), e, rtol=tol, atol=tol)


def test_func_vjp_matches_reference():
    q, k, v = _inputs()
    out, pull = torch.func.vjp(_native, q, k, v)
    out64, pull64 = torch.func.vjp(_reference, q, k, v)
    torch.testing.assert_close(out, out64, rtol=1e-10, atol=1e-10)
    ct = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for a, e in zip(pull(ct), pull64(ct), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_func_jacrev_matches_reference():
    q, k, v = _inputs(N=6, Hq=2, Hkv=1, D=2)
    got = torch.func.jacrev(_native, argnums=(0, 1, 2))(q, k, v)
    ref = torch.func.jacrev(_reference, argnums=(0, 1, 2))(q, k, v)
    for a, e in zip(got, ref, strict=True):
        assert a.shape == q.shape + e.shape[q.dim() :]
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (1, None, 0), (None, 2, None)])
def test_func_vmap_matches_a_loop(in_dims):
    """The vmapped dimension (at any position, or on some inputs only) equals a loop over it."""
    V, B, N, Hq, Hkv, D = 3, 2, 9, 4, 2, 4
    g = torch.Generator().manual_seed(4)
    base = {"q": (B, N, Hq, D), "k": (B, N, Hkv, D), "v": (B, N, Hkv, D)}
    args = []
    for (_, shape), d in zip(base.items(), in_dims, strict=True):
        shape = list(shape)
        if d is not None:
            shape.insert(d, V)
        args.append(torch.randn(shape, generator=g, dtype=torch.float64))
    got = torch.func.vmap(_native, in_dims=in_dims)(*args)
    for i in range(V):
        one = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)]
        torch.testing.assert_close(got[i], _reference(*one), rtol=1e-10, atol=1e-10)


def test_func_vmap_of_grad_matches_a_loop():
    """Per-example gradients (vmap over grad), as torch.func's tutorials compute them."""
    V = 3
    q, k, v = (torch.stack([t] * V) for t in _inputs())
    q = q + torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def loss(q, k, v):
        return _native(q, k, v).square().sum()

    got = torch.func.vmap(torch.func.grad(loss))(q, k, v)
    for i in range(V):
        qi = q[i].clone().requires_grad_()
        (ref,) = torch.autograd.grad(_reference(qi, k[i], v[i]).square().sum(), qi)
        torch.testing.assert_close(got[i], ref, rtol=1e-10, atol=1e-10)


CU = [0, 5, 5, 12]  # three sequences, the second empty


def _native_varlen(q, k, v, cu=None):
    cu = torch.tensor(CU, dtype=torch.int32) if cu is None else cu
    return dattn_varlen(q, k, v, cu, 7, SEGS, RATES, is_causal=True, backend="native")


def _reference_varlen(q, k, v):
    return reference_varlen(q, k, v, CU, SEGS, RATES, True)[0]


def _packed(T=12, Hq=4, Hkv=2, D=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))


def test_func_on_packed_sequences_matches_reference():
    """grad, vjp and jacrev of the packed op equal those of the float64 reference."""
    q, k, v = _packed()
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * w).sum()

    got = torch.func.grad(loss(_native_varlen), argnums=(0, 1, 2))(q, k, v)
    ref = torch.func.grad(loss(_reference_varlen), argnums=(0, 1, 2))(q, k, v)
    for a, e in zip(got, ref, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)
    out, pull = torch.func.vjp(_native_varlen, q, k, v)
    torch.testing.assert_close(out, _reference_varlen(q, k, v), rtol=1e-10, atol=1e-10)
    for a, e in zip(pull(w), ref, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)
    q, k, v = _packed(D=2, Hq=2, Hkv=1)
    got = torch.func.jacrev(_native_varlen, argnums=(0, 1, 2))(q, k, v)
    want = torch.func.jacrev(_reference_varlen, argnums=(0, 1, 2))(q, k, v)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("in_dims", [(0, 0, 0, None), (1, None, 0, None), (0, 0, 0, 0)])
def test_func_vmap_on_packed_sequences_matches_a_loop(in_dims):
    """vmap over packed batches equals a loop, as does the vmapped gradient; the kernels' vmap rule
    folds the examples into the rows (the fallback loop would warn). cu_seqlens itself cannot be
    vmapped (the packing is read on the host): that is refused by name."""
    V, T = 3, 12
    g = torch.Generator().manual_seed(6)
    args = []
    for h, d in zip((4, 2, 2), in_dims[:3], strict=True):
        shape = [T, h, 3]
        if d is not None:
            shape.insert(d, V)
        args.append(torch.randn(shape, generator=g, dtype=torch.float64))
    cus = [[0, 5, 5, 12], [0, 12, 12, 12], [0, 1, 2, 12]]
    cu = torch.tensor(cus if in_dims[3] == 0 else CU, dtype=torch.int32)
    if in_dims[3] == 0:
        with pytest.raises(ValueError, match=r"cu_seqlens cannot be vmapped \(torch.func.vmap\)"):
            torch.func.vmap(_native_varlen, in_dims=in_dims)(*args, cu)
        return
    got = torch.func.vmap(_native_varlen, in_dims=in_dims)(*args, cu)
    grad = torch.func.vmap(
        torch.func.grad(lambda q, k, v, cu: _native_varlen(q, k, v, cu).square().sum()), in_dims=in_dims
    )
    dq = grad(*args, cu)
    for i in range(V):
        one = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims[:3], strict=True)]
        cu_i = cus[i] if in_dims[3] == 0 else CU
        want = reference_varlen(*one, cu_i, SEGS, RATES, True)[0]
        torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-10)
        q = one[0].clone().requires_grad_()
        reference_varlen(q, one[1], one[2], cu_i, SEGS, RATES, True)[0].square().sum().backward()
        torch.testing.assert_close(dq[i], q.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["native", "sdpa"])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "forward_ad"])
def test_forward_mode_refused_by_name(transform, packed, backend):
    """A fused backend has no forward-mode formula: every forward-mode transform raises the
    package's error naming the backend (never a zero tangent)."""
    if packed:
        q, k, v = _packed()
        cu = torch.tensor(CU, dtype=torch.int32)

        def fn(q, k, v):
            return dattn_varlen(q, k, v, cu, 7, SEGS, RATES, is_causal=True, backend=backend)
    else:
        q, k, v = _inputs()

        def fn(q, k, v):
            return dattn(q, k, v, SEGS, RATES, is_causal=True, backend=backend)

    with pytest.raises(RuntimeError, match=f"'{backend}' backend has no forward-mode gradients"):
        if transform == "jvp":
            torch.func.jvp(fn, (q, k, v), (q, k, v))
        elif transform == "jacfwd":
            torch.func.jacfwd(fn)(q, k, v)
        else:
            with torch.autograd.forward_ad.dual_level():
                fn(torch.autograd.forward_ad.make_dual(q, torch.ones_like(q)), k, v)


def test_second_order_through_func_refused_by_name():
    q, k, v = _inputs()

    def loss(q):
        return _native(q, k, v).square().sum()

    with pytest.raises(RuntimeError, match="'native' backend has no second-order gradients"):
        torch.func.grad(lambda q: torch.func.grad(loss)(q).sum())(q)


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return dattn(q, k, v, SEGS, RATES, is_causal=True, backend="native")


class _RawOp(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.ops.dilated_attention.fwd(q, k, v, SEGS, RATES, True, 0.5)


@pytest.mark.parametrize("module", [_Attention, _RawOp], ids=["functional", "raw-op"])
def test_export_with_dynamic_sequence_length(module):
    """torch.export with a symbolic sequence length: one graph, run at other lengths, also below
    the number of heads (a max(N, heads) guarded N >= heads)."""
    q, k, v = make_inputs(1, 16, 4, 2, 8, torch.float32, requires_grad=False)
    N = torch.export.Dim("N", min=2, max=4096)
    ep = torch.export.export(module(), (q, k, v), dynamic_shapes=({1: N}, {1: N}, {1: N}))
    for n in (2, 3, 5, 16, 37):
        q, k, v = make_inputs(1, n, 4, 2, 8, torch.float32, seed=n, requires_grad=False)
        got, want = ep.module()(q, k, v), module()(q, k, v)
        got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
        for a, e in zip(got, want, strict=True):
            assert a.shape == e.shape
            torch.testing.assert_close(a, e, rtol=0, atol=0)
