"""The hardware module: compute capability, recommended dtype and backend order (with the CUDA
queries of torch replaced by a fake GPU where a GPU is needed)."""

from __future__ import annotations

import re
from pathlib import Path

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


@pytest.fixture
def verified(monkeypatch, fake_cuda):
    """Sets hardware.CUDA_KERNELS_VERIFIED for one test: True records a pass of both kernel
    families on the fake GPU's capability (or on ``caps``), False records none."""

    def set_(value: bool, caps=None, families=hardware.KERNEL_FAMILIES) -> None:
        record = hardware.Verification("FAKE GPU", "0123abc", "2026-11-24", tuple(families))
        table = dict.fromkeys(caps or [fake_cuda["cap"]], record) if value else {}
        monkeypatch.setattr(hardware, "CUDA_KERNELS_VERIFIED", table)

    return set_


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
        # sm_90 (CUDA_SPEED_MEASURED): native measured slower than the gather path goes after sdpa,
        # and sdpa measured faster than it goes before flash_attn_2 and xformers
        ((9, 0), torch.bfloat16, ["flash_attn_3", "sdpa", "flash_attn_2", "xformers", "native", "manual"]),
        ((10, 0), torch.bfloat16, ["native", "flash_attn_2", "xformers", "sdpa", "manual"]),
    ],
)
def test_recommendations_by_capability(fake_cuda, verified, cap, dtype, order):
    fake_cuda["cap"] = cap
    verified(True)
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
    # Until the CUDA kernels are verified on a GPU, auto leaves native out on CUDA (never on CPU).
    verified(False)
    assert hardware.recommended_backends("cuda") == [n for n in order if n != "native"]
    assert hardware.recommended_backends("cpu")[0] == "native"


@pytest.mark.parametrize(
    "cap,dtype,head_dim,simt",
    [
        ((7, 5), torch.float16, 64, True),  # no tensor-core kernels below sm_80
        ((7, 0), torch.bfloat16, 128, True),
        ((7, 5), torch.float32, 64, False),  # float32 always runs on the SIMT kernels, as elsewhere
        ((8, 0), torch.float16, 64, False),
        ((9, 0), torch.bfloat16, 256, False),
        ((9, 0), torch.bfloat16, 20, True),  # head dim below 32
        ((9, 0), torch.float16, 36, True),  # not a multiple of 8
        ((8, 6), torch.bfloat16, 264, True),  # above 256 (native refuses it anyway)
    ],
)
def test_half_precision_on_simt_kernels_goes_after_sdpa(fake_cuda, verified, cap, dtype, head_dim, simt):
    fake_cuda["cap"] = cap
    verified(True)
    assert hardware.uses_simt_kernels("cuda", dtype, head_dim) == simt
    order = hardware.recommended_backends("cuda", dtype, head_dim)
    assert order[-1] == "manual"
    if simt or cap == (9, 0):  # after sdpa, last but manual (sm_90: measured slower than the gather path)
        assert order.index("sdpa") < order.index("native") == len(order) - 2
    else:
        assert order[0] == "native"
    verified(False)
    assert "native" not in hardware.recommended_backends("cuda", dtype, head_dim)


