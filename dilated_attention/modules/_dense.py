"""Dilated attention with its (N, N) weights formed, for ``need_weights=True`` in
:class:`DropInMultiheadAttention`.

``nn.MultiheadAttention(need_weights=True)`` forms the dense weights and multiplies them with the
values; this does the same for the dilated pattern (SPEC sections 2-3): the weight of key ``x`` for
query ``p`` of head ``h`` is ``m * exp(score) / S(p)``, ``m`` the number of branches through which
``p`` reads ``x``. Memory grows with ``N^2``, as torch's does with ``need_weights=True``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _validation as V
from .._validation import accumulation_dtype

__all__ = ["dense_dilated_attention"]


def multiplicity(
    segment_lengths: list[int],
    dilation_rates: list[int],
    num_heads: int,
    real: torch.Tensor,
    is_causal: bool,
) -> torch.Tensor:
    """(B, H, N, N) int: through how many branches query ``p`` of head ``h`` reads key ``x``.
    ``real`` (B, N) bool marks each row's real tokens (one contiguous run, counted from position 0
    at its first token, SPEC section 7); padded tokens read and are read by nothing."""
    B, N = real.shape
    device = real.device
    ar = torch.arange(N, device=device)
    first = torch.where(real, ar, N).amin(1, keepdim=True) if N else ar[None]
    pos = ar[None] - first  # (B, N): the position of each token in its row's run
    heads = torch.arange(num_heads, device=device)[None, :, None]  # (1, H, 1)
    count = torch.zeros(B, num_heads, N, N, dtype=torch.int32, device=device)
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        seg, t = pos.div(w, rounding_mode="floor"), pos.remainder(w)
        same = (seg[:, :, None] == seg[:, None, :])[:, None]  # (B, 1, N, N)
        covered = t[:, None, :].remainder(r) == heads.remainder(r)  # (B, H, N)
        count += (same & covered[..., :, None] & covered[..., None, :]).to(torch.int32)
    keep = real[:, :, None] & real[:, None, :]
    if is_causal:
        keep = keep & (pos[:, None, :] <= pos[:, :, None])
    return count * keep[:, None].to(torch.int32)


def dense_dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    *,
    is_causal: bool,
    real: torch.Tensor | None,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, weights)``: q, k, v (B, N, H, D); out (B, N, H, D); weights (B, H, N, N) in q's dtype,
    after dropout (as ``nn.MultiheadAttention`` returns them). Rows that read no key, padded ones
    included, have weight 0 and output 0."""
    B, N, H, D = q.shape
    if N == 0:  # no rows, no keys: empty results, as torch gives
        return q.new_zeros(q.shape), q.new_zeros((B, H, 0, 0))
    if real is None:
        real = torch.ones(B, N, dtype=torch.bool, device=q.device)
    segs, rates = V.effective_branches(segment_lengths, dilation_rates, N, H)
    mult = multiplicity(segs, rates, H, real, is_causal)
    acc = torch.promote_types(accumulation_dtype(q.dtype), q.dtype)
    scores = torch.einsum("bphd,bxhd->bhpx", q.to(acc), k.to(acc)) / D**0.5
    scores = scores.masked_fill(mult == 0, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = mult.to(acc) * torch.exp(scores - top)  # 0 where mult == 0 (exp(-inf) = 0)
    total = e.sum(-1, keepdim=True)
    weights = (e / torch.where(total > 0, total, torch.ones_like(total))).to(q.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = torch.einsum("bhpx,bxhd->bphd", weights, v)
    return out, weights
