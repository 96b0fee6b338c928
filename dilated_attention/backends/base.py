"""What every backend is: a name, a declaration of what it can run, and ``forward``."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import op
from .._validation import accumulation_dtype as lse_dtype

__all__ = [
    "CAPABILITIES",
    "Backend",
    "BackendRequest",
    "Capabilities",
    "Packed",
    "cuda_reasons",
    "dtype_name",
    "import_optional",
    "lse_dtype",
]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def import_optional(name: str) -> tuple[object | None, str | None]:
    """Import an optional package: ``(module, None)``, or ``(None, reason)`` when it cannot be."""
    try:
        return importlib.import_module(name), None
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing and (name == missing or name.startswith(missing + ".")):
            return None, f"{missing} is not installed"
        return None, f"{name} failed to import ({type(exc).__name__}: {exc})"
    except Exception as exc:  # a broken install (bad .so, ABI mismatch) must not break selection
        return None, f"{name} failed to import ({type(exc).__name__}: {exc})"


#: Why a backend whose kernels drop each call's weights cannot apply dropout to several branches.
BRANCH_DROPOUT = (
    "attention dropout over several branches drops the merged weights (SPEC section 3), and its "
    "kernels drop each branch's weights on their own, so a key read through two branches would be "
    "dropped twice, independently"
)


@dataclass(frozen=True)
class BackendRequest:
    """The facts about a call that decide which backends can run it."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    dropout: bool = False
    num_heads: int = 1
    num_kv_heads: int = 1
    #: Dropout over several branches: the *merged* weights are dropped (SPEC section 3), which only
    #: a backend whose kernels see every branch of a row at once can do.
    merged_dropout: bool = False

    @classmethod
    def from_tensors(
        cls, q: torch.Tensor, k: torch.Tensor, dropout_p: float = 0.0, branches: int = 1
    ) -> BackendRequest:
        dropout = bool(dropout_p > 0)
        return cls(
            q.device,
            q.dtype,
            int(q.shape[-1]),
            dropout,
            int(q.shape[2]),
            int(k.shape[2]),
            dropout and branches > 1,
        )

    @property
    def cache_key(self) -> tuple:
        """The part of the request that capability depends on (heads never do: GQA always runs)."""
        return (self.device, self.dtype, self.head_dim, self.dropout, self.merged_dropout)

    def describe(self) -> str:
        s = f"{self.device} {dtype_name(self.dtype)}, head dim {self.head_dim}"
        return s + (
            ", dropout over several branches" if self.merged_dropout else ", dropout" if self.dropout else ""
        )


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it can run, for the docs and the environment report."""

    needs: str
    devices: str
    dtypes: str
    dropout: bool
    gqa: str
    head_dims: str = "1..256"
    backward: str = ""


#: What each backend declares, by name: one table for the docs and the environment report.
CAPABILITIES: dict[str, Capabilities] = {
    "native": Capabilities(
        needs="the compiled extension (CPU kernels always; CUDA kernels when built with nvcc)",
        devices="cpu, cuda (where built)",
        dtypes="float16, bfloat16, float32 (float64 on cpu)",
        dropout=True,
        gqa="native",
        backward="fused backward kernel",
    ),
    "flash_attn_3": Capabilities(
        needs="FlashAttention-3 (module flash_attn_interface), CUDA compute capability 9.x (Hopper)",
        devices="cuda",
        dtypes="float16, bfloat16",
        dropout=False,
        gqa="native",
        backward="FlashAttention backward (out) + one extra call for the lse gradient",
    ),
    "flash_attn_2": Capabilities(
        needs="flash_attn 2.x, CUDA compute capability >= 8.0",
        devices="cuda",
        dtypes="float16, bfloat16",
        dropout=True,
        gqa="native",
        backward="FlashAttention backward (out) + one extra call for the lse gradient",
    ),
    "xformers": Capabilities(
        needs="xformers, CUDA compute capability >= 6.0",
        devices="cuda",
        dtypes="float16, bfloat16, float32",
        dropout=True,
        gqa="repeated k/v heads",
        backward="memory_efficient_attention_backward fed the merged out/lse; autograd with dropout",
    ),
    "sdpa": Capabilities(
        needs="PyTorch (ATen fused attention operators that return the log-sum-exp)",
        devices="cpu, cuda",
        dtypes="cpu: float16, bfloat16, float32, float64; cuda: float16, bfloat16, float32",
        dropout=True,
        gqa="cpu: native; cuda: repeated k/v heads",
        head_dims="1..256 (cuda: multiple of 8)",
        backward="kernel backward fed the merged out/lse (cpu: exact matmul backward); autograd with dropout",
    ),
    "manual": Capabilities(
        needs="PyTorch only",
        devices="any",
        dtypes="float16, bfloat16, float32, float64",
        dropout=True,
        gqa="native",
        backward="autograd end to end",
    ),
}


class Packed(NamedTuple):
    """Where the sequences of a packed call start and end (SPEC section 7)."""

    cu_seqlens: torch.Tensor  # int32 (S + 1,): sequence s is rows cu_seqlens[s]:cu_seqlens[s + 1]
    max_seqlen: int  # the longest sequence
    lengths: Sequence[int] | None  # the S lengths read on the host; None where the backend needs none


class Backend:
    """Base class. Subclasses set ``name`` (a key of :data:`CAPABILITIES`) and implement ``reasons``
    and ``forward``."""

    name: str = ""
    #: Whether the backend's dropout drops the merged weights of all branches (SPEC section 3);
    #: the gather-based backends drop each kernel call's own weights, which differs with several
    #: branches (a key that two branches find would be dropped twice, independently).
    drops_merged_weights: bool = True

    @property
    def capabilities(self) -> Capabilities:
        """What this backend declares it can run (its row of :data:`CAPABILITIES`)."""
        return CAPABILITIES[self.name]

    def reasons(self, request: BackendRequest) -> list[str]:
        """Why this backend cannot run ``request``; an empty list when it can."""
        raise NotImplementedError

    def all_reasons(self, request: BackendRequest) -> list[str]:
        """:meth:`reasons`, and the rules that hold for every backend (dropout over several
        branches needs the merged weights, and every backend needs the compiled extension: native
        for its kernels, the others for the plan of their calls): what selection goes by."""
        why = list(self.reasons(request))
        if op.EXTENSION_ERROR is not None and op.EXTENSION_ERROR not in why:
            why.insert(0, op.EXTENSION_ERROR)
        if request.merged_dropout and not self.drops_merged_weights:
            why.append(f"{BRANCH_DROPOUT} (use native)")
        return why

    def can_run(self, request: BackendRequest) -> bool:
        return not self.all_reasons(request)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        is_causal: bool,
        softmax_scale: float,
        dropout_p: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dilated attention (SPEC sections 2-3): ``out`` (B, N, Hq, D) in q's dtype and ``lse``
        (B, Hq, N) in float32 (float64 for float64 inputs). Arguments are already validated."""
        raise NotImplementedError

    def varlen_reads_lengths(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
    ) -> bool:
        """Whether :meth:`forward_varlen` needs the sequence lengths on the host (read from
        ``cu_seqlens`` before the call; a ``cu_seqlens`` without data, under torch.compile or on
        the meta device, then raises). False for a backend whose op reads ``cu_seqlens`` itself."""
        return True

    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        packed: Packed,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        is_causal: bool,
        softmax_scale: float,
        dropout_p: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed sequences (SPEC section 7): q (T, Hq, D), k and v (T, Hkv, D), the sequences'
        boundaries in ``packed``. Returns ``out`` (T, Hq, D) and ``lse`` (Hq, T). Arguments are
        validated."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<dilated attention backend {self.name!r}>"


