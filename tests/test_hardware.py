"""The hardware module: compute capability, recommended dtype and backend order (with the CUDA
queries of torch replaced by a fake GPU where a GPU is needed)."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import hardware


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda reports one GPU whose capability the test sets."""
    state = {"cap": (8, 0), "name": "FAKE GPU"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: state["cap"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: state["name"])
    return state


@pytest.mark.parametrize(
    "cap,dtype,order",
    [
        ((5, 2), torch.float32, ["native", "xformers", "sdpa", "manual"]),
        ((6, 0), torch.float32, ["native", "xformers", "sdpa", "manual"]),
        ((6, 1), torch.float32, ["native", "xformers", "sdpa", "manual"]),
        ((7, 0), torch.float16, ["native", "xformers", "sdpa", "manual"]),
        ((7, 5), torch.float16, ["native", "xformers", "sdpa", "manual"]),
        ((8, 0), torch.bfloat16, ["native", "flash_attn_2", "xformers", "sdpa", "manual"]),
        ((8, 9), torch.bfloat16, ["native", "flash_attn_2", "xformers", "sdpa", "manual"]),
        ((9, 0), torch.bfloat16, ["native", "flash_attn_3", "flash_attn_2", "xformers", "sdpa", "manual"]),
        ((10, 0), torch.bfloat16, ["native", "flash_attn_2", "xformers", "sdpa", "manual"]),
    ],
)
def test_recommendations_by_capability(fake_cuda, cap, dtype, order):
    fake_cuda["cap"] = cap
    assert hardware.compute_capability("cuda") == cap
    assert hardware.compute_capability(0) == cap
    assert hardware.recommended_dtype("cuda:0") == dtype
    assert hardware.recommended_backends("cuda") == order
    info = hardware.hardware_info("cuda")
    assert info.device == "cuda:0" and info.name == "FAKE GPU" and info.capability == cap
    assert info.architecture.startswith(f"sm_{cap[0]}{cap[1]}")
    assert hardware.device_unavailable("cuda:0") is None
    assert "there is no CUDA device 3" in hardware.device_unavailable("cuda:3")
    assert hardware.compute_capability("cuda:3") is None
    assert hardware.as_device(None) == torch.device("cuda", 0)  # the default device when CUDA is there


def test_cpu_and_other_devices():
    assert hardware.recommended_dtype("cpu") == torch.float32
    assert hardware.recommended_backends("cpu") == ["native", "sdpa", "manual"]
    assert hardware.recommended_backends("meta") == ["sdpa", "manual"]
    assert hardware.compute_capability("cpu") is None
    assert hardware.device_name("cpu") == "cpu"
    info = hardware.hardware_info("cpu")
    assert info.capability is None and info.architecture == "-" and info.recommended_dtype == torch.float32
    assert hardware.device_unavailable("cpu") is None and hardware.device_unavailable("meta") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_cuda():
    assert hardware.as_device(None) == torch.device("cpu")
    assert hardware.compute_capability("cuda") is None
    assert hardware.recommended_dtype("cuda") == torch.float32
    assert hardware.device_unavailable("cuda") == "CUDA is not available"
    assert hardware.as_device(1) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        ("gpu", ValueError, "unknown device 'gpu'"),
        (True, TypeError, "device must be"),
        (2.5, TypeError, "device must be"),
    ],
)
def test_bad_devices(bad, exc, match):
    with pytest.raises(exc, match=match):
        hardware.recommended_dtype(bad)
