"""What the hardware is, and what it recommends: dtype and the order in which ``auto`` tries backends.

============================  ==================  ===================================================
device                        recommended dtype   backend order of ``auto``
============================  ==================  ===================================================
CPU                           float32             native, sdpa, manual
CUDA sm_90 (Hopper)           bfloat16            flash_attn_3, sdpa, flash_attn_2, xformers, native, manual
CUDA sm_80+ (Ampere, Ada...)  bfloat16            native, flash_attn_2, xformers, sdpa, manual
CUDA sm_7x (Volta, Turing)    float16             native, xformers, sdpa, manual
CUDA sm_6x (Pascal) or older  float32             native, xformers, sdpa, manual
other devices (mps, xpu...)   float32             sdpa, manual
============================  ==================  ===================================================

Two rules change the CUDA rows:

* float16/bfloat16 calls that the native CUDA kernels would run on their SIMT kernels (below sm_80,
  or a head dim outside 32..256 or not a multiple of 8; see ``docs/cuda.md``) try ``native`` after
  ``xformers`` and ``sdpa``: without tensor cores it is the slower choice.
* where :data:`CUDA_SPEED_MEASURED` records ``native`` slower than the gather path on a compute
  capability (on sm_90: 0.19-0.47x the speed of gathering into PyTorch's flash kernel, measured on
  an H200, ``benchmarks/results/cuda-h200-bf16-199db38.md``), ``native`` goes after ``sdpa`` there
  too; where it records ``sdpa`` (its C++ driver) faster than that gather path in every
  configuration (on sm_90: 1.12-1.38x), ``sdpa`` goes before ``flash_attn_2`` and ``xformers``
  (gather backends of the same kernel family; ``flash_attn_3`` was not measured): the fastest
  correct path first. Training the example GPT (GPT-2 small shape, block 16K, bf16) on
  an H200 agreed: ``sdpa`` through its C++ driver 0.96x dense attention's speed, ``native`` 0.58x
  (``benchmarks/results/gpu-check-h200-199db38.md``).
* ``auto`` puts ``native`` on CUDA only on a GPU whose compute capability is in
  :data:`CUDA_KERNELS_VERIFIED` (the kernels passed ``scripts/gpu_check.sh`` on such a GPU) for the
  kernel family the call would run (``"tensor-core"`` or ``"simt"``, see :func:`kernel_family`):
  a pass on an H100 (sm_90) says nothing of a Turing (sm_75) or Ada (sm_89) card. Elsewhere
  ``native`` runs on CUDA only when asked for by name (``backend="native"``); this is said once
  per capability and family at INFO.

* float32 on CUDA leaves ``sdpa`` out: the kernel PyTorch runs there for float32 (the
  memory-efficient one) misses the float32 accuracy rule of SPEC section 4 (dk at 3.35x plain
  float32 PyTorch's error on a causal LongNet configuration with grouped-query attention, measured
  on an H200), where ``native`` (verified GPUs) and ``manual`` (plain float32 matmuls) meet it.
  ``backend="sdpa"`` by name still runs it.

Each backend still checks what it can run (package installed, dtype, head dim, dropout); ``auto``
takes the first in this order that can.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

__all__ = [
    "CUDA_KERNELS_VERIFIED",
    "CUDA_SPEED_MEASURED",
    "KERNEL_FAMILIES",
    "HardwareInfo",
    "SpeedMeasurement",
    "Verification",
    "as_device",
    "compute_capability",
    "cuda_kernels_verified",
    "device_name",
    "device_unavailable",
    "hardware_info",
    "kernel_family",
    "native_measured_slower",
    "recommended_backends",
    "recommended_dtype",
    "sdpa_measured_faster",
    "simt_reason",
    "uses_simt_kernels",
]

logger = logging.getLogger(__name__)

#: The two families of the native op's CUDA kernels (docs/cuda.md): tensor-core kernels for
#: float16/bfloat16 on sm_80+ with a head dim in 32..256 that is a multiple of 8, SIMT kernels for
#: everything else.
KERNEL_FAMILIES = ("tensor-core", "simt")


@dataclass(frozen=True)
class Verification:
    """A passing run of ``scripts/gpu_check.sh`` (both of its commands) on one GPU: its name, the
    commit that passed, the date (UTC, ``YYYY-MM-DD``) and the kernel families its tests ran."""

    gpu: str
    commit: str
    date: str
    families: tuple[str, ...] = KERNEL_FAMILIES


@dataclass(frozen=True)
class SpeedMeasurement:
    """A run of ``benchmarks/bench_cuda.py`` on one GPU: its name, the commit, the date (UTC,
    ``YYYY-MM-DD``), the best time ratio of ``native`` over the gather path with PyTorch's flash
    kernel over the configurations measured (> 1: ``native`` faster), the committed table, and
    the worst time ratio of ``sdpa`` (its C++ driver) over that gather path (> 1: ``sdpa`` faster
    in every configuration measured; None: not measured)."""

    gpu: str
    commit: str
    date: str
    native_over_gather: float
    table: str
    sdpa_over_gather: float | None = None


def _load_records() -> tuple[dict[tuple[int, int], Verification], dict[tuple[int, int], SpeedMeasurement]]:
    """The records of ``gpu_records.json`` beside this module (data, not code: a GPU run's commit
    adds an entry there)."""
    with open(os.path.join(os.path.dirname(__file__), "gpu_records.json")) as f:
        data = json.load(f)
    verified = {
        (e["capability"][0], e["capability"][1]): Verification(
            e["gpu"], e["commit"], e["date"], tuple(e["families"])
        )
        for e in data["verified"]
    }
    speed = {
        (e["capability"][0], e["capability"][1]): SpeedMeasurement(
            e["gpu"], e["commit"], e["date"], e["native_over_gather"], e["table"], e.get("sdpa_over_gather")
        )
        for e in data["speed"]
    }
    return verified, speed


#: The compute capabilities ``(major, minor)`` on which the native op's CUDA kernels (csrc/cuda)
#: passed the GPU verification of ``scripts/gpu_check.sh`` (docs/cuda.md), each with its record.
#: ``auto`` picks ``native`` on CUDA only on these capabilities and for the families recorded.
#: The capabilities on which ``benchmarks/bench_cuda.py`` compared ``native`` and ``sdpa`` with the
#: gather path: where ``native`` was slower (ratio < 1), ``auto`` tries it after ``sdpa``; where
#: ``sdpa`` was faster in every configuration, ``auto`` tries it before the gather backends that run
#: PyTorch's kernel family (``flash_attn_2``, ``xformers``); ``flash_attn_3`` keeps its place. Both
#: come from ``gpu_records.json``, where a commit that records a GPU run adds its entry.
CUDA_KERNELS_VERIFIED, CUDA_SPEED_MEASURED = _load_records()


def _speed_record(device: DeviceLike) -> SpeedMeasurement | None:
    cap = compute_capability(device)
    return CUDA_SPEED_MEASURED.get(cap) if cap is not None else None


def sdpa_measured_faster(device: DeviceLike = None) -> bool:
    """Whether a benchmark on this device's compute capability measured ``sdpa`` faster than the
    gather path in every configuration (:data:`CUDA_SPEED_MEASURED`). False where not measured."""
    record = _speed_record(device)
    return record is not None and record.sdpa_over_gather is not None and record.sdpa_over_gather > 1.0


def native_measured_slower(device: DeviceLike = None) -> bool:
    """Whether a benchmark on this device's compute capability measured ``native`` slower than the
    gather path (:data:`CUDA_SPEED_MEASURED`). False where nothing was measured."""
    record = _speed_record(device)
    return record is not None and record.native_over_gather < 1.0


_said: set[tuple] = set()

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


def simt_reason(device: DeviceLike, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the native CUDA op runs float16/bfloat16 inputs of this head dim on its SIMT kernels (no
    tensor cores), e.g. ``"the GPU is sm_75"``; None where it runs them on its tensor-core kernels,
    for float32/float64 (they have no tensor-core kernels to miss) and for devices that are not
    CUDA GPUs. The one statement of the rule (docs/cuda.md): the tensor-core kernels need sm_80+
    and a head dim in 32..256 that is a multiple of 8."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    cap = compute_capability(device)
    if cap is None:
        return None
    if cap < (8, 0):
        return f"the GPU is sm_{cap[0]}{cap[1]}"
    if not (32 <= head_dim <= 256 and head_dim % 8 == 0):
        return f"the head dim is {head_dim}"
    return None


def uses_simt_kernels(device: DeviceLike, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the native CUDA op runs float16/bfloat16 inputs of this head dim on its SIMT kernels
    (:func:`simt_reason` says why)."""
    return simt_reason(device, dtype, head_dim) is not None