def test_unverified_cuda_kernels_are_said_once_at_info(fake_cuda, verified, monkeypatch, caplog):
    verified(False)
    monkeypatch.setattr(hardware, "_said", set())
    with caplog.at_level("INFO", logger="dilated_attention.hardware"):
        hardware.recommended_backends("cuda")
        hardware.recommended_backends("cuda", torch.bfloat16, 64)
        hardware.recommended_backends("cpu")
    said = [r for r in caplog.records if "not been verified" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO" and "backend='native'" in said[0].getMessage()
    assert "on sm_80 (verified on: no GPU yet)" in said[0].getMessage()
    # Once per capability and family: the SIMT family on the same GPU is said too.
    with caplog.at_level("INFO", logger="dilated_attention.hardware"):
        hardware.recommended_backends("cuda", torch.float32, 64)
        hardware.recommended_backends("cuda", torch.float32, 64)
    said = [r.getMessage() for r in caplog.records if "not been verified" in r.getMessage()]
    assert len(said) == 2 and "(simt family)" in said[1]


@pytest.mark.parametrize(
    "cap,dtype,head_dim,native",
    [
        ((9, 0), torch.bfloat16, 64, True),  # the verified capability and family
        ((9, 0), torch.float16, 128, True),
        ((9, 0), torch.float32, 64, False),  # the SIMT family was not verified
        ((9, 0), torch.bfloat16, 20, False),  # a head dim that runs on the SIMT kernels
        ((7, 5), torch.float16, 64, False),  # Turing: never run there
        ((8, 9), torch.bfloat16, 64, False),  # Ada: never run there
        ((8, 0), torch.bfloat16, 64, False),
        ((10, 0), torch.bfloat16, 64, False),  # a newer GPU runs the PTX JIT: not verified either
    ],
)
def test_verification_is_per_capability_and_family(
    fake_cuda, verified, monkeypatch, cap, dtype, head_dim, native
):
    """A pass recorded for sm_90's tensor-core kernels puts native first for auto there only."""
    from dilated_attention.backends import BackendRequest, get_backend, resolve

    verified(True, caps=[(9, 0)], families=["tensor-core"])
    monkeypatch.setattr(hardware, "CUDA_SPEED_MEASURED", {})  # no speed record: native first
    fake_cuda["cap"] = cap
    assert hardware.cuda_kernels_verified("cuda", dtype, head_dim) == native
    assert ("native" in hardware.recommended_backends("cuda", dtype, head_dim)) == native
    # auto itself, with native able to run (the extension here may have no CUDA kernels).
    monkeypatch.setattr(type(get_backend("native")), "reasons", lambda self, request: [])
    request = BackendRequest(torch.device("cuda", 0), dtype, head_dim)
    assert (resolve("auto", request).name == "native") == native


def test_kernel_family_and_verification_records(fake_cuda, verified):
    fake_cuda["cap"] = (8, 6)
    assert hardware.kernel_family("cuda", torch.bfloat16, 64) == "tensor-core"
    assert hardware.kernel_family("cuda", torch.float64, 64) == "simt"
    assert hardware.kernel_family("cuda", torch.float16, 36) == "simt"
    assert hardware.kernel_family("cpu", torch.bfloat16, 64) is None
    assert not hardware.cuda_kernels_verified("cpu")
    verified(True)
    # Default dtype and head dim: the recommended dtype (bf16 on sm_86) and 64.
    assert hardware.cuda_kernels_verified("cuda") and hardware.cuda_kernels_verified(0, torch.float32, 64)
    verified(True, families=["simt"])
    assert not hardware.cuda_kernels_verified("cuda") and hardware.cuda_kernels_verified(
        "cuda", torch.float32
    )
    verified(False)
    assert not hardware.cuda_kernels_verified("cuda", torch.float32)


def test_recorded_verifications_are_well_formed():
    """Each entry of the shipped table names a capability, a GPU, a commit, a date and families."""
    import re

    for cap, record in hardware.CUDA_KERNELS_VERIFIED.items():
        assert isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(x, int) for x in cap), cap
        assert isinstance(record, hardware.Verification), record
        assert record.gpu and re.fullmatch(r"[0-9a-f]{7,40}", record.commit), record
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record.date), record
        assert record.families and set(record.families) <= set(hardware.KERNEL_FAMILIES), record


def test_shipped_records_on_hopper(fake_cuda):
    """The shipped tables on sm_90: native verified for both families but measured slower, so it
    follows sdpa in half precision, and takes float32 (where auto leaves sdpa out) before manual."""
    fake_cuda["cap"] = (9, 0)
    assert hardware.cuda_kernels_verified("cuda", torch.bfloat16, 64)
    assert hardware.cuda_kernels_verified("cuda", torch.float32, 64)  # the SIMT family
    assert hardware.native_measured_slower("cuda") and hardware.sdpa_measured_faster("cuda")
    assert hardware.recommended_backends("cuda", torch.bfloat16, 64) == [
        "flash_attn_3",
        "sdpa",
        "flash_attn_2",
        "xformers",
        "native",
        "manual",
    ]
    assert hardware.recommended_backends("cuda", torch.float32, 64) == [
        "flash_attn_3",
        "flash_attn_2",
        "xformers",
        "native",
        "manual",
    ]
    # An sm_89 (Ada) card is not covered by the sm_90 record.
    fake_cuda["cap"] = (8, 9)
    assert not hardware.cuda_kernels_verified("cuda", torch.bfloat16, 64)


