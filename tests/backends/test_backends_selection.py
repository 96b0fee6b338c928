"""Backend selection and fallback rules (SPEC section 4): chains, warnings, logging, caching."""

from __future__ import annotations

import copy
import logging
import pickle
import sys
import threading

import pytest
import torch
from backend_fixtures import DTYPES, LOGGER, RUNNABLE, fresh_selection, one_thread  # noqa: F401
from common import make_inputs
from reference import reference_attention

from dilated_attention import BackendFallbackWarning, SlowPathWarning, backends
from dilated_attention import dilated_attention as dattn
from dilated_attention.backends import BackendRequest, BackendSelector, get_backend, resolve

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


def test_native_with_dropout_runs_native_on_cpu(recwarn):
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32)
    dattn(q, k, v, [4], [1], dropout_p=0.1, backend="native")
    dattn(q, k, v, [4], [1], dropout_p=0.1, backend="native")
    assert not [w for w in recwarn if w.category is BackendFallbackWarning]


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


def test_auto_picks_native_for_dropout_too_without_warning(caplog, recwarn):
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        dattn(q, k, v, [4], [1])
        dattn(q, k, v, [4], [1], dropout_p=0.2)
    assert not _records(caplog, logging.WARNING)
    assert not [w for w in recwarn if w.category is BackendFallbackWarning]
    infos = [r.getMessage() for r in _records(caplog, logging.INFO)]
    assert len(infos) == 2
    assert "'native'" in infos[0] and "(auto)" in infos[0]
    assert "'native'" in infos[1] and "(auto)" in infos[1]  # the CPU kernels have dropout


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
    assert backends.select_backend("auto", q, k, dropout_p=0.5).name == "native"
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


@pytest.mark.parametrize(
    ("cap", "name", "expected"),
    [
        ((8, 6), "flash_attn_3", "flash_attn_3 needs compute capability 9.x, got 8.6 (GPU)"),
        ((10, 0), "flash_attn_3", "flash_attn_3 needs compute capability 9.x, got 10.0 (GPU)"),
        ((7, 5), "flash_attn_2", "flash_attn_2 needs compute capability 8.0 or newer, got 7.5 (GPU)"),
        ((5, 2), "xformers", "xformers needs compute capability 6.0 or newer, got 5.2 (GPU)"),
        ((9, 0), "flash_attn_3", None),
        ((12, 0), "flash_attn_2", None),
    ],
)
def test_cuda_backends_name_the_capability_they_need(monkeypatch, cap, name, expected):
    from dilated_attention import hardware

    monkeypatch.setattr(hardware, "compute_capability", lambda device=None: cap)
    monkeypatch.setattr(hardware, "device_name", lambda device=None: "GPU")
    request = BackendRequest(torch.device("cuda"), torch.float16, 64, dropout=True)
    why = get_backend(name).reasons(request)
    capability = [r for r in why if "compute capability" in r]
    assert capability == ([expected] if expected else [])
    assert ("has no attention dropout" in " ".join(why)) == (not get_backend(name).capabilities.dropout)
    half = BackendRequest(torch.device("cuda"), torch.float64, 64)
    assert f"{name} on cuda supports" in " ".join(get_backend(name).reasons(half))


def test_compiled_selection_passes_only_constants(monkeypatch):
    """Under torch.compile the choice is baked into the graph by a call whose arguments must be
    constants (PyTorch 2.11 refuses an object there): the selector goes by an int, the key holds
    only strings, devices, dtypes, ints and bools; and the compiled call matches eager."""
    from dilated_attention.backends import registry

    seen = []
    original = registry._select_constant

    @torch._dynamo.assume_constant_result
    def recording(selector_id, key):
        seen.append((selector_id, key))
        return original(selector_id, key)

    monkeypatch.setattr(registry, "_select_constant", recording)
    torch._dynamo.reset()
    q, k, v = make_inputs(1, 32, 2, 2, 16, torch.float32, requires_grad=False)
    f = torch.compile(lambda q, k, v: dattn(q, k, v, [8, 16], [1, 2], backend="auto"), fullgraph=True)
    torch.testing.assert_close(f(q, k, v), dattn(q, k, v, [8, 16], [1, 2], backend="auto"))
    torch._dynamo.reset()
    assert seen
    for selector_id, key in seen:
        assert type(selector_id) is int
        assert all(isinstance(x, (str, torch.device, torch.dtype, int, bool)) for x in key), key
