"""``python -m dilated_attention``: what was built, what this machine has, and what can run.

Prints torch and CUDA versions, the GPUs and their compute capability, whether the extension
has CPU and CUDA kernels, every backend and whether it can run (or why not) on the chosen device
and dtype, and the recommended dtype and backend.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch

from . import __version__, hardware, op
from .backends import BACKEND_NAMES, BackendRequest, backend_reasons, get_backend, get_pattern_cache, resolve
from .backends.base import dtype_name
from .backends.sdpa_kernels import cuda_kernel as sdpa_cuda_kernel

_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def _cpu_isa() -> str:
    try:
        return op.cpu_isa()
    except (ValueError, RuntimeError) as exc:  # a bad DILATED_ATTENTION_CPU_ISA, or no extension
        return f"error: {exc}"


SM90_ENV = "DILATED_ATTENTION_CUDA_SM90"


def _sm90_kernels() -> dict[str, Any]:
    """Whether the build has the sm90 (wgmma) kernels' sm_90a code and whether CUDA calls on sm_90
    use them (``DILATED_ATTENTION_CUDA_SM90=1``; not yet verified on a GPU, so off by default)."""
    built = op.library.build_info().get("cuda_arch_built") or ""
    value = os.environ.get(SM90_ENV, "")
    return {
        "built": "9.0a" in built.replace(" ", ";").split(";"),
        "enabled": value in ("1", "true", "yes", "on"),
        "env": SM90_ENV,
        # as the CUDA kernels read it: another value than these is their error
        "invalid_value": None
        if value in ("", "0", "false", "no", "off", "1", "true", "yes", "on")
        else value,
    }


def environment_report(
    device: str | None = None, dtype: str | None = None, head_dim: int = 64, dropout: bool = False
) -> dict[str, Any]:
    """The report as a dictionary (what ``python -m dilated_attention --json`` prints)."""
    dev = hardware.as_device(device)
    dt = hardware.recommended_dtype(dev) if dtype in (None, "auto") else _DTYPES[dtype]
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = hardware.compute_capability(i) or (0, 0)
            gpus.append(
                {
                    "index": i,
                    "name": hardware.device_name(i),
                    "capability": f"{cap[0]}.{cap[1]}",
                    "architecture": hardware.hardware_info(i).architecture,
                    "native_verified": hardware.cuda_kernels_verified(i),
                }
            )
    request = BackendRequest(dev, dt, head_dim, dropout)
    reasons = backend_reasons(request)
    try:
        chosen: str | None = resolve("auto", request).name
    except RuntimeError:
        chosen = None
    info = get_pattern_cache().info()
    return {
        "dilated_attention": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "extension": {
            "file": getattr(op.library._C, "__file__", None),
            "error": op.EXTENSION_ERROR,
            "cpu_kernels": op.has_kernel("cpu"),
            "cpu_isa": _cpu_isa(),
            "cuda_kernels": op.has_kernel("cuda"),
            "cuda_arch_built": op.library.build_info().get("cuda_arch_built"),
            "sm90_kernels": _sm90_kernels(),
        },
        "device": str(dev),
        "dtype": dtype_name(dt),
        "head_dim": head_dim,
        "dropout": dropout,
        "backends": {
            name: {"available": not why, "reasons": why, "capabilities": vars(get_backend(name).capabilities)}
            for name, why in reasons.items()
        },
        "cuda_kernels_verified": {
            f"{c[0]}.{c[1]}": {"gpu": v.gpu, "commit": v.commit, "date": v.date, "families": list(v.families)}
            for c, v in sorted(hardware.CUDA_KERNELS_VERIFIED.items())
        },
        "auto_order": hardware.recommended_backends(dev),
        "recommended_dtype": dtype_name(hardware.recommended_dtype(dev)),
        "recommended_backend": chosen,
        "pattern_cache": info._asdict(),
        "sdpa_cuda_kernel": sdpa_cuda_kernel(dev, dt, head_dim) if dev.type == "cuda" else None,
    }


def format_report(r: dict[str, Any]) -> str:
    yes = {True: "yes", False: "no"}
    lines = [
        f"dilated-attention {r['dilated_attention']}  (Python {r['python']})",
        f"torch            {r['torch']}  (CUDA build: {r['torch_cuda_build'] or 'none'}, "
        f"CUDA available: {yes[r['cuda_available']]})",
    ]
    if r["gpus"]:
        for g in r["gpus"]:
            lines.append(
                f"GPU {g['index']}            {g['name']}, compute capability {g['capability']} "
                f"{g['architecture']}"
            )
    else:
        lines.append("GPU              none")
    verified = r["cuda_kernels_verified"]
    lines.append(
        "native on CUDA   verified on "
        + (
            ", ".join(
                f"sm_{c.replace('.', '')} ({v['gpu']}, {'/'.join(v['families'])})"
                for c, v in verified.items()
            )
            if verified
            else "no GPU yet"
        )
        + "; auto picks it on those only"
    )
    ext = r["extension"]
    if ext.get("error"):
        lines.append(f"extension        not loaded: {ext['error']}")
    else:
        lines.append(
            f"extension        CPU kernels: {yes[ext['cpu_kernels']]} ({ext['cpu_isa']}), "
            f"CUDA kernels: {yes[ext['cuda_kernels']]}"
            f"  ({ext['file']})"
        )
        sm90 = ext["sm90_kernels"]
        if sm90["invalid_value"] is not None:
            use = f"{sm90['env']}={sm90['invalid_value']!r} is not 0 or 1: CUDA calls raise"
        elif sm90["enabled"]:
            use = "in use on sm_90"
        else:
            use = f"off ({sm90['env']}=1 uses them; not yet run on a GPU)"
        lines.append(f"sm90 kernels     wgmma/TMA (sm_90a) in this build: {yes[sm90['built']]}; {use}")
    lines.append("")
    what = f"{r['device']}, {r['dtype']}, head dim {r['head_dim']}" + (", dropout" if r["dropout"] else "")
    lines.append(f"backends for {what}:")
    width = max(len(n) for n in BACKEND_NAMES)
    for name, b in r["backends"].items():
        state = "available" if b["available"] else "unavailable: " + "; ".join(b["reasons"])
        if name == "sdpa" and b["available"] and r.get("sdpa_cuda_kernel"):
            state += f" (CUDA kernel: {r['sdpa_cuda_kernel']})"
        lines.append(f"  {name:<{width}}  {state}")
    lines.append("")
    lines.append(f"auto order       {' -> '.join(r['auto_order'])}")
    backend = r["recommended_backend"] or "none can run"
    lines.append(f"recommended      dtype {r['recommended_dtype']}, backend {backend}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dilated_attention", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default=None, help="device to report on (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *_DTYPES],
        help="dtype to check the backends with (default: the recommended one)",
    )
    parser.add_argument(
        "--head-dim", type=int, default=64, help="head dim to check the backends with (default 64)"
    )
    parser.add_argument("--dropout", action="store_true", help="check the backends for attention dropout")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.head_dim <= 256:
        parser.error(f"--head-dim must be in [1, 256], got {args.head_dim}")
    try:
        report = environment_report(args.device, args.dtype, args.head_dim, args.dropout)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