def test_native_on_simt_kernels_is_a_slow_path_saying_why(fake_cuda):
    """The selection's SlowPathWarning (backends.advice.slow_path) for half precision on the SIMT
    kernels says why, from the one statement of the rule (hardware.simt_reason)."""
    from dilated_attention.backends import BackendRequest
    from dilated_attention.backends.advice import slow_path

    def why(dtype, head_dim):
        return slow_path("native", BackendRequest(torch.device("cuda", 0), dtype, head_dim))

    fake_cuda["cap"] = (7, 5)
    assert re.search(
        r"float16 inputs of head dim 64 .* SIMT CUDA kernels, .* the GPU is sm_75", why(torch.float16, 64)
    )
    fake_cuda["cap"] = (9, 0)
    assert re.search("bfloat16 inputs of head dim 20 .* the head dim is 20", why(torch.bfloat16, 20))
    assert why(torch.bfloat16, 128) is None  # tensor cores
    assert why(torch.float32, 20) is None  # no tensor-core kernels to miss
    assert hardware.uses_simt_kernels("cuda", torch.bfloat16, 20) and not hardware.uses_simt_kernels(
        "cuda", torch.bfloat16, 64
    )


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


def test_a_speed_measurement_orders_native(fake_cuda, verified, monkeypatch):
    """A benchmark that measured native slower than the gather path on a capability puts native
    after sdpa there; one that measured it faster, or none, leaves it first."""
    fake_cuda["cap"] = (8, 6)
    verified(True)
    assert hardware.recommended_backends("cuda", torch.bfloat16, 64)[0] == "native"
    slow = hardware.SpeedMeasurement("FAKE GPU", "0123abc", "2026-11-24", 0.5, "table.md")
    monkeypatch.setattr(hardware, "CUDA_SPEED_MEASURED", {(8, 6): slow})
    assert hardware.native_measured_slower("cuda")
    order = hardware.recommended_backends("cuda", torch.bfloat16, 64)
    assert order.index("native") == order.index("sdpa") + 1
    fast = hardware.SpeedMeasurement("FAKE GPU", "0123abc", "2026-11-24", 1.5, "table.md")
    monkeypatch.setattr(hardware, "CUDA_SPEED_MEASURED", {(8, 6): fast})
    assert not hardware.native_measured_slower("cuda")
    assert hardware.recommended_backends("cuda", torch.bfloat16, 64)[0] == "native"
    assert not hardware.native_measured_slower("cpu")


def test_a_speed_measurement_orders_sdpa(fake_cuda, verified, monkeypatch):
    """A benchmark that measured sdpa faster than the gather path in every configuration puts it
    before flash_attn_2 and xformers on that capability (flash_attn_3 keeps its place); one that
    measured it slower anywhere, or none, leaves the order as it was; float32 still leaves it out."""
    fake_cuda["cap"] = (8, 6)
    verified(False)
    base = ["flash_attn_2", "xformers", "sdpa", "manual"]
    monkeypatch.setattr(hardware, "CUDA_SPEED_MEASURED", {})
    assert hardware.recommended_backends("cuda", torch.bfloat16, 64) == base
    faster = hardware.SpeedMeasurement("FAKE GPU", "0123abc", "2026-11-24", 0.5, "table.md", 1.1)
    monkeypatch.setattr(hardware, "CUDA_SPEED_MEASURED", {(8, 6): faster})
    assert hardware.sdpa_measured_faster("cuda") and not hardware.sdpa_measured_faster("cpu")
    assert hardware.recommended_backends("cuda", torch.bfloat16, 64) == [
        "sdpa",
        "flash_attn_2",
        "xformers",
        "manual",
    ]
    assert "sdpa" not in hardware.recommended_backends("cuda", torch.float32, 64)
    slower = hardware.SpeedMeasurement("FAKE GPU", "0123abc", "2026-11-24", 0.5, "table.md", 0.9)
    monkeypatch.setattr(hardware, "CUDA_SPEED_MEASURED", {(8, 6): slower})
    assert hardware.recommended_backends("cuda", torch.bfloat16, 64) == base


def test_speed_measurements_name_committed_tables():
    root = Path(__file__).resolve().parents[2]
    for cap, record in hardware.CUDA_SPEED_MEASURED.items():
        table = root / record.table
        assert table.is_file(), (cap, record.table)
        assert record.gpu in table.read_text()


@pytest.mark.parametrize("cap", [(6, 1), (7, 5), (8, 0), (9, 0), (10, 0)])
@pytest.mark.parametrize("is_verified", [False, True])
def test_auto_leaves_sdpa_out_for_float32_on_cuda(fake_cuda, verified, cap, is_verified):
    """PyTorch's float32 CUDA kernel misses the float32 accuracy rule: auto never takes sdpa for
    float32 there (it still does for float16/bfloat16, and sdpa by name still runs)."""
    fake_cuda["cap"] = cap
    verified(is_verified)
    order = hardware.recommended_backends("cuda", torch.float32, 64)
    assert "sdpa" not in order and order[-1] == "manual"
    assert ("native" in order) == is_verified
    assert "sdpa" in hardware.recommended_backends("cuda", torch.float16, 64)
