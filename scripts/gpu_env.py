"""What this machine offers the GPU check, in one line each, and whether the build can run.

Prints Python, setuptools (>= 77 reads pyproject.toml's PEP 639 ``license`` field), ninja on PATH,
nvcc, torch with its CUDA and cuDNN versions, the GPU, the driver, compute-sanitizer, pytest and
pytest-xdist. With ``--need-build``, exits 3 with one line per missing piece when the extension
cannot be built here. Imports nothing of the package (it may not be built yet).

    python scripts/gpu_env.py [--need-build]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys

MIN_SETUPTOOLS = (77, 0)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def report() -> tuple[list[str], list[str]]:
    """(lines to print, what the build lacks)."""
    lines, missing = [f"python           {sys.version.split()[0]} ({sys.executable})"], []
    st = _version("setuptools")
    ok = st is not None and _tuple(st) >= MIN_SETUPTOOLS
    lines.append(f"setuptools       {st or 'not installed'} ({'ok' if ok else 'needs >= 77'})")
    if not ok:
        missing.append(
            f"setuptools {st or '(none)'}: the build needs setuptools >= 77 (pyproject.toml's license field, "
            "PEP 639); carry a wheel (pip download setuptools) and install it first"
        )
    ninja = shutil.which("ninja")
    lines.append(
        f"ninja            {ninja or 'not on PATH'} {_run([ninja, '--version']).strip() if ninja else ''}"
    )
    if not ninja:
        missing.append("ninja is not on PATH: torch's extension build needs it (pip install ninja)")
    nvcc = shutil.which("nvcc")
    m = re.search(r"release ([\d.]+)", _run([nvcc, "--version"])) if nvcc else None
    lines.append(f"nvcc             {m.group(1) if m else 'not found'} ({nvcc or 'not on PATH'})")
    if not nvcc:
        missing.append("nvcc is not on PATH (put the CUDA toolkit's bin/ on PATH or set CUDA_HOME)")
    try:
        import torch
    except ImportError as exc:
        missing.append(f"torch cannot be imported: {exc}")
        return [*lines, f"torch            not importable ({exc})"], missing
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(f"torch            {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {cudnn})")
    if torch.version.cuda is None:
        missing.append(
            f"torch {torch.__version__} is not a CUDA build: the CUDA kernels cannot link against it"
        )
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            mem = torch.cuda.get_device_properties(i).total_memory / 2**30
            lines.append(
                f"GPU {i}            {torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]}, {mem:.0f} GiB)"
            )
    else:
        lines.append("GPU              none visible to torch")
    smi = shutil.which("nvidia-smi")
    driver = (
        _run([smi, "--query-gpu=driver_version", "--format=csv,noheader"]).strip().splitlines() if smi else []
    )
    lines.append(f"driver           {driver[0] if driver else 'unknown (no nvidia-smi)'}")
    san = shutil.which("compute-sanitizer")
    lines.append(f"compute-sanitizer {san or 'not on PATH'}")
    lines.append(
        f"pytest           {_version('pytest') or 'not installed'}, pytest-xdist {_version('pytest-xdist') or 'no'}"
    )
    expect = _version("expecttest")
    lines.append(
        f"expecttest       {expect or 'not installed: the opcheck tests fail without it (carry a wheel)'}"
    )
    return lines, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--need-build", action="store_true", help="exit 3 when the extension cannot be built here")
    args = p.parse_args(argv)
    lines, missing = report()
    for line in lines:
        print(f"gpu_env: {line}")
    if args.need_build and missing:
        for m in missing:
            print(f"gpu_env: cannot build: {m}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
