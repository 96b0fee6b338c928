"""The ``sdpa`` backend's driver in C++: one custom op each way.

The schema lives in ``csrc/dilated_attention.cpp``, the driver in ``csrc/views/``:

* ``torch.ops.dilated_attention.views_fwd(q, k, v, segment_lengths, dilation_rates, is_causal,
  softmax_scale) -> (out, lse)``: q (B, N, Hq, D), k and v (B, N, Hkv, D); out (B, N, Hq, D) in q's
  dtype, lse (B, Hq, N) float32 (float64 for float64 inputs);
* ``torch.ops.dilated_attention.views_bwd(dout, q, k, v, out, lse, dlse, segment_lengths,
  dilation_rates, is_causal, softmax_scale) -> (dq, dk, dv)``;
* ``views_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, is_causal,
  softmax_scale) -> (out, lse)`` and ``views_varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens,
  max_seqlen, ...) -> (dq, dk, dv)``: packed sequences (SPEC section 7; shapes as the native
  ``varlen_fwd``), each sequence run as a batch of its own (``csrc/views/varlen.cpp``).

The forward plans every branch's kernel calls as strided views of q, k and v (the plan of
:mod:`dilated_attention.backends.strided`), runs PyTorch's fused attention operator on each (CPU:
``_scaled_dot_product_flash_attention_for_cpu``; CUDA: cuDNN or flash attention, else the
efficient kernel) and merges the calls by log-sum-exp in one fused pass (on CUDA one launch for a
branch's calls, up to 8). The backward feeds each call the merged ``out``
and ``lse`` (CPU: the exact matmul backward of :mod:`dilated_attention.backends.sdpa_kernels`; CUDA: the operators'
backward) and adds the gradients into float32 accumulators. A forward and its backward are one
dispatched operator each, which ``torch.compile(fullgraph=True)`` keeps as one node each.

:func:`dilated_attention.backends.sdpa_kernels.cpp_driver_runs` says where the sdpa backend takes
this driver; elsewhere (dropout) the Python driver of
:mod:`dilated_attention.backends.driver` runs.

Under ``torch.func`` (``grad``, ``vjp``, ``jacrev``, ``vmap``) the forward runs through
:class:`ViewsAttention`, an ``autograd.Function`` with ``setup_context``, as the native op's
:class:`~dilated_attention.op.func.NativeAttention`; both ops have vmap rules that fold the vmapped
dimension into the batch (one call for the whole vmapped batch). Forward-mode AD raises an error
that names it.
"""

from __future__ import annotations

import torch

from . import checks
from .func import (
    batched_bwd_rule,
    batched_fwd_rule,
    batched_varlen_bwd_rule,
    batched_varlen_fwd_rule,
    fused_function,
    register_op_autograd,
)
from .library import _C, lse_dtype
from .varlen import _varlen_bwd_fake, _varlen_fwd_fake  # the packed ops' own

__all__ = ["ViewsAttention", "ViewsVarlenAttention", "available", "views_attention", "views_varlen_attention"]


def _registered(key: str) -> bool:
    return _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "dilated_attention::views_fwd", key
    )


# Read once, at import (the extension registers its kernels when it loads), so that torch.compile
# traces the choice as a constant.
_AVAILABLE = (
    {"cpu": _registered("CPU"), "cuda": _registered("CUDA")}
    if _C is not None and hasattr(torch.ops.dilated_attention, "views_fwd")
    else {}
)


def available(device_type: str) -> bool:
    """Whether the loaded extension registers the views driver for ``device_type``."""
    return _AVAILABLE.get(device_type, False)


ViewsAttention = fused_function(
    "ViewsAttention",
    "views_fwd",
    "views_bwd",
    3,
    "sdpa",
    None,
    """``(out, lse)`` of ``views_fwd``, with ``views_bwd`` as its backward; what torch.func
    transforms run (the op's ``register_autograd`` formula is the kind they refuse).""",
)


def views_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (B, N, Hq, D) and ``lse`` (B, Hq, N) of the C++ driver; differentiable (first
    order, reverse mode), also under torch.func transforms."""
    args = (q, k, v, list(segment_lengths), list(dilation_rates), bool(is_causal), float(softmax_scale))
    return ViewsAttention.call(*args)


ViewsVarlenAttention = fused_function(
    "ViewsVarlenAttention",
    "views_varlen_fwd",
    "views_varlen_bwd",
    4,
    "sdpa",
    None,
    """``(out, lse)`` of ``views_varlen_fwd``, with ``views_varlen_bwd`` as its backward (as
    :class:`ViewsAttention`).""",
)


def views_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (T, Hq, D) and ``lse`` (Hq, T) of the C++ driver on packed sequences;
    differentiable (first order, reverse mode), also under torch.func transforms."""
    return ViewsVarlenAttention.call(
        q, k, v, cu_seqlens, int(max_seqlen), list(segment_lengths), list(dilation_rates), bool(is_causal),
        float(softmax_scale),
    )  # fmt: skip


def _views_fwd_fake(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale):
    checks.check_fixed(q, k, v, segment_lengths, dilation_rates, softmax_scale, 0.0, cuda_limits=False)
    B, N, Hq, D = q.shape
    return q.new_empty((B, N, Hq, D)), q.new_empty((B, Hq, N), dtype=lse_dtype(q.dtype))


def _views_bwd_fake(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, is_causal, softmax_scale):
    grads = (dout, out, lse, dlse)
    checks.check_fixed(q, k, v, segment_lengths, dilation_rates, softmax_scale, 0.0, grads, cuda_limits=False)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


if _C is not None and hasattr(torch.ops.dilated_attention, "views_fwd"):
    torch.library.register_fake("dilated_attention::views_fwd")(_views_fwd_fake)
    torch.library.register_fake("dilated_attention::views_bwd")(_views_bwd_fake)
    register_op_autograd(ViewsAttention, "views_fwd", lse64_at=None)
    torch.library.register_vmap("dilated_attention::views_fwd", batched_fwd_rule("views_fwd"))
    torch.library.register_vmap("dilated_attention::views_bwd", batched_bwd_rule("views_bwd"))
    # the fake kernels of varlen_fwd / varlen_bwd, whose arguments these ops share (without
    # float64_lse and dropout, whose defaults they take)
    torch.library.register_fake("dilated_attention::views_varlen_fwd")(_varlen_fwd_fake)
    torch.library.register_fake("dilated_attention::views_varlen_bwd")(_varlen_bwd_fake)
    register_op_autograd(ViewsVarlenAttention, "views_varlen_fwd", lse64_at=None)
    torch.library.register_vmap(
        "dilated_attention::views_varlen_fwd", batched_varlen_fwd_rule("views_varlen_fwd")
    )
    torch.library.register_vmap(
        "dilated_attention::views_varlen_bwd", batched_varlen_bwd_rule("views_varlen_bwd")
    )
