"""``xformers``: ``xformers.ops`` memory-efficient attention on the dilated sub-sequences (strided views).

Uses the documented API on (B, M, H, K) tensors:

* ``xformers.ops.fmha.memory_efficient_attention_forward_requires_grad(q, k, v, attn_bias, p=0,
  scale)`` -> ``(out, lse)``, lse (B, H, >= M) (some kernels pad M), and
* ``xformers.ops.fmha.memory_efficient_attention_backward(grad, output, lse, q, k, v, attn_bias,
  p=0, scale)`` -> ``(dq, dk, dv)``,

so that the backward is fed the merged ``out``/``lse`` (the merged path of :mod:`.driver`).
Causal masking is ``xformers.ops.LowerTriangularMask()``. These two functions refuse dropout, so
with ``dropout_p > 0`` the output comes from ``xformers.ops.memory_efficient_attention(...,
p=dropout_p)`` (autograd) and the log-sum-exp from the forward above, given its gradient by
``lse_with_grad``. Key/value heads are repeated for grouped-query attention.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from .base import BackendRequest, cuda_reasons, import_optional, lse_dtype
from .driver import StridedBackend, lse_with_grad

__all__ = ["XformersBackend"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NEEDED = ("memory_efficient_attention", "LowerTriangularMask")
_NEEDED_FMHA = ("memory_efficient_attention_forward_requires_grad", "memory_efficient_attention_backward")


class XformersBackend(StridedBackend):
    name = "xformers"

    def _ops(self) -> Any:
        # Imported (and checked) when the backend was selected: a plain lookup here.
        return sys.modules.get("xformers.ops") or importlib.import_module("xformers.ops")

    def reasons(self, request: BackendRequest) -> list[str]:
        why = []
        xops, missing = import_optional("xformers.ops")
        if xops is None:
            why.append(str(missing).replace("xformers.ops", "xformers"))
        else:
            fmha = getattr(xops, "fmha", None)
            lacks = [n for n in _NEEDED if not hasattr(xops, n)]
            lacks += [f"fmha.{n}" for n in _NEEDED_FMHA if not hasattr(fmha, n)]
            if lacks:
                why.append(f"xformers.ops lacks {', '.join(lacks)}")
        return why + cuda_reasons(request, "xformers", _DTYPES, (6, 0))

    def merged_backward(self, device: torch.device, dropout_p: float) -> bool:
        return dropout_p == 0.0

    def _bias(self, xops: Any, is_causal: bool) -> Any:
        return xops.LowerTriangularMask() if is_causal else None

    def attn_forward(self, q, k, v, *, is_causal, scale):
        xops = self._ops()
        out, lse = xops.fmha.memory_efficient_attention_forward_requires_grad(
            q, k, v, attn_bias=self._bias(xops, is_causal), p=0.0, scale=scale
        )
        return out, lse, None

    def attn_backward(
        self, dout, q, k, v, out, lse, extra, *, is_causal, scale, delta=None, norm=None, into=None
    ):
        # delta, norm and into stay None: this backend has no row_dots (its kernel forms delta itself)
        xops = self._ops()
        dq, dk, dv = xops.fmha.memory_efficient_attention_backward(
            dout, out, lse, q, k, v, attn_bias=self._bias(xops, is_causal), p=0.0, scale=scale
        )[:3]
        return dq, dk, dv

    def attn_autograd(self, q, k, v, *, is_causal, scale, dropout_p):
        xops = self._ops()
        m = q.shape[1]
        bias = self._bias(xops, is_causal)
        out = xops.memory_efficient_attention(q, k, v, attn_bias=bias, p=dropout_p, scale=scale)
        _, lse = xops.fmha.memory_efficient_attention_forward_requires_grad(
            q.detach(), k.detach(), k.detach(), attn_bias=bias, p=0.0, scale=scale
        )
        lse = lse.detach()[..., :m].to(lse_dtype(q.dtype))
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            out_k = xops.memory_efficient_attention(
                q.detach(), k.detach(), k, attn_bias=bias, p=0.0, scale=scale
            )
            lse = lse_with_grad(lse, q, out_k, scale, self.name)
        return out, lse
