"""``sdpa``: PyTorch's fused scaled-dot-product attention kernels on the dilated sub-sequences (strided views).

``torch.nn.functional.scaled_dot_product_attention`` does not return the log-sum-exp that the
branch merge needs, so this backend calls the ATen operators that it wraps and that do:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` -> (out, logsumexp (B, H, M)) and
  ``aten._scaled_dot_product_flash_attention_for_cpu_backward`` (float16, bfloat16, float32,
  float64; grouped-query attention supported by the kernel).
* CUDA: the best of ``aten._scaled_dot_product_cudnn_attention``,
  ``aten._scaled_dot_product_flash_attention`` and ``aten._scaled_dot_product_efficient_attention``
  for the device, dtype and head dim, chosen as PyTorch chooses (:mod:`.sdpa_kernels`), each with
  its backward operator (float16, bfloat16, float32; key/value heads are repeated for
  grouped-query attention).

On CPU the backward is :func:`.sdpa_kernels.cpu_exact_backward` (the fused CPU backward misses
the accuracy rule on large logits); set ``SdpaBackend.cpu_kernel_backward = True`` to run the
operator's backward instead.

On CPU, float32 inputs run in float64 where the C++ driver runs (no dropout;
``SdpaBackend.cpu_float32_in_float64``): the operator, the merge of the branches and the backward,
with out, lse and the gradients rounded to float32 once. In float32 the operator's scores, the
per-call outputs the merge rescales and the float32 running lse of the merge each carry roundings
that plain PyTorch's dense softmax does not: at large logits (standard deviation 32-64) the
gradients exceeded twice plain PyTorch's error (SPEC section 4) in about 5-10% of random cases,
and ``out`` of a key that several branches read alike (a single position, ``N = 1``) by up to
80x. It costs about 2.3x the float32 time.

Without dropout the backward feeds the merged ``out``/``lse`` into these backward operators (the
merged path of :mod:`.driver`). Neither fused kernel can replay a dropout mask from outside
(the CPU one has no dropout at all), so with ``dropout_p > 0`` the output comes from
``F.scaled_dot_product_attention`` itself (autograd, its own dropout) and the log-sum-exp, which
dropout does not change, from the operator above, given its gradient by ``lse_with_grad``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..op import views as views_op
from . import sdpa_kernels
from .base import BackendRequest, check_device_dtype
from .driver import StridedBackend, lse_with_grad

__all__ = ["SdpaBackend"]

_DTYPES = {
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}
_OPS = {
    "cpu": (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    ),
    "cuda": (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
    ),
}


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (B, M, H, D) <-> (B, H, M, D), a view


def _positive_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float, float]:
    """``(q', scale', sign)`` with ``scale' > 0`` and ``q' scale' == q scale`` exactly: PyTorch's
    fused CPU kernel returns NaN for a causal call with ``scale <= 0``. A negative scale moves its
    sign into q (exact); a zero scale makes every score 0, as ``q' = 0`` with ``scale' = 1`` does.
    ``sign`` maps the kernel's dq back: ``dq = sign * dq'``."""
    if scale > 0:
        return q, scale, 1.0
    if scale < 0:
        return -q, -scale, -1.0
    return torch.zeros_like(q), 1.0, 0.0


class SdpaBackend(StridedBackend):
    name = "sdpa"

    #: Run the CPU flash operator's own backward (fast, but outside the float32 accuracy rule on
    #: large logits) instead of :func:`.sdpa_kernels.cpu_exact_backward`.
    cpu_kernel_backward = False

    #: Run the C++ driver (one op each way, :mod:`dilated_attention.op.views`) where it covers the
    #: call (:func:`.sdpa_kernels.cpp_driver_runs`); the Python driver below elsewhere.
    cpp_driver = True

    #: Run float32 calls on the CPU in float64 where the C++ driver runs (module docstring).
    cpu_float32_in_float64 = True

    def _widened(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
        """Whether this call runs in float64: float32 on the CPU, through the C++ driver."""
        return (
            self.cpu_float32_in_float64
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and self._cpp_runs(q, k, v, dropout_p)
        )

    def _cpp_runs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
        return (
            self.cpp_driver
            and not self.cpu_kernel_backward
            and sdpa_kernels.cpp_driver_runs(q, k, v, dropout_p)
        )

    def _route(self, q, k, v, dropout_p, cpp, python):
        """``cpp(q, k, v)`` where the C++ driver runs the call (float32 on the CPU in float64,
        rounded back once), else ``python(q, k, v)``: the one choice of forward and forward_varlen."""
        if self._widened(q, k, v, dropout_p):
            out, lse = cpp(q.double(), k.double(), v.double())
            return out.float(), lse.float()
        if self._cpp_runs(q, k, v, dropout_p):
            return cpp(q, k, v)
        return python(q, k, v)

    def forward(self, q, k, v, segment_lengths, dilation_rates, *, is_causal, softmax_scale, dropout_p=0.0):
        # the C++ driver: one op that plans its calls for the N it is given (traceable, exportable
        # with any N)
        return self._route(
            q,
            k,
            v,
            dropout_p,
            lambda q, k, v: views_op.views_attention(
                q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale
            ),
            lambda q, k, v: super(SdpaBackend, self).forward(
                q,
                k,
                v,
                segment_lengths,
                dilation_rates,
                is_causal=is_causal,
                softmax_scale=softmax_scale,
                dropout_p=dropout_p,
            ),
        )

    def varlen_reads_lengths(self, q, k, v, dropout_p):
        return not self._cpp_runs(q, k, v, dropout_p)  # the C++ driver reads cu_seqlens itself

    def forward_varlen(
        self, q, k, v, packed, segment_lengths, dilation_rates, *, is_causal, softmax_scale, dropout_p=0.0
    ):
        return self._route(
            q,
            k,
            v,
            dropout_p,
            lambda q, k, v: views_op.views_varlen_attention(
                q,
                k,
                v,
                packed.cu_seqlens,
                packed.max_seqlen,
                segment_lengths,
                dilation_rates,
                is_causal,
                softmax_scale,
            ),
            lambda q, k, v: super(SdpaBackend, self).forward_varlen(
                q,
                k,
                v,
                packed,
                segment_lengths,
                dilation_rates,
                is_causal=is_causal,
                softmax_scale=softmax_scale,
                dropout_p=dropout_p,
            ),
        )

    def reasons(self, request: BackendRequest) -> list[str]:
        why = check_device_dtype(request, "sdpa", _DTYPES)
        if why:
            return why
        dev = request.device.type
        missing = [op for op in _OPS[dev] if not hasattr(torch.ops.aten, op)]
        if missing:
            return [f"this PyTorch ({torch.__version__}) lacks aten.{', aten.'.join(missing)}"]
        if dev == "cuda":
            from .. import hardware

            if hardware.compute_capability(request.device) is None:
                return ["CUDA is not available"]
            if request.head_dim % 8:
                return [f"sdpa on cuda needs a head dim that is a multiple of 8, got {request.head_dim}"]
        return []

    # PyTorch's fused CPU kernel gives out = 0, lse = 0 for a row whose scores are NaN.
    hides_nonfinite_scores = True

    def native_gqa(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def merged_backward(self, device: torch.device, dropout_p: float) -> bool:
        return dropout_p == 0.0

    # -- merged path -------------------------------------------------------------------------------
    def attn_forward(self, q, k, v, *, is_causal, scale):
        q, scale, _ = _positive_scale(q, scale)
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _t(q), _t(k), _t(v), 0.0, is_causal, scale=scale
            )
            return _t(out), lse, None
        return sdpa_kernels.cuda_forward(q, k, v, is_causal=is_causal, scale=scale)

    def row_dots(self, dout, q, k, v, lse, *, is_causal, scale):
        if q.device.type != "cpu" or self.cpu_kernel_backward:
            return None
        q, scale, _ = _positive_scale(q, scale)
        return sdpa_kernels.cpu_row_dots(dout, q, k, v, lse, is_causal=is_causal, scale=scale)

    def attn_backward(
        self, dout, q, k, v, out, lse, extra, *, is_causal, scale, delta=None, norm=None, into=None
    ):
        q, scale, sign = _positive_scale(q, scale)
        if q.device.type != "cpu":
            dq, dk, dv = sdpa_kernels.cuda_backward(
                dout, q, k, v, out, lse, extra, is_causal=is_causal, scale=scale
            )
        elif not self.cpu_kernel_backward:
            kw = {"is_causal": is_causal, "scale": scale, "delta": delta, "norm": norm}
            if sign == 1.0:
                return sdpa_kernels.cpu_exact_backward(dout, q, k, v, out, lse, **kw, into=into)
            dq, dk, dv = sdpa_kernels.cpu_exact_backward(dout, q, k, v, out, lse, **kw)
            if into is not None:  # added in, dq with its sign changed back
                return into[0].add_(dq, alpha=sign), into[1].add_(dk), into[2].add_(dv)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _t(dout), _t(q), _t(k), _t(v), _t(out), lse, 0.0, is_causal, scale=scale
            )
            dq, dk, dv = _t(dq), _t(dk), _t(dv)
        dq = dq if sign == 1.0 else dq * sign
        return dq, dk, dv

    # -- autograd path (dropout) -------------------------------------------------------------------
    def attn_autograd(self, q, k, v, *, is_causal, scale, dropout_p):
        m = q.shape[1]
        gqa = q.shape[2] != k.shape[2]
        qs, s, _ = _positive_scale(q, scale)  # autograd differentiates the sign change
        out = F.scaled_dot_product_attention(
            _t(qs), _t(k), _t(v), dropout_p=dropout_p, is_causal=is_causal, scale=s, enable_gqa=gqa
        )
        out = _t(out)
        # The log-sum-exp does not depend on dropout: one call without it, keys as values.
        out_k, lse, _ = self.attn_forward(q.detach(), k.detach(), k, is_causal=is_causal, scale=scale)
        lse = lse[..., :m]
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            lse = lse_with_grad(lse, q, out_k, scale, self.name)
        return out, lse
