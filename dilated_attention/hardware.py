"""What the hardware is, and what it recommends: dtype and the order in which ``auto`` tries backends.

============================  ==================  ===================================================
device                        recommended dtype   backend order of ``auto``
============================  ==================  ===================================================
CPU                           float32             native, sdpa, manual
CUDA sm_9x (Hopper)           bfloat16            native, flash_attn_3, flash_attn_2, xformers, sdpa, manual
CUDA sm_80+ (Ampere, Ada...)  bfloat16            native, flash_attn_2, xformers, sdpa, manual
CUDA sm_7x (Volta, Turing)    float16             native, xformers, sdpa, manual
CUDA sm_6x (Pascal) or older  float32             native, xformers, sdpa, manual
other devices (mps, xpu...)   float32             sdpa, manual
============================  ==================  ===================================================

Each backend still checks what it can run (package installed, dtype, head dim, dropout); ``auto``
takes the first in this order that can.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = [
    "HardwareInfo",
    "as_device",
    "compute_capability",
    "device_name",
    "device_unavailable",
    "hardware_info",
    "recommended_backends",
    "recommended_dtype",
]

DeviceLike = str | int | torch.device | None


def as_device(device: DeviceLike = None) -> torch.device:
    """A ``torch.device``; None means ``cuda`` when CUDA is available, else ``cpu``.

    An int is a CUDA device index. A bare ``"cuda"`` gets the current CUDA device's index when
    CUDA is available.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, bool):
        raise TypeError(f"device must be a str, int or torch.device, got {device!r}")
    if isinstance(device, int):
        device = torch.device("cuda", device)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"unknown device {device!r}: {exc}") from None
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a str, int or torch.device, got {type(device).__name__}")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_unavailable(device: DeviceLike) -> str | None:
    """Why ``device`` cannot be used here, or None when it can."""
    dev = as_device(device)
    if dev.type in ("cpu", "meta"):
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"there is no CUDA device {dev.index} ({torch.cuda.device_count()} found)"
        return None
    module = getattr(torch, dev.type, None) if dev.type != "mps" else getattr(torch.backends, "mps", None)
    available = getattr(module, "is_available", None)
    if callable(available) and not available():
        return f"{dev.type} is not available"
    return None


def compute_capability(device: DeviceLike = None) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device; None for other devices or when CUDA is unavailable."""
    dev = as_device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def device_name(device: DeviceLike = None) -> str:
    """The GPU's name, or the device type for other devices."""
    dev = as_device(device)
    if dev.type == "cuda" and compute_capability(dev) is not None:
        return torch.cuda.get_device_name(dev.index if dev.index is not None else torch.cuda.current_device())
    return dev.type


def recommended_dtype(device: DeviceLike = None) -> torch.dtype:
    """bfloat16 on sm_80+, float16 on sm_7x, float32 on sm_6x and older, on CPU and elsewhere."""
    cap = compute_capability(device)
    if cap is None:
        return torch.float32
    if cap[0] >= 8:
        return torch.bfloat16
    if cap[0] == 7:
        return torch.float16
    return torch.float32


def recommended_backends(device: DeviceLike = None) -> list[str]:
    """The order in which ``auto`` tries the backends on ``device`` (fastest first)."""
    dev = as_device(device)
    if dev.type == "cpu":
        return ["native", "sdpa", "manual"]
    if dev.type != "cuda":
        return ["sdpa", "manual"]
    cap = compute_capability(dev)
    if cap is None:  # CUDA asked for but not there: the backends will say why they cannot run
        return ["native", "flash_attn_3", "flash_attn_2", "xformers", "sdpa", "manual"]
    order = ["native"]
    if cap[0] == 9:
        order.append("flash_attn_3")
    if cap >= (8, 0):
        order.append("flash_attn_2")
    order += ["xformers", "sdpa", "manual"]
    return order


@dataclass(frozen=True)
class HardwareInfo:
    """A summary of one device."""

    device: str
    name: str
    capability: tuple[int, int] | None
    recommended_dtype: torch.dtype
    recommended_backends: list[str] = field(default_factory=list)

    @property
    def architecture(self) -> str:
        if self.capability is None:
            return "-"
        major = self.capability[0]
        names = {
            6: "Pascal",
            7: "Volta/Turing",
            8: "Ampere/Ada",
            9: "Hopper",
            10: "Blackwell",
            12: "Blackwell",
        }
        return f"sm_{major}{self.capability[1]} ({names.get(major, 'unknown')})"


def hardware_info(device: DeviceLike = None) -> HardwareInfo:
    dev = as_device(device)
    return HardwareInfo(
        str(dev), device_name(dev), compute_capability(dev), recommended_dtype(dev), recommended_backends(dev)
    )
