"""The attention backends against the float64 dense reference, their selection and fallback
rules (SPEC section 4), the adapters of flash_attn and xformers through test doubles that follow
those packages' documented APIs, and the pattern cache."""

from __future__ import annotations

import copy
import logging
import math
import pickle
import random
import sys
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from common import grads, make_inputs
from reference import reference_attention
from tolerance import assert_within_rule

from dilated_attention import BackendFallbackWarning, SlowPathWarning, backends, hardware
from dilated_attention import dilated_attention as dattn
from dilated_attention.backends import BackendRequest, BackendSelector, get_backend, resolve
from dilated_attention.backends.patterns import PatternCache, build_positions

RUNNABLE = ["native", "sdpa", "manual"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
LOGGER = "dilated_attention.backends.registry"

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


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The problems here are tiny: one thread is faster, and steady on a busy machine (the fused
    CPU attention kernels otherwise pay a thread wake-up per call)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def fresh_selection():
    backends.default_selector().clear()
    yield
    backends.default_selector().clear()


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
        return impl.forward(q, k, v, [4, 8], [1, 2], is_causal=True, softmax_scale=0.5, dropout_p=0.3)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "manual"])
def test_dropout_keeps_lse_and_is_unbiased(backend):
    q, k, v = make_inputs(1, 24, 2, 2, 8, torch.float64, requires_grad=False)
    segs, rates, p = [8, 16], [1, 2], 0.25
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


def test_native_declares_no_dropout():
    why = get_backend("native").reasons(BackendRequest(torch.device("cpu"), torch.float32, 8, dropout=True))
    assert any("dropout" in w for w in why)
    with pytest.raises(RuntimeError, match="dropout"):
        get_backend("native").forward(
            *make_inputs(1, 8, 1, 1, 4, torch.float32),
            [4],
            [1],
            is_causal=False,
            softmax_scale=0.5,
            dropout_p=0.1,
        )


# ----------------------------------------------------------------------------------------------
# Selection and fallback
# ----------------------------------------------------------------------------------------------


def _records(caplog, level):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


@pytest.mark.parametrize(
    "asked,chain,runs",
    [
        ("flash_attn_2", ["flash_attn_2"], "sdpa"),
        ("flash_attn_3", ["flash_attn_3", "flash_attn_2"], "sdpa"),
        ("xformers", ["xformers"], "sdpa"),
    ],
)
def test_fallback_chain_with_packages_absent(caplog, recwarn, asked, chain, runs):
    """flash_attn and xformers are not installed here: the documented chains, one warning that
    names what was asked, why not and what runs instead, and one INFO, however many calls."""
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32)
    ref, _ = reference_attention(q, k, v, [4, 8], [1, 2])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            out = dattn(q, k, v, [4, 8], [1, 2], backend=asked)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    infos = _records(caplog, logging.INFO)
    warned = [w for w in recwarn if issubclass(w.category, BackendFallbackWarning)]
    logged = _records(caplog, logging.WARNING)
    assert len(warned) == 1 and len(infos) == 1 and len(logged) == 1
    assert logged[0].getMessage() == str(warned[0].message)  # the contract's logged WARNING, the same text
    assert warned[0].filename == __file__  # the warning points at the caller's line
    msg = str(warned[0].message)
    assert f"{asked!r} was requested" in msg and f"using {runs!r} instead" in msg
    for name in chain:
        assert f"{name}:" in msg
    assert "is not installed" in msg and "needs a CUDA device" in msg
    assert f"using attention backend {runs!r}" in infos[0].getMessage()


def test_native_with_dropout_falls_back_to_sdpa(recwarn):
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32)
    dattn(q, k, v, [4], [1], dropout_p=0.1, backend="native")
    dattn(q, k, v, [4], [1], dropout_p=0.1, backend="native")
    (w,) = [str(w.message) for w in recwarn if w.category is BackendFallbackWarning]
    assert "'native' was requested" in w and "dropout" in w
    assert "using 'sdpa' instead" in w


def test_fallback_warns_once_per_cause_across_modules_and_shows_by_default():
    """Twelve selectors meeting one cause give one warning, and it shows in a plain script (no
    logging configured, Python's default warning filters)."""
    import subprocess

    script = (
        "import torch, dilated_attention as da\n"
        "q = torch.randn(1, 16, 2, 8)\n"
        "layers = [da.DilatedAttention([4], [1], attention_backend='flash_attn_2') for _ in range(12)]\n"
        "for layer in layers:\n"
        "    layer(q, q, q)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("BackendFallbackWarning") == 1, run.stderr
    assert "'flash_attn_2' was requested" in run.stderr and "using 'sdpa' instead" in run.stderr


def test_half_precision_on_manual_warns_slow_path(recwarn):
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.bfloat16)
    for _ in range(2):
        dattn(q, k, v, [4], [1], backend="manual")
    (w,) = [str(w.message) for w in recwarn if w.category is SlowPathWarning]
    assert "bfloat16" in w and "manual" in w
    dattn(q.float(), k.float(), v.float(), [4], [1], backend="manual")  # float32: nothing to say
    assert len([w for w in recwarn if w.category is SlowPathWarning]) == 1


