"""The fixed-length op (``fwd``/``bwd``, and ``dropout_mask``): its fake (meta) kernels, its autograd
formula, and :func:`native_forward`, the entry point the ``native`` backend calls.

The schema lives in ``csrc/dilated_attention.cpp``:

* ``torch.ops.dilated_attention.fwd(q, k, v, segment_lengths, dilation_rates, is_causal,
  softmax_scale, float64_lse=False) -> (out, lse)``
* ``torch.ops.dilated_attention.bwd(dout, q, k, v, out, lse, dlse, segment_lengths,
  dilation_rates, is_causal, softmax_scale) -> (dq, dk, dv)``
* ``torch.ops.dilated_attention.varlen_fwd(q, k, v, cu_seqlens, max_seqlen, segment_lengths,
  dilation_rates, is_causal, softmax_scale, float64_lse=False) -> (out, lse)``: packed sequences,
  q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,), out (T, Hq, D), lse (Hq, T)
  (:mod:`.varlen`)
* ``torch.ops.dilated_attention.varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen,
  segment_lengths, dilation_rates, is_causal, softmax_scale) -> (dq, dk, dv)``
* ``torch.ops.dilated_attention.piece_fwd/piece_bwd``: the pieces of sequence parallelism
  (:mod:`.piece`).

``lse`` is float32 (float64 for float64 inputs); with ``float64_lse=True`` the forwards return it in
float64 whatever the inputs, and the backwards take either. The Python entry points below ask for
float64 and hand the caller float32: their autograd then saves the float64 lse, and the backward
recomputes the probabilities ``exp(s - lse)`` without the rounding of lse to float32, which for
large logits (``|lse|`` of tens) would otherwise put errors of tens of float32 epsilons into every
probability, beyond SPEC section 4's rule.

The four fixed-length and packed ops also take ``dropout_p=0., dropout_seed=0, dropout_offset=0``
(last): attention dropout with the counter-based mask of ``csrc/dropout.h``, which the backward,
given the same three, draws again (the CPU and the CUDA kernels draw the same mask);
:func:`dropout_mask` returns that mask.

Both backward kernels are deterministic (no atomics): the same inputs give the same bits. The
backward has no derivative of its own: a second backward (after ``create_graph=True``) raises a
``RuntimeError`` rather than returning wrong second-order gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._validation import accumulation_dtype
from . import checks
from .func import NativeAttention, dropout_args, register_op_autograd
from .library import _C, _require_extension, lse_dtype

__all__ = ["dropout_mask", "native_forward"]


def _fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    softmax_scale: float,
    float64_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_fixed(q, k, v, segment_lengths, dilation_rates, softmax_scale, dropout_p)
    B, N, Hq, D = q.shape
    out = q.new_empty((B, N, Hq, D))
    lse = q.new_empty((B, Hq, N), dtype=lse_dtype(q.dtype, float64_lse))
    return out, lse


def _bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    softmax_scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = (dout, out, lse, dlse)
    checks.check_fixed(q, k, v, segment_lengths, dilation_rates, softmax_scale, dropout_p, grads)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _dropout_mask_fake(B, H, Nq, Nk, dropout_p, dropout_seed, dropout_offset) -> torch.Tensor:
    checks.check_dropout_mask(B, H, Nq, Nk, dropout_p)
    return torch.empty((B, H, Nq, Nk), dtype=torch.bool)


if _C is not None:
    torch.library.register_fake("dilated_attention::fwd")(_fwd_fake)
    torch.library.register_fake("dilated_attention::bwd")(_bwd_fake)
    if hasattr(torch.ops.dilated_attention, "dropout_mask"):
        torch.library.register_fake("dilated_attention::dropout_mask")(_dropout_mask_fake)
    register_op_autograd(NativeAttention, "fwd", lse64_at=7)


def native_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool,
    softmax_scale: float,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused op: ``out`` (B, N, Hq, D) and ``lse`` (B, Hq, N), float32 (float64 for float64
    inputs); attention dropout with probability ``dropout_p`` (seed and offset drawn from torch's
    default generator, :func:`dropout_seed_offset`). Differentiable, also under torch.func's ``grad``, ``vjp``, ``jacrev`` and ``vmap``
    (:mod:`.func`); the backward reads the float64 lse the op computed (module docstring).

    ``RuntimeError`` saying what to run when the extension is not loaded."""
    if _C is None:
        _require_extension()
    args = (list(segment_lengths), list(dilation_rates), bool(is_causal), float(softmax_scale))
    out, lse = NativeAttention.call(q, k, v, *args, *dropout_args(dropout_p))
    return out, lse.to(accumulation_dtype(q.dtype))


def dropout_mask(
    B: int, H: int, Nq: int, Nk: int, dropout_p: float, dropout_seed: int, dropout_offset: int
) -> torch.Tensor:
    """The keep mask the kernels apply for dropout ``(dropout_p, dropout_seed, dropout_offset)``:
    bool (B, H, Nq, Nk), ``[b, h, q, x]`` whether the weight of query row ``q`` and key row ``x`` of
    head ``h`` of batch entry ``b`` is kept (then scaled by ``1 / (1 - dropout_p)``). A packed call's
    rows are those of its ``(1, T, ...)`` view."""
    _require_extension()
    return torch.ops.dilated_attention.dropout_mask(
        B, H, Nq, Nk, float(dropout_p), int(dropout_seed), int(dropout_offset)
    )
