"""The log-sum-exp merge of partial attention results (SPEC section 3), written once.

Two partial results over disjoint key sets, ``(out_a, lse_a)`` and ``(out_b, lse_b)``, combine to
the result over the union of the key sets:

    lse = logaddexp(lse_a, lse_b),    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.

This is how the branches of one query are mixed (the gather-based backends) and how the pieces of
a segment that spans ranks are combined (sequence parallelism). A row that no part covers has
``out = 0`` and ``lse = -inf`` and stays so: no NaN. ``out`` is (..., n, H, D) and ``lse``
(..., H, n), the layout of the op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["merge", "merge_into_", "merge_view_", "merged_values"]


def _weights(lse: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """exp(lse - total) as (..., n, H, 1) multipliers of an ``out``; 0 where ``total`` is -inf."""
    safe = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
    return torch.exp(lse - safe).transpose(-1, -2).unsqueeze(-1)


def merge_into_(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Merge ``(out_b, lse_b)`` into the accumulators: ``out_acc`` is updated in place and the
    merged lse is returned (the caller stores it). Not differentiable (in-place); the accumulators
    are in the accumulation dtype (float32, float64 for float64 inputs)."""
    new = torch.logaddexp(lse_acc, lse_b)  # -inf only where both are -inf
    out_acc.mul_(_weights(lse_acc, new)).add_(out_b.to(out_acc.dtype) * _weights(lse_b, new))
    return new


def merge_view_(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    first: bool = False,
) -> None:
    """Merge ``(out_b, lse_b)`` into (possibly strided) views of the accumulators, in place.

    ``out_acc`` and ``out_b`` are (..., n, H, D), ``lse_acc`` and ``lse_b`` (..., n, H), in the
    layout of ``out``. ``first``: the accumulators hold nothing yet here (out 0, lse -inf), so the
    values are copied. Not differentiable."""
    if first:
        out_acc.copy_(out_b)
        lse_acc.copy_(lse_b)
        return
    new, w_acc, w_b = _merge_weights(lse_acc, lse_b)
    out_acc.mul_(w_acc)
    out_acc.add_(out_b * w_b)
    lse_acc.copy_(new)


def merged_values(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`merge_view_` (not ``first``) leaves in the accumulators, out of place:
    ``(out, lse)`` in the accumulators' dtypes. Not differentiable."""
    new, w_acc, w_b = _merge_weights(lse_acc, lse_b)
    return (out_acc * w_acc + out_b * w_b).to(out_acc.dtype), new


def _merge_weights(lse_acc: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The merged lse and the two parts' weights ``exp(lse_part - lse)`` (..., n, H, 1)."""
    new = torch.logaddexp(lse_acc, lse_b)  # -inf only where both are -inf
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    return new, torch.exp(lse_acc - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable merge of several partial results, in the dtype of the ``lses``.

    outs: (..., n, H, D) each; lses: (..., H, n) each. Gradients are exact through the mixing
    weights (the merged lse does not depend on the max taken for stability).
    """
    if len(outs) == 1:
        return outs[0], lses[0]
    L = torch.stack(list(lses))  # (k, ..., H, n)
    m = L.detach().amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(L - m)  # 0 where a part does not cover the row
    s = e.sum(dim=0)
    covered = s != 0  # a NaN (non-finite score) stays NaN rather than counting as uncovered
    s_safe = torch.where(covered, s, torch.ones_like(s))
    lse = torch.where(covered, torch.log(s_safe) + m, torch.full_like(s, -math.inf))
    alpha = (e / s_safe).transpose(-1, -2).unsqueeze(-1)  # (k, ..., n, H, 1)
    out = (alpha * torch.stack([o.to(lse.dtype) for o in outs])).sum(dim=0)
    return out, lse