@pytest.mark.parametrize(
    "cap,dtype,head_dim,slow",
    [
        ((8, 0), torch.bfloat16, 64, False),
        ((9, 0), torch.float16, 128, False),
        ((7, 5), torch.float16, 64, True),
        ((8, 6), torch.bfloat16, 20, True),
        ((8, 0), torch.bfloat16, 16, True),
        ((7, 5), torch.float32, 64, False),
    ],
)
def test_slow_path_of_native_on_cuda(fake_gpu, cap, dtype, head_dim, slow):
    from dilated_attention.backends.advice import slow_path

    fake_gpu["cap"] = cap
    why = slow_path("native", BackendRequest(torch.device("cuda", 0), dtype, head_dim))
    assert (why is not None) == slow
    if slow:
        assert "SIMT" in why


def test_auto_picks_native_then_sdpa_for_dropout_without_warning(caplog, recwarn):
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        dattn(q, k, v, [4], [1])
        dattn(q, k, v, [4], [1], dropout_p=0.2)
    assert not _records(caplog, logging.WARNING)
    assert not [w for w in recwarn if w.category is BackendFallbackWarning]
    infos = [r.getMessage() for r in _records(caplog, logging.INFO)]
    assert len(infos) == 2
    assert "'native'" in infos[0] and "(auto)" in infos[0]
    assert "'sdpa'" in infos[1] and "passed over native" in infos[1]


def test_sdpa_falls_back_to_manual_where_it_cannot_run():
    sel = resolve("sdpa", BackendRequest(torch.device("meta"), torch.float32, 8))
    assert sel.name == "manual" and sel.fell_back and sel.skipped[0][0] == "sdpa"
    sel = resolve("native", BackendRequest(torch.device("meta"), torch.float32, 8))
    assert [n for n, _ in sel.skipped] == ["native", "sdpa"] and sel.name == "manual"


def test_nothing_can_run_lists_every_backend(monkeypatch):
    monkeypatch.setattr(type(get_backend("manual")), "reasons", lambda self, req: ["forced off for the test"])
    with pytest.raises(RuntimeError) as info:
        resolve("auto", BackendRequest(torch.device("meta"), torch.float32, 8))
    text = str(info.value)
    for name in backends.BACKEND_NAMES:
        assert f"  {name}: " in text
    assert "forced off for the test" in text and "is not installed" in text
    with pytest.raises(RuntimeError, match="requested 'flash_attn_3'"):
        resolve("flash_attn_3", BackendRequest(torch.device("meta"), torch.float32, 8))


@pytest.mark.parametrize("name", ["flash", "FLASH_ATTN_2", "", None, 3])
def test_unknown_backend_name(name):
    q, k, v = make_inputs(1, 8, 1, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="expected one of auto, native, flash_attn_3"):
        dattn(q, k, v, [4], [1], backend=name)


def test_choice_is_made_once_per_key(monkeypatch):
    calls = []
    cls = type(get_backend("native"))
    original = cls.reasons
    monkeypatch.setattr(cls, "reasons", lambda self, req: calls.append(req) or original(self, req))
    sel = BackendSelector("test")
    q, k, _ = make_inputs(1, 8, 2, 2, 4, torch.float32)
    for _ in range(5):
        assert sel.select("auto", q, k).name == "native"
    assert len(calls) == 1
    sel.select("auto", q.double(), k.double())  # another dtype: another choice
    sel.select("auto", q, k, dropout_p=0.1)  # dropout: another choice
    assert len(calls) == 3
    assert len(sel.selections()) == 3


def test_selector_is_thread_safe_and_logs_once(caplog, recwarn):
    sel = BackendSelector("threads")
    q, k, _ = make_inputs(1, 8, 2, 2, 4, torch.float32, requires_grad=False)
    barrier = threading.Barrier(8)
    names, errors = [], []

    def work():
        try:
            barrier.wait()
            for _ in range(50):
                names.append(sel.select("flash_attn_2", q, k).name)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and set(names) == {"sdpa"} and len(names) == 400
    assert len([w for w in recwarn if w.category is BackendFallbackWarning]) == 1
    assert len(_records(caplog, logging.INFO)) == 1


def test_selector_copies_and_pickles_empty():
    sel = BackendSelector("copy")
    q, k, _ = make_inputs(1, 8, 2, 2, 4, torch.float32)
    sel.select("auto", q, k)
    for other in (copy.deepcopy(sel), pickle.loads(pickle.dumps(sel))):
        assert other.owner == "copy" and other.selections() == []
        assert other.select("auto", q, k).name == "native"


def test_select_backend_compat():
    q, k, _ = make_inputs(1, 8, 2, 2, 4, torch.float32)
    assert backends.select_backend("auto", q, k).name == "native"
    assert backends.select_backend("auto", q, k, dropout_p=0.5).name == "sdpa"
    assert backends.select_backend("manual", q, k).name == "manual"


