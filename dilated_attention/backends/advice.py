"""Which backend choices deserve a warning although they run: float16/bfloat16 on slow kernels.

:func:`slow_path` is asked once per selection (see :mod:`.registry`); its answer, when there is
one, becomes a :class:`~dilated_attention.SlowPathWarning`.
"""

from __future__ import annotations

import torch

from .. import hardware
from .base import BackendRequest, dtype_name

__all__ = ["slow_path"]

_HALF = (torch.float16, torch.bfloat16)


def slow_path(name: str, request: BackendRequest) -> str | None:
    """Why backend ``name`` is slow for the half-precision ``request``, or None.

    * ``native`` on CUDA runs float16/bfloat16 on its SIMT kernels, which convert every tile to
      float32, where :func:`dilated_attention.hardware.simt_reason` says why.
    * ``manual`` computes float16/bfloat16 in float32 with an explicit score matrix per
      sub-sequence, the slowest path of all.
    """
    if request.dtype not in _HALF:
        return None
    dt = dtype_name(request.dtype)
    if name == "manual":
        return (
            f"{dt} inputs run on the manual backend, which computes in float32 with an explicit "
            f"score matrix (the slowest path)"
        )
    if name == "native":
        why = hardware.simt_reason(request.device, request.dtype, request.head_dim)
        if why:
            return (
                f"native runs {dt} inputs of head dim {request.head_dim} on {request.device} with its SIMT "
                f"CUDA kernels, without tensor cores, because {why} (the tensor-core kernels need sm_80+ "
                "and a head dim in 32..256 that is a multiple of 8): expect it to be much slower than "
                "sdpa or xformers, which backend='auto' prefers there"
            )
    return None
