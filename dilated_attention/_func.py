"""The fused op under torch.func (``grad``, ``vjp``, ``jacrev``, ``vmap``) and torch.export.

:func:`native_attention` runs ``torch.ops.dilated_attention.fwd`` through :class:`NativeAttention`,
an ``autograd.Function`` written with ``setup_context`` (what torch.func transforms require; the
op's own ``register_autograd`` formula is the older kind, which they refuse), whose forward and
backward run the ops. Both ops have vmap rules (``torch.library.register_vmap``): the vmapped
dimension is folded into the batch, one kernel call for the whole vmapped batch, so ``vmap`` and
``jacrev`` (a vmap over vjps) need no per-example loop. Forward-mode AD (``jvp``, ``jacfwd``,
``hessian``) has no formula: it raises an error that names it. Under torch.compile and
torch.export the op is called directly (Dynamo traces it and its ``register_autograd`` formula,
which saves the same float64 lse; it does not trace autograd.Functions that define ``jvp`` or take
one tensor twice, as self-attention's ``q = k = v``).
"""

from __future__ import annotations

from typing import Any

import torch

from ._autograd import no_double_backward
from ._ops import _C

__all__ = ["NativeAttention", "native_attention"]

_FORWARD_MODE = (
    "dilated_attention: the 'native' backend has no forward-mode gradients (torch.func.jvp, jacfwd, "
    "hessian, torch.autograd.forward_ad): its backward is a fused reverse-mode kernel; use reverse "
    "mode (torch.func.grad, vjp, jacrev) or backend='manual', which autograd differentiates end to end"
)


def _fold(x: torch.Tensor, bdim: int | None, size: int) -> torch.Tensor:
    """``x`` with its vmapped dimension ``bdim`` (or, unbatched, a broadcast one) folded into the
    batch dimension: (V, B, ...) -> (V * B, ...)."""
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _fwd_vmap(info: Any, in_dims: tuple[Any, ...], q, k, v, *rest):
    V = info.batch_size
    q, k, v = (_fold(t, d, V) for t, d in zip((q, k, v), in_dims[:3], strict=True))
    out, lse = torch.ops.dilated_attention.fwd(q, k, v, *rest)
    return (out.unflatten(0, (V, -1)), lse.unflatten(0, (V, -1))), (0, 0)


def _bwd_vmap(info: Any, in_dims: tuple[Any, ...], dout, q, k, v, out, lse, dlse, *rest):
    V = info.batch_size
    tensors = [
        None if t is None else _fold(t, d, V)
        for t, d in zip((dout, q, k, v, out, lse, dlse), in_dims[:7], strict=True)
    ]
    grads = torch.ops.dilated_attention.bwd(*tensors, *rest)
    return tuple(g.unflatten(0, (V, -1)) for g in grads), (0, 0, 0)


if _C is not None:
    torch.library.register_vmap("dilated_attention::fwd", _fwd_vmap)
    torch.library.register_vmap("dilated_attention::bwd", _bwd_vmap)


class NativeAttention(torch.autograd.Function):
    """``(out, lse)`` of the fused op, lse in float64 (the op's ``float64_lse=True``), so that the
    backward recomputes the probabilities without lse's rounding to float32 (see :mod:`._ops`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, *dropout):
        return torch.ops.dilated_attention.fwd(
            q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, True, *dropout
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, *config = inputs  # segment_lengths ... softmax_scale, dropout_p, seed, offset
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = tuple(config)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = torch.ops.dilated_attention.bwd(dout, q, k, v, out, lse, dlse, *ctx.config)
        dq, dk, dv = no_double_backward("native", (dq, dk, dv), (dout, dlse, q, k, v))
        return (dq, dk, dv) + (None,) * len(ctx.config)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_FORWARD_MODE)


def native_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    softmax_scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the fused op through :class:`NativeAttention` (lse in float64), with
    attention dropout ``(dropout_p, dropout_seed, dropout_offset)`` (csrc/dropout.h)."""
    dropout = (dropout_p, dropout_seed, dropout_offset) if dropout_p > 0 else ()
    if torch.compiler.is_compiling():
        # Dynamo traces the op itself (its register_autograd formula saves the same float64 lse):
        # it does not trace autograd.Functions that define jvp or take one tensor twice (q = k = v).
        return torch.ops.dilated_attention.fwd(
            q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, True, *dropout
        )
    out, lse = NativeAttention.apply(
        q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, *dropout
    )
    return out, lse