def test_capability_declarations_give_reasons():
    cpu64 = BackendRequest(torch.device("cpu"), torch.float64, 64)
    reasons = backends.backend_reasons(cpu64)
    assert reasons["native"] == [] and reasons["sdpa"] == [] and reasons["manual"] == []
    for name in ("flash_attn_3", "flash_attn_2", "xformers"):
        assert reasons[name] and all(isinstance(r, str) and r for r in reasons[name])
    for name in backends.BACKEND_NAMES:
        caps = get_backend(name).capabilities
        assert caps.devices and caps.dtypes and caps.needs and isinstance(caps.dropout, bool)


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


@pytest.fixture
def fake_gpu(monkeypatch):
    """Make the hardware module report one CUDA GPU of a chosen compute capability."""
    state = {"cap": (8, 0)}
    monkeypatch.setattr(hardware, "compute_capability", lambda device=None: state["cap"])
    monkeypatch.setattr(
        hardware, "device_name", lambda device=None: f"FAKE sm_{state['cap'][0]}{state['cap'][1]}"
    )
    monkeypatch.setattr(hardware, "device_unavailable", lambda device=None: None)
    return state


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
        return impl.forward(q, k, v, [4, 8], [1, 2], is_causal=False, softmax_scale=0.5, dropout_p=0.3)

    _, lse = f(q, k, v)
    torch.testing.assert_close(lse, reference_attention(q, k, v, [4, 8], [1, 2], softmax_scale=0.5)[1])
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
    # auto on Hopper: FlashAttention-3 unless native's CUDA kernels are verified and built here.
    fake_gpu["cap"] = (9, 0)
    assert resolve("auto", cuda_bf16).name == (
        "native"
        if hardware.CUDA_KERNELS_VERIFIED and get_backend("native").can_run(cuda_bf16)
        else "flash_attn_3"
    )
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


# ----------------------------------------------------------------------------------------------
# Pattern cache
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "N,w,r",
    [(1, 1, 1), (16, 4, 1), (37, 8, 2), (50, 40, 4), (20, 32, 2), (23, 6, 4), (30, 6, 6), (9, 16, 16)],
)
def test_positions_cover_exactly_the_branch(N, w, r):
    pos_all = torch.arange(N)
    for o in range(r):
        groups = build_positions(N, w, r, o, torch.device("cpu"))
        got = torch.cat([g.reshape(-1) for g in groups]) if groups else torch.empty(0, dtype=torch.int64)
        expected = pos_all[(pos_all % w) % r == o]
        assert torch.equal(got.sort().values, expected)
        for g in groups:
            assert g.dim() == 2 and g.shape[1] >= 1
            assert ((g // w) == (g[:, :1] // w)).all()  # a row stays in one segment
            if g.shape[1] > 1:
                assert (g.diff(dim=1) == r).all()  # strided by r, in order


def test_pattern_cache_lru_and_bounds():
    cache = PatternCache(max_entries=3)
    cpu = torch.device("cpu")
    for N in (10, 11, 12):
        cache.get(N, 4, 2, 0, cpu)
    cache.get(10, 4, 2, 0, cpu)  # refresh 10
    cache.get(13, 4, 2, 0, cpu)  # evicts 11, the least recently used
    assert (11, 4, 2, 0, cpu) not in cache and (10, 4, 2, 0, cpu) in cache and len(cache) == 3
    info = cache.info()
    assert info.hits == 1 and info.misses == 4 and info.entries == 3
    first = cache.get(13, 4, 2, 0, cpu)
    assert cache.get(13, 4, 2, 0, cpu) is first  # cached objects are reused
    cache.resize(max_bytes=sum(t.numel() * 8 for t in first))  # room for the last entry only
    assert len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and cache.info().hits == 0
    with pytest.raises(ValueError, match="max_entries"):
        cache.resize(max_entries=0)
    with pytest.raises(ValueError, match="max_bytes"):
        cache.resize(max_bytes=-1)


def test_pattern_cache_thread_safe():
    cache = PatternCache(max_entries=5)
    cpu = torch.device("cpu")
    keys = [(N, w, r, o) for N in (17, 32, 33) for (w, r) in ((4, 2), (8, 4), (16, 1)) for o in range(r)]
    errors = []

    def work(seed):
        rnd = random.Random(seed)
        try:
            for _ in range(300):
                N, w, r, o = rnd.choice(keys)
                got = cache.get(N, w, r, o, cpu)
                want = build_positions(N, w, r, o, cpu)
                assert len(got) == len(want) and all(
                    torch.equal(a, b) for a, b in zip(got, want, strict=True)
                )
                assert len(cache) <= 5
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    info = cache.info()
    assert info.hits + info.misses == 8 * 300 and info.entries <= 5


def test_backends_share_the_plan_cache():
    from dilated_attention.backends.views import plan_branches

    plan_branches.cache_clear()
    q, k, v = make_inputs(1, 19, 2, 2, 4, torch.float32, requires_grad=False)
    dattn(q, k, v, [8], [2], backend="sdpa")
    dattn(q, k, v, [8], [2], backend="manual")
    info = plan_branches.cache_info()
    assert info.misses == 1 and info.hits >= 1