def check_device_dtype(
    request: BackendRequest, name: str, dtypes_by_device: Mapping[str, Sequence[torch.dtype]]
) -> list[str]:
    """Reasons from a table ``{device type: supported dtypes}``."""
    dev = request.device.type
    if dev not in dtypes_by_device:
        return [f"{name} runs on {' or '.join(dtypes_by_device)} devices, got {request.device}"]
    ok = dtypes_by_device[dev]
    if request.dtype not in ok:
        names = ", ".join(dtype_name(d) for d in ok)
        return [f"{name} on {dev} supports {names}, got {dtype_name(request.dtype)}"]
    return []


def cuda_reasons(
    request: BackendRequest,
    name: str,
    dtypes: Sequence[torch.dtype],
    lowest: tuple[int, int] = (0, 0),
    highest_major: int | None = None,
) -> list[str]:
    """Reasons of a backend that runs on CUDA devices only: of compute capability ``lowest`` or newer
    (with a major version of at most ``highest_major``, when given), in one of ``dtypes``."""
    if request.device.type != "cuda":
        return [f"{name} needs a CUDA device, got {request.device}"]
    from .. import hardware

    cap = hardware.compute_capability(request.device)
    why = []
    if cap is None:
        why.append("CUDA is not available")
    elif cap < lowest or (highest_major is not None and cap[0] > highest_major):
        wanted = f"{lowest[0]}.{lowest[1]} or newer" if highest_major is None else f"{lowest[0]}.x"
        why.append(
            f"{name} needs compute capability {wanted}, got {cap[0]}.{cap[1]} "
            f"({hardware.device_name(request.device)})"
        )
    return why + check_device_dtype(request, name, {"cuda": dtypes})
