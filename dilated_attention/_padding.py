"""Padding masks to packed sequences (SPEC section 7).

A mask (B, N), True (or 1) = a real token, whose real tokens form one contiguous run per row (right
padding, or left padding as in batched generation) is a packed batch: row ``b``'s run is sequence
``b``, attended as a sequence of its own from position 0. The real rows are gathered into (T, H, D),
run through :func:`dilated_attention.functional._attention_varlen`, and scattered back; padded
positions get output 0 and no gradient, and cost nothing.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PackedRows", "pack_padding_mask"]


class PackedRows:
    """The real rows of a padded batch: ``index`` (T,) into the flattened (B * N) rows, in order;
    ``cu_seqlens`` int32 (B + 1,); ``lengths`` (B ints) and ``max_seqlen`` on the host."""

    def __init__(self, index: torch.Tensor, cu_seqlens: torch.Tensor, lengths: list[int], full: bool):
        self.index = index
        self.cu_seqlens = cu_seqlens
        self.lengths = lengths
        self.max_seqlen = max(lengths, default=0)
        self.full = full  # no padding at all

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, ...) -> (T, ...): the real rows."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.index)

    def scatter(self, x: torch.Tensor, B: int, N: int) -> torch.Tensor:
        """(T, ...) -> (B, N, ...), zeros at padded positions (differentiable)."""
        out = x.new_zeros((B * N, *x.shape[1:]))
        return out.index_copy(0, self.index, x).view(B, N, *x.shape[1:])


def pack_padding_mask(mask: Any, B: int, N: int, device: torch.device) -> PackedRows:
    """Check ``mask`` ((B, N), bool or 0/1, True = real token, one contiguous run per row) and give
    its real rows. Raises ValueError naming the first row whose real tokens are not contiguous."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != (B, N):
        raise ValueError(f"key_padding_mask must have shape (B, N) = {(B, N)}, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if mask.is_complex() or not ((mask == 0) | (mask == 1)).all():
            raise ValueError(
                f"key_padding_mask must be bool or hold only 0 and 1 (1 = real token), got {mask.dtype} "
                "with other values"
            )
        mask = mask != 0
    mask = mask.to(device)
    ar = torch.arange(N, device=device)
    count = mask.sum(1)  # (B,)
    first = torch.where(mask, ar, N).amin(1) if N else count
    last = torch.where(mask, ar, -1).amax(1) if N else count
    gaps = (count > 0) & (last - first + 1 != count)  # (B,)
    stats = torch.stack([count, gaps.long()], 1).tolist()  # one read on the host
    for b, (_, gap) in enumerate(stats):
        if gap:
            row = "".join("1" if x else "0" for x in mask[b, : min(N, 64)].tolist())
            raise ValueError(
                f"key_padding_mask row {b} is not one contiguous run of real tokens (True = real token); "
                f"row {b} starts {row}{'...' if N > 64 else ''}"
            )
    lengths = [int(c) for c, _ in stats]
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    index = mask.reshape(-1).nonzero().squeeze(1)
    return PackedRows(index, cu, lengths, full=sum(lengths) == B * N)
