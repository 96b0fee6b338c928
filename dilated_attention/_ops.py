"""Loads the compiled op and gives it a fake (meta) implementation and an autograd formula.

The schema lives in ``csrc/dilated_attention.cpp``:

* ``torch.ops.dilated_attention.fwd(q, k, v, segment_lengths, dilation_rates, is_causal,
  softmax_scale) -> (out, lse)``
* ``torch.ops.dilated_attention.bwd(dout, q, k, v, out, lse, dlse, segment_lengths,
  dilation_rates, is_causal, softmax_scale, deterministic=False) -> (dq, dk, dv)``
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _C

__all__ = ["has_kernel", "native_forward", "set_deterministic_backward"]

_fwd = torch.ops.dilated_attention.fwd
_bwd = torch.ops.dilated_attention.bwd

# Read once per backward: whether the CUDA backward must be bitwise reproducible.
_DETERMINISTIC = {"value": False}


def set_deterministic_backward(enabled: bool) -> None:
    """Ask the native CUDA backward for a bitwise reproducible order of accumulation.

    The CPU backward is always deterministic. ``torch.use_deterministic_algorithms(True)`` has the
    same effect.
    """
    _DETERMINISTIC["value"] = bool(enabled)


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


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("dilated_attention::fwd")
def _fwd_fake(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale):
    B, N, Hq, D = q.shape
    out = q.new_empty((B, N, Hq, D))
    lse = q.new_empty((B, Hq, N), dtype=_lse_dtype(q.dtype))
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
    deterministic=False,
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
    deterministic = _DETERMINISTIC["value"] or torch.are_deterministic_algorithms_enabled()
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
        deterministic,
    )
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


def native_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of the fused op, given the merged ``out`` and ``lse``."""
    deterministic = _DETERMINISTIC["value"] or torch.are_deterministic_algorithms_enabled()
    return _bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse,
        list(segment_lengths),
        list(dilation_rates),
        bool(is_causal),
        float(softmax_scale),
        deterministic,
    )
