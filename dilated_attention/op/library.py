"""Loads the compiled extension ``dilated_attention._C`` (which registers the ops of
``csrc/dilated_attention.cpp``) and says what it has: :data:`EXTENSION_ERROR` (why it could not be
loaded, or None), :func:`has_kernel`, :func:`cpu_isa`; and the small facts every op module shares
(:func:`lse_dtype`, :func:`dropout_seed_offset`). Nothing here imports another module of the room.
"""

from __future__ import annotations

import importlib
import json
import os
from types import ModuleType
from typing import Any

import torch

from .._validation import accumulation_dtype
from .._warnings import ExtensionWarning, warn_once

__all__ = [
    "EXTENSION_ERROR",
    "cpu_isa",
    "dropout_seed_offset",
    "has_kernel",
    "lse_dtype",
]

_REBUILD = (
    "Build it against the torch you run: `pip install --no-build-isolation -e .` (or `make install`) "
    "in the source tree, or `pip install --no-build-isolation .` for a copy"
)
_BUILD_HINT = _REBUILD + (
    ". Until then no backend runs: it holds native's kernels and the plan of the other backends' kernel calls"
)


def _load_extension() -> tuple[ModuleType | None, str | None]:
    """Import ``dilated_attention._C`` (which registers the op): ``(module, None)``, or ``(None, why)``."""
    name = f"{__package__.rpartition('.')[0]}._C"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return None, (
            f"the compiled extension {name} is not built: {here} has no _C*.so (an unbuilt source "
            f"checkout?). {_BUILD_HINT}."
        )
    except (ImportError, OSError) as exc:
        return None, (
            f"the compiled extension {name} failed to load ({type(exc).__name__}: {exc}). This usually "
            f"means it was built against another PyTorch or Python than the ones running now (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}). {_BUILD_HINT}."
        )
    built = _build_info(module)
    if built is not None and built.get("torch") != torch.__version__:
        warn_once(
            ("extension-torch", built.get("torch"), torch.__version__),
            f"dilated_attention: the compiled extension {getattr(module, '__file__', name)} was built "
            f"against torch {built.get('torch')} (CUDA {built.get('cuda')}) and runs with torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}); a mismatch can fail or crash in the "
            f"kernels. {_REBUILD}.",
            ExtensionWarning,
        )
    missing = [op for op in ("fwd", "bwd") if not hasattr(torch.ops.dilated_attention, op)]
    if missing:
        return None, (
            f"the compiled extension {getattr(module, '__file__', name)} loaded but does not register "
            f"torch.ops.dilated_attention.{', '.join(missing)} (a stale build?). {_BUILD_HINT}."
        )
    return module, None


def _build_info(module: ModuleType) -> dict[str, Any] | None:
    """What ``setup.py`` recorded beside the extension (torch, CUDA, Python), or None."""
    path = os.path.join(os.path.dirname(getattr(module, "__file__", None) or "."), "_build_info.json")
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def build_info() -> dict[str, Any]:
    """What ``setup.py`` recorded of the loaded extension's build (``{}`` where nothing was):
    ``torch``, ``cuda``, ``python``, ``cuda_arch_list`` (what was asked for, or None: the CPU
    kernels only), ``cuda_arch_built`` (the list compiled: 9.0 as 9.0a) and ``cuda_arch_reason``."""
    return (_build_info(_C) if _C is not None else None) or {}


_C: ModuleType | None
EXTENSION_ERROR: str | None
_C, EXTENSION_ERROR = _load_extension()
"""The loaded extension, or None; and why it could not be loaded (None when it was)."""

if EXTENSION_ERROR is not None:
    warn_once(("extension",), f"dilated_attention: {EXTENSION_ERROR}", ExtensionWarning)


def _require_extension() -> ModuleType:
    if _C is None:
        raise RuntimeError(f"dilated_attention: {EXTENSION_ERROR}")
    return _C


def has_kernel(device_type: str) -> bool:
    """Whether the compiled extension has kernels for ``device_type`` ("cpu" or "cuda").

    False for both when the extension is not loaded (see :data:`EXTENSION_ERROR`).
    """
    key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
    if _C is None:
        return False
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attention::fwd", key))


def cpu_isa() -> str:
    """The instruction set the CPU kernels run with in this process: ``"avx512"``, ``"avx2"`` or
    ``"baseline"`` (SSE2 on x86-64, the compiler's default elsewhere). The widest the CPU has, unless
    the environment variable ``DILATED_ATTENTION_CPU_ISA`` names another; a value it does not know,
    or a set the CPU lacks, raises ``ValueError`` naming it. ``RuntimeError`` when the extension is
    not loaded."""
    return str(_require_extension().cpu_isa())


def dropout_seed_offset() -> tuple[int, int]:
    """A seed and an offset for the kernels' dropout generator (csrc/dropout.h), drawn from torch's
    default CPU generator: ``torch.manual_seed`` makes a run's masks reproducible, and every call
    gets new ones."""
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    return int(seed), int(offset)


def lse_dtype(dtype: torch.dtype, float64_lse: bool = False) -> torch.dtype:
    """The dtype of the ops' ``lse`` for inputs of ``dtype``: float64 with ``float64_lse``, else
    the accumulation dtype (csrc/checks.h ``lse_dtype``)."""
    return torch.float64 if float64_lse else accumulation_dtype(dtype)