def kernel_family(device: DeviceLike, dtype: torch.dtype, head_dim: int) -> str | None:
    """``"tensor-core"`` or ``"simt"``: the family of native CUDA kernels that inputs of this dtype
    and head dim run on ``device``; None for devices that are not CUDA GPUs."""
    if compute_capability(device) is None:
        return None
    if dtype not in (torch.float16, torch.bfloat16) or uses_simt_kernels(device, dtype, head_dim):
        return "simt"
    return "tensor-core"


def cuda_kernels_verified(
    device: DeviceLike = None, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> bool:
    """Whether the native CUDA kernels passed ``scripts/gpu_check.sh`` on a GPU of this device's
    compute capability, for the kernel family that ``dtype`` and ``head_dim`` run on (None: the
    recommended dtype and head dim 64). False for devices that are not CUDA GPUs."""
    cap = compute_capability(device)
    record = CUDA_KERNELS_VERIFIED.get(cap) if cap is not None else None
    if record is None:
        return False
    family = kernel_family(
        device,
        dtype if dtype is not None else recommended_dtype(device),
        64 if head_dim is None else head_dim,
    )
    return family in record.families


def recommended_backends(
    device: DeviceLike = None, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> list[str]:
    """The order in which ``auto`` tries the backends on ``device`` (fastest first) for inputs of
    ``dtype`` and ``head_dim`` (None: any; they matter on CUDA only, see the module doc)."""
    dev = as_device(device)
    if dev.type == "cpu":
        return ["native", "sdpa", "manual"]
    if dev.type != "cuda":
        return ["sdpa", "manual"]
    cap = compute_capability(dev)
    order = []
    if cap is None or cap[0] == 9:  # cap None: CUDA asked for but not there; the backends say why
        order.append("flash_attn_3")
    if cap is None or cap >= (8, 0):
        order.append("flash_attn_2")
    order += ["xformers", "sdpa"]
    if sdpa_measured_faster(dev):  # before the gather backends of PyTorch's kernel family
        order.remove("sdpa")
        first_gather = next((i for i, n in enumerate(order) if n in ("flash_attn_2", "xformers")), len(order))
        order.insert(first_gather, "sdpa")
    if dtype == torch.float32:
        order.remove("sdpa")
        _say_once(
            ("sdpa-float32",),
            "dilated_attention: backend='auto' does not choose sdpa for float32 on CUDA: PyTorch's "
            "float32 kernel there misses the float32 accuracy rule (docs/backends.md); pass "
            "backend='sdpa' to run it anyway",
        )
    if cuda_kernels_verified(dev, dtype, head_dim):
        simt = dtype is not None and uses_simt_kernels(dev, dtype, head_dim if head_dim is not None else 64)
        order.insert(len(order) if simt or native_measured_slower(dev) else 0, "native")
    else:
        _say_unverified(dev, cap, dtype, head_dim)
    return [*order, "manual"]


def _say_once(key: tuple, message: str) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen."""
    if key in _said:
        return
    _said.add(key)
    logger.info("%s", message)


def _say_unverified(
    dev: torch.device, cap: tuple[int, int] | None, dtype: torch.dtype | None, head_dim: int | None
) -> None:
    family = kernel_family(dev, dtype if dtype is not None else recommended_dtype(dev), head_dim or 64)
    here = f"sm_{cap[0]}{cap[1]}" if cap is not None else "this GPU"
    done = ", ".join(
        f"sm_{c[0]}{c[1]} ({v.gpu}, {'/'.join(v.families)}, commit {v.commit})"
        for c, v in sorted(CUDA_KERNELS_VERIFIED.items())
    )
    _say_once(
        (cap, family or "-"),
        f"dilated_attention: the native CUDA kernels ({family} family) have not been verified on {here} "
        f"(verified on: {done or 'no GPU yet'}), so backend='auto' does not choose them there (it takes "
        "flash_attn_3/flash_attn_2, xformers or sdpa); pass backend='native' to run them, and "
        "scripts/gpu_check.sh verifies them on this GPU",
    )


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
