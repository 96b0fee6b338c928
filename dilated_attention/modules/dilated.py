"""``DilatedAttention``: LongNet dilated attention on already projected heads (no parameters).

It chooses its attention backend once per device and dtype (see :mod:`dilated_attention.backends`)
and can run the tokens of a 2-D grid in Hilbert-curve order (``ordering="hilbert", grid=(height,
width)``): q, k and v are permuted into curve order before the attention and the output is permuted
back, so that each segment is a compact patch of the image rather than a thin strip of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .. import _validation as V
from .._padding import PackedRows, StaticRows, check_padding_mask, has_no_data, pack_padding_mask
from ..backends import BackendSelector, check_backend_name
from ..functional import _attention, _attention_varlen
from ._options import check_ordering, hilbert_permutation
from ._script import NotScriptable

__all__ = ["DilatedAttention"]


def attention_rows(
    rows: PackedRows | StaticRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any
) -> torch.Tensor:
    """``out`` (B, N, Hq, D) of a padded batch whose real tokens ``rows`` finds: gathered into packed
    sequences, run in one call of :func:`~dilated_attention.functional._attention_varlen` (``args``
    and ``kw``: its branches, lengths and keywords) and scattered back (0 at padded positions)."""
    packed = (rows.gather(q), rows.gather(k), rows.gather(v))
    out, _ = _attention_varlen(*packed, rows.cu_seqlens, rows.max_seqlen, *args, **kw)  # (T, Hq, D)
    return rows.scatter(out, *q.shape[:2])


class DilatedAttention(NotScriptable, nn.Module):
    """LongNet dilated attention on already projected heads (no parameters).

    Args:
        segment_lengths: ``[w_1, ..., w_k]``, one per branch.
        dilation_rates: ``[r_1, ..., r_k]``, ``1 <= r_i <= w_i``.
        softmax_scale: multiplies the scores; ``1/sqrt(D)`` when None.
        attention_dropout: dropout on the attention weights, applied in training mode only.
        attention_backend: ``"auto"``, ``"native"``, ``"flash_attn_3"``, ``"flash_attn_2"``,
            ``"xformers"``, ``"sdpa"`` or ``"manual"``; chosen once per device and dtype, with the
            fallback rules of :mod:`dilated_attention.backends`.
        ordering: ``"sequence"`` (tokens as given) or ``"hilbert"`` (tokens of a ``grid`` in
            row-major order are attended in Hilbert-curve order; the output is in row-major order).
        grid: ``(height, width)`` of the token grid, with ``ordering="hilbert"`` only.

    ``forward(q, k, v, is_causal=False, key_padding_mask=None)``: q (B, N, Hq, D), k and v
    (B, N, Hkv, D) with ``Hq % Hkv == 0``; returns (B, N, Hq, D).

    ``key_padding_mask`` (B, N), bool or 0/1: **True (1) marks a real token, False (0) padding** (the
    opposite of ``nn.MultiheadAttention``, whose True means "ignore"; :class:`DropInMultiheadAttention`
    takes torch's convention). The real tokens of each row
    must form one contiguous run (right padding, or left padding as in batched generation; a row
    with a gap is a ValueError naming it). Each row's run is attended as a sequence of its own
    starting at position 0 (SPEC section 7), with no work on padded positions; padded positions
    give output 0 and no gradient. Under ``torch.compile`` (one graph, ``fullgraph=True`` works with
    the ``native`` backend) and for meta or fake tensors, nothing is read on the host: the rows are
    laid out in a shape that does not depend on the mask, padded positions are zeroed and attended
    among themselves, and a row with a gap fails a device-side assertion instead of the ValueError.
    """

    def __init__(
        self,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        softmax_scale: float | None = None,
        attention_dropout: float = 0.0,
        attention_backend: str = "auto",
        ordering: str = "sequence",
        grid: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.segment_lengths, self.dilation_rates = V.normalize_branches(segment_lengths, dilation_rates)
        self.softmax_scale = None if softmax_scale is None else V.resolve_scale(softmax_scale, 1)
        self.attention_dropout = V.check_dropout(attention_dropout)
        self.attention_backend = check_backend_name(attention_backend)
        self.ordering, self.grid = check_ordering(ordering, grid)
        self._selector = BackendSelector(type(self).__name__)
        self._curves: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _curve(self, N: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.grid is not None  # ordering == "hilbert"
        H, W = self.grid
        if N != H * W:
            raise ValueError(
                f"ordering='hilbert' with grid=(height={H}, width={W}) needs sequence length "
                f"height * width = {H * W}, got N={N}"
            )
        curve = self._curves.get(device)
        if curve is None:
            with torch.inference_mode(False):  # kept for later calls, which may be training ones
                perm, inv = hilbert_permutation(H, W)
                curve = self._curves[device] = (perm.to(device), inv.to(device))
        return curve

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dropout_p = self.attention_dropout if self.training else 0.0
        if key_padding_mask is not None:
            return self._forward_padded(q, k, v, is_causal, key_padding_mask, dropout_p)
        if self.ordering == "hilbert":
            V.check_qkv(q, k, v)
            perm, inv = self._curve(q.shape[1], q.device)
            q, k, v = (t.index_select(1, perm) for t in (q, k, v))  # (B, N, H, D) in curve order
        out, _ = _attention(
            q, k, v, self.segment_lengths, self.dilation_rates, **self._options(is_causal, dropout_p)
        )
        if self.ordering == "hilbert":
            out = out.index_select(1, inv)  # back to row-major order
        return out

    if TYPE_CHECKING:  # nn.Module.__call__ is typed as returning Any; give callers forward's types
        __call__ = forward

    def _forward_padded(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool,
        key_padding_mask: torch.Tensor,
        dropout_p: float,
    ) -> torch.Tensor:
        """The rows of ``key_padding_mask`` as packed sequences (see the class docstring)."""
        if self.ordering == "hilbert":
            raise ValueError("key_padding_mask is not supported with ordering='hilbert' (a padded grid)")
        V.check_qkv(q, k, v)
        B, N = q.shape[:2]
        rows: PackedRows | StaticRows
        if isinstance(key_padding_mask, torch.Tensor) and has_no_data(q, key_padding_mask):
            # Nothing can be read on the host: a layout of fixed shape, one graph under torch.compile.
            real = check_padding_mask(key_padding_mask, B, N, q.device)
            if N == 0:
                return self.forward(q, k, v, is_causal=is_causal)
            rows = StaticRows(real)
            # Meta tensors have shapes only: any lengths of the layout's shape give the right ones.
            meta_lengths = [N, 0] * B if q.device.type == "meta" else None
        else:
            rows = pack_padding_mask(key_padding_mask, B, N, q.device)
            if rows.full:  # nothing is padded
                return self.forward(q, k, v, is_causal=is_causal)
        options = self._options(is_causal, dropout_p)
        options["lengths"] = rows.lengths if isinstance(rows, PackedRows) else meta_lengths
        return attention_rows(rows, q, k, v, self.segment_lengths, self.dilation_rates, **options)

    def _options(self, is_causal: bool, dropout_p: float) -> dict[str, Any]:
        """The keywords of this module's calls of the functional core."""
        return {
            "is_causal": is_causal,
            "softmax_scale": self.softmax_scale,
            "dropout_p": dropout_p,
            "backend": self.attention_backend,
            "selector": self._selector,
        }

    @property
    def selected_backends(self) -> str:
        """The backends chosen so far, e.g. ``"native (cpu float32)"``."""
        return self._selector.describe()

    def extra_repr(self) -> str:
        s = f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}"
        if self.softmax_scale is not None:
            s += f", softmax_scale={self.softmax_scale}"
        s += f", attention_dropout={self.attention_dropout}, attention_backend={self.attention_backend!r}"
        s += f" (in use: {self._selector.describe()})"
        if self.ordering != "sequence":
            s += f", ordering={self.ordering!r}, grid={self.grid}"
        return s


class BranchesOfInner:
    """For a layer that attends through ``self.attention`` (a :class:`DilatedAttention` or a module
    with its attributes): that module's branches, as the layer's own."""

    attention: DilatedAttention

    @property
    def segment_lengths(self) -> list[int]:
        return self.attention.segment_lengths

    @property
    def dilation_rates(self) -> list[int]:
        return self.attention.dilation_rates
