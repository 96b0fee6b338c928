"""The packed (varlen) form of the fused op (SPEC section 7), its fake kernels and autograd formula.

* ``torch.ops.dilated_attention.varlen_fwd(q, k, v, cu_seqlens, max_seqlen, segment_lengths,
  dilation_rates, is_causal, softmax_scale, float64_lse=False) -> (out, lse)``
* ``torch.ops.dilated_attention.varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen,
  segment_lengths, dilation_rates, is_causal, softmax_scale) -> (dq, dk, dv)``

q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,); out (T, Hq, D), lse (Hq, T).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._validation import accumulation_dtype
from . import checks
from .func import NativeVarlenAttention, dropout_args, register_op_autograd
from .library import _C, _require_extension, lse_dtype

__all__ = ["native_varlen_forward"]


def _varlen_fwd_fake(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen,
    segment_lengths,
    dilation_rates,
    is_causal,
    softmax_scale,
    float64_lse=False,
    dropout_p=0.0,
    dropout_seed=0,
    dropout_offset=0,
):
    checks.check_varlen(
        q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, softmax_scale, dropout_p
    )
    T, Hq, D = q.shape
    out = q.new_empty((T, Hq, D))
    lse = q.new_empty((Hq, T), dtype=lse_dtype(q.dtype, float64_lse))
    return out, lse


def _varlen_bwd_fake(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    cu_seqlens,
    max_seqlen,
    segment_lengths,
    dilation_rates,
    is_causal,
    softmax_scale,
    dropout_p=0.0,
    dropout_seed=0,
    dropout_offset=0,
):
    args = (q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, softmax_scale, dropout_p)
    checks.check_varlen(*args, (dout, out, lse, dlse))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


if _C is not None:
    torch.library.register_fake("dilated_attention::varlen_fwd")(_varlen_fwd_fake)
    torch.library.register_fake("dilated_attention::varlen_bwd")(_varlen_bwd_fake)
    register_op_autograd(NativeVarlenAttention, "varlen_fwd", lse64_at=9)


def native_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool,
    softmax_scale: float,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused packed op: ``out`` (T, Hq, D) and ``lse`` (Hq, T), float32 (float64 for
    float64 inputs); attention dropout with probability ``dropout_p``.
    Differentiable, also under torch.func's ``grad``, ``vjp``, ``jacrev`` and ``vmap`` (:mod:`.func`);
    the backward reads the op's float64 lse (see :mod:`.fixed`).

    ``RuntimeError`` saying what to run when the extension is not loaded."""
    _require_extension()
    args = (
        int(max_seqlen),
        list(segment_lengths),
        list(dilation_rates),
        bool(is_causal),
        float(softmax_scale),
    )
    out, lse = NativeVarlenAttention.call(q, k, v, cu_seqlens, *args, *dropout_args(dropout_p))
    return out, lse.to(accumulation_dtype(q.dtype))
