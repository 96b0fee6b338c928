"""The log-sum-exp merge of partial attention results (SPEC section 3), written once.

Two partial results over disjoint key sets, ``(out_a, lse_a)`` and ``(out_b, lse_b)``, combine to
the result over the union of the key sets:

    lse = logaddexp(lse_a, lse_b),    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.

This is how the branches of one query are mixed (the gather-based backends) and how the pieces of
a segment that spans ranks are combined (sequence parallelism). A row that no part covers has
``out = 0`` and ``lse = -inf`` and stays so: no NaN. ``out`` is (..., n, H, D) and ``lse``
(..., H, n), the layout of the op.

Where several parts are merged in one place (:func:`merge`, and the running state of
:func:`merge_state_`), the merge is the kernels' own: the parts are weighted by ``exp(lse_i - m)``,
``m`` the largest ``lse_i`` (so each exponent is exact), summed unnormalised and divided once by the
sum of the weights, ``lse = m + log(sum)``, in float64 for float32 (and float64) parts. A merge
that went through a float32 running ``lse`` (``logaddexp`` rounded after every part) would put
that rounding, half a unit in the last place of ``|lse|`` (tens of float32 epsilons when ``|lse|``
is tens), into the weight of every part merged before, and ``1/3``-style weights rounded before
the sum would move an ``out`` that several branches see alike (a key counted three times) off
``v``: several times plain PyTorch's error in ``out``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["finish_state", "merge", "merge_dtype", "merge_into_", "merge_state_", "merged_state"]


def merge_dtype(dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The dtype :func:`merge` and the merge state compute in for parts (or inputs) in ``dtype``:
    float64 for float32 and float64 (float32 on a device without float64, such as mps), float32
    for float16 and bfloat16."""
    if dtype in (torch.float32, torch.float64) and (device is None or device.type != "mps"):
        return torch.float64
    return torch.float32


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


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable merge of several partial results, returned in the dtype of the ``lses``
    (computed in :func:`merge_dtype` of it: weights ``exp(lse_i - m)``, ``m`` the largest, the
    weighted sum normalised once).

    outs: (..., n, H, D) each; lses: (..., H, n) each. Gradients are exact through the mixing
    weights (the merged lse does not depend on the max taken for stability).
    """
    if len(outs) == 1:
        return outs[0], lses[0]
    L = torch.stack(list(lses))  # (k, ..., H, n)
    wt = merge_dtype(L.dtype, L.device)
    Lw = L.to(wt)
    m = Lw.detach().amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(Lw - m)  # 0 where a part does not cover the row; exact exponents near the max
    s = e.sum(dim=0)
    covered = s != 0  # a NaN (non-finite score) stays NaN rather than counting as uncovered
    s_safe = torch.where(covered, s, torch.ones_like(s))
    lse = torch.where(covered, torch.log(s_safe) + m, torch.full_like(s, -math.inf))
    weights = e.transpose(-1, -2).unsqueeze(-1)  # (k, ..., n, H, 1)
    total = (weights * torch.stack([o.to(wt) for o in outs])).sum(dim=0)
    out = total / s_safe.transpose(-1, -2).unsqueeze(-1)  # normalised once
    return out.to(L.dtype), lse.to(L.dtype)


def merge_state_(
    acc: torch.Tensor,
    m: torch.Tensor,
    den: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    first: bool = False,
) -> None:
    """Add ``(out_b, lse_b)`` to a running merge, in place (possibly strided views): ``acc``
    (..., D) the unnormalised sum ``sum_i exp(lse_i - m) out_i``, ``m`` (..., 1) the largest
    ``lse_i`` so far and ``den`` (..., 1) the sum of the weights ``exp(lse_i - m)``, all three in
    :func:`merge_dtype`; ``out_b`` (..., D), ``lse_b`` (..., 1). ``first``: the state holds nothing
    yet here (it is set from the part). :func:`finish_state` gives ``(out, lse)``. Not
    differentiable."""
    if first:
        acc.copy_(out_b)
        m.copy_(lse_b)
        den.copy_(torch.where(torch.isneginf(lse_b), 0.0, 1.0).to(den.dtype))
        return
    new, ca, cb = _state_weights(m, lse_b.to(m.dtype))
    acc.mul_(ca).add_(out_b.to(acc.dtype) * cb)
    den.mul_(ca).add_(cb)
    m.copy_(new)


def merged_state(
    acc: torch.Tensor, m: torch.Tensor, den: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`merge_state_` (not ``first``) leaves in the state, out of place: ``(acc, m,
    den)``. Not differentiable."""
    new, ca, cb = _state_weights(m, lse_b.to(m.dtype))
    return acc * ca + out_b.to(acc.dtype) * cb, new, den * ca + cb


def finish_state(acc: torch.Tensor, m: torch.Tensor, den: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a running merge: ``out = acc / den`` (..., D), ``lse = m + log(den)``
    (..., 1); out 0 and lse -inf where no part covered the row, NaN where a part was NaN."""
    covered = den != 0
    den_safe = torch.where(covered, den, torch.ones_like(den))
    out = torch.where(covered, acc / den_safe, torch.zeros_like(acc))
    lse = torch.where(covered, m + torch.log(den_safe), torch.full_like(m, -math.inf))
    return out, lse


def _state_weights(m: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The new running max and the weights ``exp(m - new)``, ``exp(lse_b - new)`` of the state and
    of the part: 0 where both are -inf, NaN where either is NaN."""
    new = torch.maximum(m, lse_b)  # NaN propagates
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    return new, torch.exp(m - safe), torch.exp(lse_b - safe)
