"""Loads the compiled op and gives it a fake (meta) implementation and an autograd formula.

The schema lives in ``csrc/dilated_attention.cpp``:

* ``torch.ops.dilated_attention.fwd(q, k, v, segment_lengths, dilation_rates, is_causal,
  softmax_scale) -> (out, lse)``
* ``torch.ops.dilated_attention.bwd(dout, q, k, v, out, lse, dlse, segment_lengths,
  dilation_rates, is_causal, softmax_scale) -> (dq, dk, dv)``

Both backward kernels are deterministic (no atomics): the same inputs give the same bits. The
backward has no derivative of its own: a second backward (after ``create_graph=True``) raises a
``RuntimeError`` rather than returning wrong second-order gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _C
from ._autograd import no_double_backward
from .flops import accumulation_dtype

__all__ = ["cpu_isa", "has_kernel", "native_forward"]

_fwd = torch.ops.dilated_attention.fwd
_bwd = torch.ops.dilated_attention.bwd


def has_kernel(device_type: str) -> bool:
    """Whether the compiled extension has kernels for ``device_type`` ("cpu" or "cuda")."""
    key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
    return torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attention::fwd", key)


def cpu_isa() -> str:
    """The instruction set the CPU kernels run with in this process: ``"avx512"``, ``"avx2"`` or
    ``"baseline"`` (SSE2 on x86-64, the compiler's default elsewhere). The widest the CPU has, unless
    the environment variable ``DILATED_ATTENTION_CPU_ISA`` names another; a value it does not know,
    or a set the CPU lacks, raises ``ValueError`` naming it."""
    return _C.cpu_isa()


@torch.library.register_fake("dilated_attention::fwd")
def _fwd_fake(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale):
    B, N, Hq, D = q.shape
    out = q.new_empty((B, N, Hq, D))
    lse = q.new_empty((B, Hq, N), dtype=accumulation_dtype(q.dtype))
    return out, lse


@torch.library.register_fake("dilated_attention::bwd")
def _bwd_fake(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    segment_lengths,
    dilation_rates,
    is_causal,
    softmax_scale,
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.config = (list(segment_lengths), list(dilation_rates), bool(is_causal), float(softmax_scale))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    segment_lengths, dilation_rates, is_causal, softmax_scale = ctx.config
    dq, dk, dv = _bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse,
        segment_lengths,
        dilation_rates,
        is_causal,
        softmax_scale,
    )
    dq, dk, dv = no_double_backward("native", (dq, dk, dv), (dout, dlse, q, k, v))
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("dilated_attention::fwd", _backward, setup_context=_setup_context)


def native_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused op: ``out`` (B, N, Hq, D) and ``lse`` (B, Hq, N). Differentiable."""
    return _fwd(q, k, v, list(segment_lengths), list(dilation_rates), bool(is_causal), float(softmax_scale))
