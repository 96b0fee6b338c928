"""The log-sum-exp merge of partial attention results (SPEC section 3), written once.

Partial results over disjoint key sets, ``(out_i, lse_i)``, combine to the result over the union
of the key sets:

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i.

This is how the branches of one query are mixed (the gather-based backends) and how the parts of
a rank's rows are combined (sequence parallelism: the local runs, and the pieces of a segment that
spans ranks). A row that no part covers has ``out = 0`` and ``lse = -inf`` and stays so: no NaN.

The rule is a running merge, the kernels' own: a state ``(acc, m, den)`` holds the unnormalised
sum ``acc = sum_i exp(lse_i - m) out_i``, the largest ``lse_i`` so far ``m`` (so each exponent is
exact) and the sum of the weights ``den = sum_i exp(lse_i - m)``; :func:`finish_state` divides
once, ``out = acc / den`` and ``lse = m + log(den)``. It computes in :func:`merge_dtype`: float64
for float32 (and float64) parts, float32 for float16/bfloat16. :func:`start_state` begins a state
from one part, :func:`merge_state_` adds a part in place, :func:`merged_state` out of place (and
differentiably), and :func:`merge` folds a list of parts with them.

A merge that went through a float32 running ``lse`` (``logaddexp`` rounded after every part) would
put that rounding, half a unit in the last place of ``|lse|`` (tens of float32 epsilons when
``|lse|`` is tens), into the weight of every part merged before, and ``1/3``-style weights rounded
before the sum would move an ``out`` that several branches see alike (a key counted three times)
off ``v``: several times plain PyTorch's error in ``out``.

Layout: the state and the parts put a row's lse beside its out, ``out`` (..., D) and ``lse``
(..., 1); :func:`merge` takes the op's layout, ``out`` (..., n, H, D) and ``lse`` (..., H, n).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "across",
    "beside",
    "finish_state",
    "merge",
    "merge_dtype",
    "merge_state_",
    "merged_state",
    "start_state",
]

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (acc, m, den) of a running merge


def merge_dtype(dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The dtype :func:`merge` and the merge state compute in for parts (or inputs) in ``dtype``:
    float64 for float32 and float64 (float32 on a device without float64, such as mps), float32
    for float16 and bfloat16."""
    if dtype in (torch.float32, torch.float64) and (device is None or device.type != "mps"):
        return torch.float64
    return torch.float32


def start_state(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> State:
    """The state ``(acc, m, den)`` of one part, ``out`` (..., D) and ``lse`` (..., 1), in ``dtype``
    (new tensors, differentiable): the part itself, with weight 1 (0 where ``lse`` is -inf)."""
    m = lse.to(dtype, copy=True)
    return out.to(dtype, copy=True), m, _unit_weight(m)


def _unit_weight(lse: torch.Tensor) -> torch.Tensor:
    """The weight of a part that starts a state: 1, or 0 where its ``lse`` is -inf (no key)."""
    return torch.where(torch.isneginf(lse), 0.0, 1.0).to(lse.dtype)


def merge_state_(
    acc: torch.Tensor,
    m: torch.Tensor,
    den: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    first: bool = False,
) -> None:
    """Add ``(out_b, lse_b)`` to a running merge, in place (possibly strided views): ``acc``
    (..., D), ``m`` and ``den`` (..., 1), as the module's docstring says; ``out_b`` (..., D),
    ``lse_b`` (..., 1). ``first``: the state holds nothing yet here (it is set from the part, as
    :func:`start_state`). A state of nothing (``acc`` 0, ``m`` -inf, ``den`` 0) may also be merged
    into. Not differentiable."""
    if first:  # copied into the (possibly strided) state, no intermediate tensors
        acc.copy_(out_b)
        m.copy_(lse_b)
        den.copy_(_unit_weight(lse_b))
        return
    new, ca, cb = _state_weights(m, lse_b.to(m.dtype))
    acc.mul_(ca).add_(out_b.to(acc.dtype) * cb)
    den.mul_(ca).add_(cb)
    m.copy_(new)


def merged_state(
    acc: torch.Tensor, m: torch.Tensor, den: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> State:
    """What :func:`merge_state_` (not ``first``) leaves in the state, out of place: ``(acc, m,
    den)``. Differentiable: the running max is taken detached (the merged ``out`` and ``lse`` do not
    depend on it), so gradients reach each part through its weight alone."""
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
    """The new running max (detached) and the weights ``exp(m - new)``, ``exp(lse_b - new)`` of the
    state and of the part: 0 where both are -inf, NaN where either is NaN."""
    new = torch.maximum(m.detach(), lse_b.detach())  # NaN propagates
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    return new, torch.exp(m - safe), torch.exp(lse_b - safe)


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable merge of several partial results in the op's layout, outs (..., n, H, D) and
    lses (..., H, n): the running merge of the parts in :func:`merge_dtype` of the lses, returned
    in the dtype of the lses (one part is returned as it is). Gradients are exact through the
    mixing weights."""
    if not outs or len(outs) != len(lses):
        raise ValueError(
            f"merge takes one lse per out and at least one part, got {len(outs)} outs and {len(lses)} lses"
        )
    if len(outs) == 1:
        return outs[0], lses[0]
    dtype = lses[0].dtype
    wt = merge_dtype(dtype, lses[0].device)
    state = start_state(outs[0], beside(lses[0]), wt)
    for out, lse in zip(outs[1:], lses[1:], strict=True):
        state = merged_state(*state, out, beside(lse))
    out, lse = finish_state(*state)
    return out.to(dtype), across(lse).to(dtype).contiguous()


def beside(lse: torch.Tensor) -> torch.Tensor:
    """An lse in the op's layout (..., H, n) as the state reads it, (..., n, H, 1) beside its out
    (..., n, H, D): a view."""
    return lse.transpose(-1, -2).unsqueeze(-1)


def across(lse: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`beside`: an lse (..., n, H, 1) in the op's layout (..., H, n), a view."""
    return lse.squeeze(-1).transpose(-1, -2)
