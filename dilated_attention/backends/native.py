"""``native``: the project's fused C++/CUDA kernels (``torch.ops.dilated_attention.fwd/bwd``).

Every branch in one pass with one online softmax per query; no gathered copies, no per-branch
outputs. Attention dropout runs inside the CPU and the CUDA kernels: a counter-based mask
(csrc/dropout.h) that the backward draws again, the same on both devices for the same seed and
offset.
"""

from __future__ import annotations

import torch

from .. import op
from .base import Backend, BackendRequest, check_device_dtype

__all__ = ["NativeBackend"]

_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}


class NativeBackend(Backend):
    name = "native"

    def reasons(self, request: BackendRequest) -> list[str]:
        why = []
        dev = request.device.type
        if dev not in ("cpu", "cuda"):
            return [f"native has kernels for cpu and cuda only, got {request.device}"]
        if op.EXTENSION_ERROR is not None:
            why.append(op.EXTENSION_ERROR)
        elif not op.has_kernel(dev):
            why.append(f"the extension was built without {dev.upper()} kernels")
        else:
            from .. import hardware

            unavailable = hardware.device_unavailable(request.device)
            if unavailable:
                why.append(unavailable)
        why += check_device_dtype(request, "native", _DTYPES)
        return why

    def forward(self, q, k, v, segment_lengths, dilation_rates, *, is_causal, softmax_scale, dropout_p=0.0):
        return op.native_forward(
            q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, dropout_p
        )

    def varlen_reads_lengths(self, q, k, v, dropout_p):
        return False  # the op reads cu_seqlens itself

    def forward_varlen(
        self, q, k, v, packed, segment_lengths, dilation_rates, *, is_causal, softmax_scale, dropout_p=0.0
    ):
        return op.native_varlen_forward(
            q,
            k,
            v,
            packed.cu_seqlens,
            packed.max_seqlen,
            segment_lengths,
            dilation_rates,
            is_causal,
            softmax_scale,
            dropout_p,
        )
