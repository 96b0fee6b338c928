"""The flash_attn and xformers adapters through test doubles that follow those packages' documented APIs."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from backend_fixtures import DTYPES, LOGGER, RUNNABLE, fresh_selection, one_thread  # noqa: F401
from common import make_inputs
from reference import reference_attention
from test_backends import check_against_reference

from dilated_attention import hardware
from dilated_attention.backends import BackendRequest, get_backend, resolve

# ----------------------------------------------------------------------------------------------
# Test doubles of flash_attn and xformers, after their documented APIs
# ----------------------------------------------------------------------------------------------


def _dense(q, k, v, scale, causal, dropout_p=0.0):
    """Plain attention on (B, M, H, K), grouped-query (query head h reads k/v head h // G)."""
    assert q.dim() == 4 and k.dim() == 4 and q.shape[2] % k.shape[2] == 0
    assert q.shape[0] == k.shape[0] and q.shape[-1] == k.shape[-1] == v.shape[-1]
    G = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    s = torch.einsum("bmhd,bnhd->bhmn", q, kk) * scale  # (B, H, M, M)
    if causal:
        M = q.shape[1]
        s = s.masked_fill(torch.ones(M, M, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, M)
    p = torch.exp(s - lse[..., None])
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    return torch.einsum("bhmn,bnhd->bmhd", p, vv), lse, s


def _lse_like_kernel(lse, q):
    """Not differentiable, float32 (float64 for the float64 inputs that the real kernels refuse)."""
    return lse.detach().to(torch.float64 if q.dtype == torch.float64 else torch.float32)


class FakeFlashAttn:
    """``flash_attn`` 2.x: ``flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, ...,
    return_attn_probs)`` on (B, N, H, D); with ``return_attn_probs=True`` it returns ``(out,
    softmax_lse (B, H, N) float32, S_dmask)``. Only ``out`` is differentiable, as in the package.
    (The double also takes float64, and then gives a float64 lse, so that the adapter can be
    checked in float64 on the CPU.)"""

    def __init__(self, version="2.6.3", lse_pad=0):
        self.module = types.ModuleType("flash_attn")
        self.module.__version__ = version
        self.module.flash_attn_func = self.flash_attn_func
        self.calls = []
        self.lse_pad = lse_pad

    def flash_attn_func(
        self,
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        self.calls.append(
            {
                "q": tuple(q.shape),
                "k": tuple(k.shape),
                "dropout_p": dropout_p,
                "causal": causal,
                "return_attn_probs": return_attn_probs,
            }
        )
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, lse, _ = _dense(q, k, v, scale, causal, dropout_p)
        if not return_attn_probs:
            return out
        lse = _lse_like_kernel(lse, q)
        if self.lse_pad:
            lse = F.pad(lse, (0, self.lse_pad), value=float("nan"))  # padded rows must never be read
        return out, lse, None


class FakeFlashAttn3:
    """``flash_attn_interface`` (FlashAttention-3): ``flash_attn_func(q, k, v, softmax_scale,
    causal, ..., return_attn_probs)`` returning ``(out, softmax_lse)``; no dropout."""

    def __init__(self):
        self.module = types.ModuleType("flash_attn_interface")
        self.module.flash_attn_func = self.flash_attn_func
        self.calls = []

    def flash_attn_func(
        self,
        q,
        k,
        v,
        softmax_scale=None,
        causal=False,
        qv=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        sm_margin=0,
        return_attn_probs=False,
    ):
        self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "causal": causal})
        out, lse, _ = _dense(q, k, v, softmax_scale, causal)
        return (out, _lse_like_kernel(lse, q)) if return_attn_probs else out


class FakeXformers:
    """``xformers.ops``: ``memory_efficient_attention(q, k, v, attn_bias, p, scale)`` on
    (B, M, H, K) with equal head counts, ``LowerTriangularMask``, and in ``xformers.ops.fmha``
    ``memory_efficient_attention_forward_requires_grad`` -> ``(out, lse)`` with lse (B, H, M
    rounded up to 32) and ``memory_efficient_attention_backward(grad, output, lse, query, key,
    value, attn_bias, p, scale)`` -> ``(dq, dk, dv)``; the last two refuse dropout."""

    class LowerTriangularMask:
        pass

    def __init__(self):
        self.pkg = types.ModuleType("xformers")
        self.ops = types.ModuleType("xformers.ops")
        self.fmha = types.ModuleType("xformers.ops.fmha")
        self.pkg.ops = self.ops
        self.ops.fmha = self.fmha
        self.ops.LowerTriangularMask = self.LowerTriangularMask
        self.ops.memory_efficient_attention = self.memory_efficient_attention
        self.fmha.memory_efficient_attention_forward_requires_grad = self.forward_requires_grad
        self.fmha.memory_efficient_attention_backward = self.backward
        self.calls = []

    def _check(self, query, key, value, attn_bias):
        assert query.dim() == 4 and query.shape[2] == key.shape[2] == value.shape[2], "BMHK, equal heads"
        assert attn_bias is None or isinstance(attn_bias, self.LowerTriangularMask)
        return attn_bias is not None

    def memory_efficient_attention(self, query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None):
        causal = self._check(query, key, value, attn_bias)
        self.calls.append(("mea", tuple(query.shape), p))
        return _dense(query, key, value, scale if scale is not None else query.shape[-1] ** -0.5, causal, p)[
            0
        ]

    def forward_requires_grad(self, query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None):
        if p != 0.0:
            raise NotImplementedError("dropout is not supported on the non-autograd API")
        causal = self._check(query, key, value, attn_bias)
        self.calls.append(("fwd", tuple(query.shape), p))
        with torch.no_grad():
            out, lse, _ = _dense(query, key, value, scale, causal)
        M = query.shape[1]
        padded = lse.new_full((*lse.shape[:2], -(-M // 32) * 32), float("nan"))
        padded[..., :M] = lse
        return out, padded

    def backward(self, grad, output, lse, query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None):
        if p != 0.0:
            raise NotImplementedError("dropout is not supported on the non-autograd API")
        causal = self._check(query, key, value, attn_bias)
        M = query.shape[1]
        assert lse.dim() == 3 and lse.shape[:2] == (query.shape[0], query.shape[2]) and lse.shape[2] >= M
        self.calls.append(("bwd", tuple(query.shape), p))
        _, _, s = _dense(query, key, value, scale, causal)
        P = torch.exp(s - lse[..., :M, None])  # (B, H, M, M), with the given lse
        dP = torch.einsum("bmhd,bnhd->bhmn", grad, value)
        Dr = (grad * output).sum(-1).transpose(1, 2)  # (B, H, M), with the given output
        dS = P * (dP - Dr[..., None])
        dq = torch.einsum("bhmn,bnhd->bmhd", dS, key) * scale
        dk = torch.einsum("bhmn,bmhd->bnhd", dS, query) * scale
        dv = torch.einsum("bhmn,bmhd->bnhd", P, grad)
        return dq, dk, dv


@pytest.fixture
def fake_flash(monkeypatch):
    fake = FakeFlashAttn(lse_pad=5)
    monkeypatch.setitem(sys.modules, "flash_attn", fake.module)
    return fake


@pytest.fixture
def fake_flash3(monkeypatch):
    fake = FakeFlashAttn3()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake.module)
    return fake


@pytest.fixture
def fake_xformers(monkeypatch):
    fake = FakeXformers()
    monkeypatch.setitem(sys.modules, "xformers", fake.pkg)
    monkeypatch.setitem(sys.modules, "xformers.ops", fake.ops)
    monkeypatch.setitem(sys.modules, "xformers.ops.fmha", fake.fmha)
    return fake


ADAPTER_CONFIGS = [
    pytest.param(2, 37, 4, 2, 8, [8, 16], [1, 2], id="gqa-ragged"),
    pytest.param(1, 24, 6, 2, 8, [8, 12], [2, 4], id="gqa-not-grouped"),
    pytest.param(1, 16, 2, 2, 8, [8], [4], id="uncovered-rows"),
]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", ADAPTER_CONFIGS)
@pytest.mark.parametrize("name", ["flash_attn_2", "flash_attn_3", "xformers"])
def test_adapter_with_double_matches_reference(request, name, B, N, Hq, Hkv, D, segs, rates, is_causal):
    """The adapters run on the doubles (plain PyTorch, so on this CPU in float64): layout and
    log-sum-exp handling must give the reference forward and backward, lse gradient included."""
    fake = request.getfixturevalue(
        {"flash_attn_2": "fake_flash", "flash_attn_3": "fake_flash3", "xformers": "fake_xformers"}[name]
    )
    impl = get_backend(name)

    def run(q, k, v):
        return impl.forward(q, k, v, segs, rates, is_causal=is_causal, softmax_scale=D**-0.5)

    check_against_reference(run, B, N, Hq, Hkv, D, segs, rates, is_causal, torch.float64)
    assert fake.calls
    if name == "xformers":
        kinds = {c[0] for c in fake.calls}
        assert kinds == {"fwd", "bwd"}  # the merged path: backward fed the merged out/lse
    else:
        for c in fake.calls:
            assert len(c["q"]) == 4 and c["q"][2] % c["k"][2] == 0 and c["causal"] == is_causal
        if name == "flash_attn_2":
            assert any(c["return_attn_probs"] for c in fake.calls)


def test_flash_double_sees_dilated_subsequences(fake_flash):
    """Each call is one (branch, part, heads) view of (rows, m) sub-sequences."""
    q, k, v = make_inputs(2, 40, 4, 4, 8, torch.float64, requires_grad=False)
    get_backend("flash_attn_2").forward(q, k, v, [16], [4], is_causal=False, softmax_scale=0.3)
    # w=16, r=4 >= Hq: head h reads phase h, all four heads in one call: 2 full segments (m=4, one
    # batch element at a time since the tail keeps them from folding) + a tail of 8 (m=2).
    shapes = sorted(c["q"] for c in fake_flash.calls)
    assert shapes == sorted([(2, 4, 4, 8)] * 2 + [(2, 2, 4, 8)])


@pytest.mark.parametrize("name", ["flash_attn_2", "xformers"])
def test_adapter_dropout_backward_exact_for_a_fixed_mask(request, name):
    request.getfixturevalue("fake_flash" if name == "flash_attn_2" else "fake_xformers")
    q, k, v = make_inputs(1, 9, 4, 2, 3, torch.float64, seed=3)
    impl = get_backend(name)

    def f(q, k, v):
        torch.manual_seed(7)
        return impl.forward(q, k, v, [8], [1], is_causal=False, softmax_scale=0.5, dropout_p=0.3)

    _, lse = f(q, k, v)
    torch.testing.assert_close(lse, reference_attention(q, k, v, [8], [1], softmax_scale=0.5)[1])
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


def test_selection_with_doubles_on_a_fake_gpu(fake_gpu, fake_flash, fake_flash3, fake_xformers, caplog):
    cuda_bf16 = BackendRequest(torch.device("cuda", 0), torch.bfloat16, 64)
    fake_gpu["cap"] = (8, 0)
    assert resolve("flash_attn_2", cuda_bf16).name == "flash_attn_2"
    assert resolve("xformers", cuda_bf16).name == "xformers"
    # FlashAttention-3 needs Hopper: falls back to FlashAttention-2, saying why.
    sel = resolve("flash_attn_3", cuda_bf16)
    assert sel.name == "flash_attn_2"
    assert "compute capability 9.x, got 8.0 (FAKE sm_80)" in sel.skipped[0][1][0]
    # auto on Hopper: FlashAttention-3 (native, verified there, was measured slower: after sdpa).
    fake_gpu["cap"] = (9, 0)
    assert hardware.native_measured_slower("cuda")
    assert resolve("auto", cuda_bf16).name == "flash_attn_3"
    # float32 is not a FlashAttention dtype; sdpa takes it.
    sel = resolve("flash_attn_2", BackendRequest(torch.device("cuda", 0), torch.float32, 64))
    assert sel.name == "sdpa" and "supports float16, bfloat16, got float32" in sel.skipped[0][1][0]
    # dropout: FlashAttention-3 has none, FlashAttention-2 has.
    sel = resolve("flash_attn_3", BackendRequest(torch.device("cuda", 0), torch.float16, 64, dropout=True))
    assert sel.name == "flash_attn_2" and "dropout" in sel.skipped[0][1][0]
    # pre-Ampere: no FlashAttention-2.
    fake_gpu["cap"] = (7, 5)
    assert resolve("flash_attn_2", cuda_bf16).name == "sdpa"
    # pre-Ampere float16 would run on native's SIMT kernels: xformers comes first.
    assert resolve("auto", BackendRequest(torch.device("cuda", 0), torch.float16, 64)).name == "xformers"


def test_wrong_flash_attn_version(monkeypatch, fake_gpu):
    monkeypatch.setitem(sys.modules, "flash_attn", FakeFlashAttn(version="1.0.9").module)
    why = get_backend("flash_attn_2").reasons(BackendRequest(torch.device("cuda", 0), torch.float16, 64))
    assert why == ["flash_attn_2 needs flash_attn 2.x, found 1.0.9"]


def test_broken_package_is_a_reason_not_a_crash(monkeypatch):
    import importlib

    real_import = importlib.import_module

    def import_module(name, package=None):
        if name.startswith(("flash_attn", "xformers")):
            raise OSError(f"{name}/_C.so: undefined symbol: _ZN3c10")  # a build for another torch
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", import_module)
    cpu = BackendRequest(torch.device("cpu"), torch.float32, 8)
    for name in ("flash_attn_3", "flash_attn_2", "xformers"):
        why = get_backend(name).reasons(cpu)
        assert any("failed to import (OSError" in w and "undefined symbol" in w for w in why), why
    assert resolve("flash_attn_2", cpu).name == "sdpa"
