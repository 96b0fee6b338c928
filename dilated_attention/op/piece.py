"""The pieces of a segment that spans ranks (:mod:`dilated_attention.ring`): dense attention of nq
queries over nk keys; with ``is_causal``, key ``j`` is visible to query ``i`` when
``j <= i + causal_offset``.

* ``torch.ops.dilated_attention.piece_fwd(q, k, v, is_causal, causal_offset, softmax_scale,
  float64_lse=False) -> (out, lse)``
* ``torch.ops.dilated_attention.piece_bwd(dout, q, k, v, out, lse, dlse, is_causal,
  causal_offset, softmax_scale) -> (dq, dk, dv)``

q (B, nq, Hq, D), k and v (B, nk, Hkv, D); out (B, nq, Hq, D), lse (B, Hq, nq). The backward takes
any out/lse (for the ring: the merged ones of the rows) and is exact for them; lse may be float32
or float64 (see :mod:`.fixed`).
"""

from __future__ import annotations

from typing import Any

import torch

from .._validation import accumulation_dtype
from . import checks
from .library import _C, lse_dtype

__all__ = ["has_piece_kernel", "piece_backward", "piece_forward"]

_HAS_PIECE_OP = _C is not None and hasattr(torch.ops.dilated_attention, "piece_fwd")


def has_piece_kernel(device_type: str) -> bool:
    """Whether the extension has the piece kernels (``piece_fwd``/``piece_bwd``) for ``device_type``.

    ``"cpu"``: true whenever the extension is loaded; ``"cuda"``: true when it was built with its
    CUDA kernels (as :func:`has_kernel`); false for any other device type.
    """
    if not _HAS_PIECE_OP or device_type not in ("cpu", "cuda"):
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
    return torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attention::piece_fwd", key)


def _piece_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    causal_offset: int,
    softmax_scale: float,
    float64_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_piece(q, k, v, softmax_scale)
    B, nq, Hq, D = q.shape
    return q.new_empty((B, nq, Hq, D)), q.new_empty((B, Hq, nq), dtype=lse_dtype(q.dtype, float64_lse))


def _piece_bwd_fake(
    dout, q, k, v, out, lse, dlse, is_causal, causal_offset, softmax_scale
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    checks.check_piece(q, k, v, softmax_scale, (dout, out, lse, dlse))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _piece_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, is_causal, causal_offset, softmax_scale = inputs[:6]
    ctx.save_for_backward(q, k, v, *output)
    ctx.config = (bool(is_causal), int(causal_offset), float(softmax_scale))


def _piece_backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.dilated_attention.piece_bwd(dout, q, k, v, out, lse, dlse, *ctx.config)
    return dq, dk, dv, None, None, None, None


if _HAS_PIECE_OP:
    torch.library.register_fake("dilated_attention::piece_fwd")(_piece_fwd_fake)
    torch.library.register_fake("dilated_attention::piece_bwd")(_piece_bwd_fake)
    torch.library.register_autograd(
        "dilated_attention::piece_fwd", _piece_backward, setup_context=_piece_setup_context
    )


def piece_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    causal_offset: int,
    softmax_scale: float,
    float64_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of q (B, nq, Hq, D) over k, v (B, nk, Hkv, D): ``out`` (B, nq, Hq, D) and
    ``lse`` (B, Hq, nq), float32 (float64 for float64 inputs, or with ``float64_lse``); with
    ``is_causal``, key ``j`` is visible to query ``i`` when ``j <= i + causal_offset``.
    Differentiable; the backward reads the op's float64 lse either way."""
    out, lse = torch.ops.dilated_attention.piece_fwd(
        q, k, v, bool(is_causal), int(causal_offset), float(softmax_scale), True
    )
    return out, lse if float64_lse else lse.to(accumulation_dtype(q.dtype))


def piece_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    is_causal: bool,
    causal_offset: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`piece_forward` for the given ``out``/``lse`` (which may be merged
    results over more keys than ``k``: the gradients are then this piece's share). ``lse`` in
    float32 or float64: a float64 one (``piece_forward(..., float64_lse=True)``, merged in float64)
    keeps the probabilities free of lse's rounding to float32."""
    return torch.ops.dilated_attention.piece_bwd(
        dout, q, k, v, out, lse, dlse, bool(is_causal), int(causal_offset), float(softmax_scale)
    )
