"""Padding masks to packed sequences (SPEC section 7).

A mask (B, N), True (or 1) = a real token, whose real tokens form one contiguous run per row (right
padding, or left padding as in batched generation) is a packed batch: row ``b``'s run is sequence
``b``, attended as a sequence of its own from position 0. The real rows are gathered into (T, H, D),
run through :func:`dilated_attention.functional._attention_varlen`, and scattered back; padded
positions get output 0 and no gradient, and cost nothing.

Where nothing can be read on the host (under ``torch.compile``, or for meta and fake tensors),
:class:`StaticRows` lays the same rows out in a shape that does not depend on the mask's values:
each row's real tokens first (sequence ``2b``), its padded ones after them (sequence ``2b + 1``,
zeroed, attended among themselves and dropped). Real positions get the same result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["PackedRows", "StaticRows", "check_padding_mask", "has_no_data", "pack_padding_mask"]


def has_no_data(*tensors: torch.Tensor) -> bool:
    """True where the values of ``tensors`` cannot be read on the host: under ``torch.compile``,
    or for meta and fake tensors (shape propagation, ``torch.export``)."""
    if torch.compiler.is_compiling():
        return True
    return any(t.device.type == "meta" or is_fake(t) for t in tensors)


def check_padding_mask(mask: Any, B: int, N: int, device: torch.device) -> torch.Tensor:
    """``mask`` as a bool (B, N) tensor on ``device`` (True = real token), after checking its type
    and shape, and its values where they can be read (bool, or only 0 and 1)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != (B, N):
        raise ValueError(f"key_padding_mask must have shape (B, N) = {(B, N)}, got {tuple(mask.shape)}")
    if mask.device.type == "meta" and device.type != "meta":
        raise ValueError(f"key_padding_mask is a meta tensor (it holds no values) but q is on {device}")
    if mask.dtype != torch.bool:
        if mask.is_complex():
            raise ValueError(
                f"key_padding_mask must be bool or hold only 0 and 1 (1 = real token), got {mask.dtype}"
            )
        if not has_no_data(mask):
            bad = ((mask != 0) & (mask != 1)).nonzero()
            if len(bad):
                row, col = bad[0].tolist()
                raise ValueError(
                    f"key_padding_mask must be bool or hold only 0 and 1 (1 = real token), got "
                    f"{mask[row, col].item()!r} at [{row}, {col}] ({mask.dtype}; a mask in "
                    "nn.MultiheadAttention's convention, True or -inf = padding, is for DropInMultiheadAttention)"
                )
        mask = mask != 0
    return mask.to(device)


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
    mask = check_padding_mask(mask, B, N, device)
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


class StaticRows:
    """The rows of a padded batch in a layout whose shape does not depend on the mask's values (for
    ``torch.compile`` and meta/fake tensors): row ``b``'s real tokens first, in order, then its
    padded ones, zeroed; ``cu_seqlens`` int32 (2B + 1,) makes the real run of row ``b`` sequence
    ``2b`` and its padding sequence ``2b + 1``; ``max_seqlen`` is N. A row whose real tokens are not
    one contiguous run fails a device-side assertion (the values cannot be read on the host here)."""

    def __init__(self, real: torch.Tensor):
        N = real.shape[1]
        ar = torch.arange(N, device=real.device)
        count = real.sum(1)  # (B,)
        first = torch.where(real, ar, N).amin(1)
        last = torch.where(real, ar, -1).amax(1)
        gaps = (count > 0) & (last - first + 1 != count)
        torch._assert_async(
            gaps.any().logical_not(),
            "key_padding_mask: the real tokens of a row are not one contiguous run",
        )
        self.real = real
        self.order = torch.argsort(real.logical_not().to(torch.int32), dim=1, stable=True)  # (B, N)
        lengths = torch.stack([count, N - count], 1).reshape(-1)  # (2B,)
        self.cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        self.max_seqlen = N

    def _index(self, x: torch.Tensor) -> torch.Tensor:
        return self.order.view(*self.order.shape, *([1] * (x.dim() - 2))).expand_as(x)

    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        return self.real.view(*self.real.shape, *([1] * (x.dim() - 2)))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, ...) -> (B * N, ...): each row's real tokens first, then its padding as zeros."""
        x = torch.where(self._keep(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
        return x.gather(1, self._index(x)).flatten(0, 1)

    def scatter(self, x: torch.Tensor, B: int, N: int) -> torch.Tensor:
        """(B * N, ...) -> (B, N, ...) in the original order, zeros at padded positions."""
        x = x.view(B, N, *x.shape[1:])
        out = torch.zeros_like(x).scatter(1, self._index(x), x)
        return torch.where(self._keep(out), out, torch.zeros((), dtype=x.dtype, device=x.device))
