"""The native op under torch.func transforms and torch.export (PyTorch's conventions: results
equal to the same computation without the transform; what has no formula refuses by name)."""

from __future__ import annotations

import pytest
import torch
from common import make_inputs, one_thread  # noqa: F401
from reference import reference_attention

from dilated_attention import dilated_attention as dattn

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


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_forward_mode_refused_by_name(transform):
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="'native' backend has no forward-mode gradients"):
        if transform == "jvp":
            torch.func.jvp(_native, (q, k, v), (q, k, v))
        else:
            torch.func.jacfwd(_native)(q, k, v)


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
    """torch.export with a symbolic sequence length: one graph, run at other lengths."""
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32, requires_grad=False)
    N = torch.export.Dim("N", min=2, max=4096)
    ep = torch.export.export(module(), (q, k, v), dynamic_shapes=({1: N}, {1: N}, {1: N}))
    for n in (5, 16, 37):
        q, k, v = make_inputs(1, n, 2, 2, 8, torch.float32, seed=n, requires_grad=False)
        got, want = ep.module()(q, k, v), module()(q, k, v)
        got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
        for a, e in zip(got, want, strict=True):
            assert a.shape == e.shape
            torch.testing.assert_close(a, e, rtol=0, atol=0)
