"""The gather path of a decode step: the keys a query reads, gathered from a full cache."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._validation import accumulation_dtype

# Gathered keys per chunk of queries (elements of (B, m, slots, Hkv, D)): bounds the memory of a
# call with many queries (a chunked prefill).
_GATHER_BUDGET = 1 << 25


def decode_key_positions(
    pos: torch.Tensor,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    max_position: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys that queries at positions ``pos`` read, as gather slots.

    Args:
        pos: int64 query positions, any shape ``S``; a negative position is a padding query that
            reads nothing.
        num_heads: the number of query heads ``Hq``.
        segment_lengths, dilation_rates: the branches (checked).
        max_position: an upper bound of ``pos`` (saves a device sync when known).

    Returns:
        ``(keys, mask)``: ``keys`` (*S, K) int64 key positions (clamped to >= 0 where unused) and
        ``mask`` (*S, Hq, K) bool, whether head ``h`` of the query reads that slot. ``K`` is at
        most ``sum_i ceil(w_i / r_i)``; a key read through two branches fills two slots.
    """
    if max_position is None:
        max_position = int(pos.max()) if pos.numel() else -1
    heads = torch.arange(num_heads, device=pos.device)
    keys, masks = [], []
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        n = min(max_position, w - 1) // r + 1 if max_position >= 0 else 0  # slots of this branch
        if n == 0:
            continue
        step = torch.arange(n, device=pos.device) * r  # (n,)
        t = pos.remainder(w)  # index in the segment, (*S,)
        reads = (step <= t[..., None]) & (pos[..., None] >= 0)  # same segment and x <= p, (*S, n)
        covers = t.remainder(r)[..., None] == heads.remainder(r)  # head h covers (p, h), (*S, Hq)
        keys.append((pos[..., None] - step).clamp(min=0))
        masks.append(covers[..., :, None] & reads[..., None, :])  # (*S, Hq, n)
    if not keys:
        return pos.new_zeros((*pos.shape, 0)), torch.zeros(
            (*pos.shape, num_heads, 0), dtype=torch.bool, device=pos.device
        )
    return torch.cat(keys, dim=-1), torch.cat(masks, dim=-1)


def _gather_slots(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The slots ``idx`` (B, m, K) of a (B, Ncap, Hkv, D) cache, as (B, m, Hkv, K, D).

    Reads whole rows of D values with one ``index_select`` on a (rows, D) view of the cache's
    memory where the layout allows (any layout with D contiguous and the other strides multiples
    of a common row stride: (B, N, H, D), or (B, H, N, D) seen through ``.transpose(1, 2)``),
    several times faster than advanced indexing of scattered slots; other layouts index.
    """
    B, Ncap, H, D = cache.shape
    strides = [st if n > 1 else 0 for n, st in zip(cache.shape[:3], cache.stride()[:3], strict=True)]
    row = math.gcd(*strides)
    if cache.stride(3) != 1 or row < D or torch.compiler.is_compiling():  # (no storage_offset there)
        b = torch.arange(B, device=idx.device)[:, None, None]
        return cache[b, idx].transpose(2, 3)
    s0, s1, s2 = strides
    rows = (B - 1) * s0 // row + (Ncap - 1) * s1 // row + (H - 1) * s2 // row + 1
    flat = cache.as_strided((rows, D), (row, 1), cache.storage_offset())
    b = torch.arange(B, device=idx.device)[:, None, None, None] * (s0 // row)
    h = torch.arange(H, device=idx.device)[:, None] * (s2 // row)
    offsets = b + h + idx[:, :, None, :] * (s1 // row)  # (B, m, H, K) row numbers
    return flat.index_select(0, offsets.reshape(-1)).view(*offsets.shape, D)


def _gather_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    leftpad: torch.Tensor,
    segs: Sequence[int],
    rates: Sequence[int],
    scale: float,
    max_position: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, m, Hq, D) at cache slots ``slots`` (B, m), position ``slot - leftpad`` (at most
    ``max_position``), against the caches (B, Ncap, Hkv, D). Returns out (B, m, Hq, D) in q's
    dtype and lse (B, Hq, m)."""
    B, m, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    ct = accumulation_dtype(q.dtype)
    pos = slots - leftpad[:, None]  # (B, m)
    keys, mask = decode_key_positions(pos, Hq, segs, rates, max_position)  # (B, m, K), (B, m, Hq, K)
    K = keys.shape[-1]
    idx = (keys + leftpad[:, None, None]).clamp(max=k_cache.shape[1] - 1)  # cache slots of the keys
    kg = _gather_slots(k_cache, idx).to(ct)  # (B, m, Hkv, K, D): only the keys read
    # Slots that no head reads get weight 0; zero their values too, so that a slot never written
    # (an uninitialised cache) cannot turn 0 * NaN into NaN.
    vg = _gather_slots(v_cache, idx).to(ct).masked_fill_(~mask.any(dim=2)[:, :, None, :, None], 0)
    s = torch.matmul(q.to(ct).view(B, m, Hkv, G, D), kg.transpose(-1, -2)) * scale  # (B, m, Hkv, G, K)
    s = s.view(B, m, Hq, K).masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, m, Hq); -inf where no slot is read
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.matmul(p.view(B, m, Hkv, G, K), vg).view(B, m, Hq, D)
    return out.to(q.dtype), lse.transpose(1, 2)
