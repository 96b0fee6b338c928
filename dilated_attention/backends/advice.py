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

    * ``native`` on CUDA runs float16/bfloat16 on its tensor-core kernels only on compute
      capability >= 8.0 with a head dim of 32-256 that is a multiple of 8 (docs/cuda.md); anything
      else goes to the SIMT kernels, which convert every tile to float32.
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
    if name == "native" and request.device.type == "cuda":
        cap = hardware.compute_capability(request.device)
        D = request.head_dim
        if cap is not None and cap < (8, 0):
            return (
                f"{dt} on compute capability {cap[0]}.{cap[1]} runs the native SIMT kernels (the "
                f"tensor-core kernels need 8.0 or newer); float32 is about as fast there"
            )
        if D < 32 or D > 256 or D % 8:
            return (
                f"{dt} with head dim {D} runs the native SIMT kernels (the tensor-core kernels need a "
                f"head dim of 32-256 that is a multiple of 8)"
            )
    return None
