"""``flash_attn_3`` and ``flash_attn_2``: FlashAttention on the dilated sub-sequences (strided views).

Only the public ``flash_attn_func`` is used, on (B, N, H, D) tensors, with
``return_attn_probs=True`` to get ``softmax_lse`` (B, H, N) (the log-sum-exp of each row of
``scale * q k^T``). Its ``out`` is differentiable through FlashAttention's own backward; its
``softmax_lse`` is not, so the branch merge gets the log-sum-exp gradient from one more call with
the keys as values (:func:`.driver.lse_with_grad`). Backward is therefore exact, and dropout
(FlashAttention-2 only) keeps working.

* ``flash_attn_2``: package ``flash_attn`` 2.x, CUDA compute capability 8.0 or newer,
  float16/bfloat16, head dim <= 256, dropout, grouped-query attention.
* ``flash_attn_3``: module ``flash_attn_interface`` (FlashAttention-3, built from the ``hopper``
  directory), compute capability 9.x (Hopper), float16/bfloat16, head dim <= 256, no dropout.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from .base import BackendRequest, cuda_reasons, import_optional, lse_dtype
from .driver import StridedBackend, lse_with_grad

__all__ = ["FlashAttn2Backend", "FlashAttn3Backend"]

_HALF = (torch.float16, torch.bfloat16)


def _takes(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True


class _FlashBackend(StridedBackend):
    module_name = ""
    min_capability = (8, 0)
    max_capability_major: int | None = None

    def _module(self) -> tuple[Any, list[str]]:
        mod, why = import_optional(self.module_name)
        if mod is None:
            return None, [str(why)]
        if not callable(getattr(mod, "flash_attn_func", None)):
            return None, [f"{self.module_name} has no flash_attn_func"]
        return mod, []

    def reasons(self, request: BackendRequest) -> list[str]:
        _, why = self._module()
        why = list(why) + self._version_reasons()
        why += cuda_reasons(request, self.name, _HALF, self.min_capability, self.max_capability_major)
        if request.head_dim > 256:
            why.append(f"{self.name} supports head dims up to 256, got {request.head_dim}")
        if request.dropout and not self.capabilities.dropout:
            why.append(f"{self.name} has no attention dropout (dropout_p > 0 requested)")
        return why

    def _version_reasons(self) -> list[str]:
        return []

    def native_gqa(self, device: torch.device) -> bool:
        return True

    def _func(self) -> Callable:
        # Imported (and checked) when the backend was selected: a plain lookup here.
        mod = sys.modules.get(self.module_name) or importlib.import_module(self.module_name)
        return mod.flash_attn_func

    def _call(self, q, k, v, *, is_causal, scale, dropout_p, with_lse):
        raise NotImplementedError

    def attn_autograd(self, q, k, v, *, is_causal, scale, dropout_p):
        m = q.shape[1]
        need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        if dropout_p > 0:
            out, _ = self._call(
                q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p, with_lse=False
            )
            out_k, lse = self._call(
                q.detach(), k.detach(), k, is_causal=is_causal, scale=scale, dropout_p=0.0, with_lse=True
            )
        else:
            out, lse = self._call(q, k, v, is_causal=is_causal, scale=scale, dropout_p=0.0, with_lse=True)
            out_k = None
            if need_grad:
                out_k, _ = self._call(
                    q.detach(), k.detach(), k, is_causal=is_causal, scale=scale, dropout_p=0.0, with_lse=False
                )
        lse = lse.detach()[..., :m].to(lse_dtype(q.dtype))
        if need_grad:
            lse = lse_with_grad(lse, q, out_k, scale, self.name)
        return out, lse


class FlashAttn2Backend(_FlashBackend):
    name = "flash_attn_2"
    module_name = "flash_attn"

    def _version_reasons(self) -> list[str]:
        mod, _ = import_optional(self.module_name)
        if mod is None:
            return []
        version = str(getattr(mod, "__version__", ""))
        if not version.startswith("2."):
            return [f"flash_attn_2 needs flash_attn 2.x, found {version or 'an unknown version'}"]
        return []

    def _call(self, q, k, v, *, is_causal, scale, dropout_p, with_lse):
        fa = self._func()
        if not with_lse:
            return fa(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal), None
        res = fa(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal, return_attn_probs=True)
        return res[0], res[1]  # (out, softmax_lse (B, H, N), S_dmask)


class FlashAttn3Backend(_FlashBackend):
    name = "flash_attn_3"
    module_name = "flash_attn_interface"
    min_capability = (9, 0)
    max_capability_major = 9

    def _call(self, q, k, v, *, is_causal, scale, dropout_p, with_lse):
        fa = self._func()
        if _takes(fa, "return_attn_probs"):
            res = fa(q, k, v, softmax_scale=scale, causal=is_causal, return_attn_probs=True)
        else:  # early releases always return (out, softmax_lse)
            res = fa(q, k, v, softmax_scale=scale, causal=is_causal)
        if isinstance(res, torch.Tensor):
            raise RuntimeError("flash_attn_interface.flash_attn_func returned no softmax_lse")
        return res[0], res[1]
