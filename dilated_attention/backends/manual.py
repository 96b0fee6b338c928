"""``manual``: explicit matmul + softmax in PyTorch on the dilated sub-sequences (strided views); autograd end to end.

Runs anywhere PyTorch runs, in every floating dtype, with dropout and grouped-query attention.
It computes one precision up (:meth:`ManualBackend.compute_dtype`): float32 for float16/bfloat16
inputs, float64 for float32 and float64 (float32 where the device has no float64, as mps), and
rounds out, lse and the gradients once. Run in float32 itself, its scores (the dot products of the
dilated sub-sequences, summed in another order than a dense matmul's) and its branch merge carry
roundings of their own which, at large logits (standard deviation 32-64), put its gradients past
twice plain PyTorch's error (SPEC section 4) in about 3% of random cases. It materialises a
(m x m) score matrix per sub-sequence (``m = w / r``), so it is the slowest backend and the last
resort of every fallback chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BackendRequest, lse_dtype
from .driver import StridedBackend

__all__ = ["ManualBackend"]


class ManualBackend(StridedBackend):
    name = "manual"

    def reasons(self, request: BackendRequest) -> list[str]:
        from .. import hardware

        why = []
        unavailable = hardware.device_unavailable(request.device)
        if unavailable:
            why.append(unavailable)
        if not request.dtype.is_floating_point:
            why.append(f"manual needs a floating dtype, got {request.dtype}")
        return why

    computes_in_accumulation_dtype = True

    #: Compute float32 inputs in float64 (module docstring); False: in float32.
    float32_in_float64 = True

    def compute_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """float64 for float32 inputs (float32 on mps, which has no float64, or with
        :attr:`float32_in_float64` off), float32 for float16 and bfloat16, float64 for float64."""
        if dtype == torch.float32 and self.float32_in_float64 and device.type != "mps":
            return torch.float64
        return lse_dtype(dtype)

    def native_gqa(self, device: torch.device) -> bool:
        return True

    def attn_autograd(self, q, k, v, *, is_causal, scale, dropout_p, compute_dtype=None):
        Bb, m, H, D = q.shape
        Hk = k.shape[2]
        g = H // Hk
        ct = compute_dtype or lse_dtype(q.dtype)
        qc = q.to(ct).view(Bb, m, Hk, g, D)
        s = torch.einsum("bikgd,bjkd->bkgij", qc, k.to(ct)) * scale  # (Bb, Hk, g, m, m)
        if is_causal:
            future = torch.ones(m, m, dtype=torch.bool, device=q.device).triu_(1)
            s = s.masked_fill(future, float("-inf"))
        # A row whose every score is -inf (e.g. an infinite query against opposite keys) has no
        # weight anywhere: out 0 and lse -inf (SPEC section 3), with zero gradients, not NaN.
        mx = s.detach().amax(dim=-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        e = torch.exp(s - mx)
        total = e.sum(dim=-1, keepdim=True)
        empty = total == 0  # a NaN score keeps its NaN (total NaN is not empty)
        total = torch.where(empty, torch.ones_like(total), total)
        lse = torch.where(empty, torch.full_like(total, float("-inf")), torch.log(total) + mx)[..., 0]
        p = e / total
        if dropout_p > 0:
            p = F.dropout(p, p=dropout_p, training=True)
        out = torch.einsum("bkgij,bjkd->bikgd", p, v.to(ct)).reshape(Bb, m, H, D)
        return out, lse.reshape(Bb, H, m)
