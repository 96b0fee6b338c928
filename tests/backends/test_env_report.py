"""``python -m dilated_attention``: the environment report runs and says what it should."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import dilated_attention
from dilated_attention import __main__ as report


def test_report_runs_as_a_module():
    res = subprocess.run(
        [sys.executable, "-m", "dilated_attention"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert f"dilated-attention {dilated_attention.__version__}" in text
    assert f"torch            {torch.__version__}" in text
    assert f"CPU kernels: yes ({dilated_attention.op.cpu_isa()})" in text
    for name in dilated_attention.BACKEND_NAMES:
        assert f"\n  {name} " in text
    assert "native on CUDA   verified on " in text
    if not torch.cuda.is_available():
        assert "GPU              none" in text
        assert "recommended      dtype float32, backend native" in text
        assert "flash_attn is not installed" in text or "flash_attn_2  available" in text


def test_json_report(capsys):
    assert report.main(["--json", "--dtype", "float64", "--head-dim", "32"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch"] == torch.__version__ and data["dtype"] == "float64" and data["head_dim"] == 32
    assert data["extension"]["cpu_kernels"] is True
    assert data["extension"]["cpu_isa"] in ("avx512", "avx2", "baseline")
    assert set(data["backends"]) == set(dilated_attention.BACKEND_NAMES)
    for b in data["backends"].values():
        assert b["available"] == (not b["reasons"])
        assert {"needs", "devices", "dtypes", "dropout", "gqa"} <= set(b["capabilities"])
    assert data["auto_order"] == dilated_attention.recommended_backends(data["device"])


def test_report_for_another_device_and_dropout(capsys):
    assert report.main(["--device", "meta", "--dropout"]) == 0
    text = capsys.readouterr().out
    assert "backends for meta, float32, head dim 64, dropout:" in text
    assert "  manual        available" in text
    assert "recommended      dtype float32, backend manual" in text


def test_report_with_a_fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "FAKE H100")
    monkeypatch.setattr(dilated_attention.hardware, "CUDA_KERNELS_VERIFIED", {})
    r = report.environment_report(device="cpu")
    assert r["gpus"] == [
        {
            "index": 0,
            "name": "FAKE H100",
            "capability": "9.0",
            "architecture": "sm_90 (Hopper)",
            "native_verified": False,
        }
    ]
    text = report.format_report(r)
    assert "GPU 0            FAKE H100, compute capability 9.0 sm_90 (Hopper)" in text
    assert "native on CUDA   verified on no GPU yet; auto picks it on those only" in text
    record = dilated_attention.hardware.Verification("FAKE H100", "0123abc", "2026-11-24", ("tensor-core",))
    monkeypatch.setattr(dilated_attention.hardware, "CUDA_KERNELS_VERIFIED", {(9, 0): record})
    r = report.environment_report(device="cpu")
    assert r["gpus"][0]["native_verified"] is True
    assert r["cuda_kernels_verified"] == {
        "9.0": {"gpu": "FAKE H100", "commit": "0123abc", "date": "2026-11-24", "families": ["tensor-core"]}
    }
    assert "native on CUDA   verified on sm_90 (FAKE H100, tensor-core)" in report.format_report(r)


@pytest.mark.parametrize("argv", [["--device", "nope"], ["--head-dim", "300"], ["--dtype", "int8"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as info:
        report.main(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_report_says_whether_the_sm90_kernels_are_built_and_used(monkeypatch):
    """The build's record (setup.py: 9.0 compiled as 9.0a) and DILATED_ATTENTION_CUDA_SM90 decide
    the sm90 line: built or not, in use or off."""
    monkeypatch.delenv("DILATED_ATTENTION_CUDA_SM90", raising=False)
    monkeypatch.setattr(dilated_attention.op.library, "build_info", lambda: {"cuda_arch_built": "8.0;9.0a"})
    r = report.environment_report("cpu")
    assert r["extension"]["sm90_kernels"] == {
        "built": True,
        "enabled": False,
        "env": "DILATED_ATTENTION_CUDA_SM90",
        "invalid_value": None,
    }
    assert "sm90 kernels     wgmma/TMA (sm_90a) in this build: yes; off (" in report.format_report(r)
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_SM90", "1")
    monkeypatch.setattr(dilated_attention.op.library, "build_info", lambda: {"cuda_arch_built": "8.0;8.6"})
    r = report.environment_report("cpu")
    assert r["extension"]["sm90_kernels"]["built"] is False and r["extension"]["sm90_kernels"]["enabled"]
    assert "in this build: no; in use on sm_90" in report.format_report(r)
    monkeypatch.setattr(dilated_attention.op.library, "build_info", lambda: {})  # a CPU-only build
    assert report.environment_report("cpu")["extension"]["sm90_kernels"]["built"] is False
    monkeypatch.setenv("DILATED_ATTENTION_CUDA_SM90", "2")  # the CUDA kernels raise on it: said so
    r = report.environment_report("cpu")
    assert (
        r["extension"]["sm90_kernels"]["invalid_value"] == "2"
        and not r["extension"]["sm90_kernels"]["enabled"]
    )
    assert "DILATED_ATTENTION_CUDA_SM90='2' is not 0 or 1: CUDA calls raise" in report.format_report(r)
