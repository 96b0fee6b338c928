"""The functional API: :func:`dilated_attention` and :func:`dilated_attention_varlen`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from ._core import _attention, _attention_varlen

__all__ = ["dilated_attention", "dilated_attention_varlen"]


@overload
def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    is_causal: bool = ...,
    softmax_scale: float | None = ...,
    dropout_p: float = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
) -> torch.Tensor: ...


@overload
def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    is_causal: bool = ...,
    softmax_scale: float | None = ...,
    dropout_p: float = ...,
    return_lse: Literal[True],
    backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    is_causal: bool = ...,
    softmax_scale: float | None = ...,
    dropout_p: float = ...,
    return_lse: bool = ...,
    backend: str = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    is_causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LongNet dilated attention.

    Args:
        q: queries, (B, N, Hq, D).
        k, v: keys and values, (B, N, Hkv, D), with ``Hq % Hkv == 0`` (grouped-query attention:
            query head ``h`` reads key/value head ``h // (Hq // Hkv)``).
        segment_lengths: ``[w_1, ..., w_k]``, one per branch, each >= 1 (``w > N`` makes the whole
            sequence one segment; the last segment may be shorter than ``w``).
        dilation_rates: ``[r_1, ..., r_k]``, ``1 <= r_i <= w_i``. Head ``h`` of branch ``i`` reads
            the positions whose index in their segment is ``h % r_i`` modulo ``r_i``.
        is_causal: each query attends only to keys at positions ``<= `` its own.
        softmax_scale: multiplies the scores; ``1/sqrt(D)`` by default.
        dropout_p: attention dropout on the normalised weights (use only in training).
        return_lse: also return the log-sum-exp of the scores, (B, Hq, N), float32 (float64 for
            float64 inputs); ``-inf`` for rows that no branch covers.
        backend: which implementation runs: ``"auto"`` (the fastest that can run these inputs on
            this device), ``"native"``, ``"flash_attn_3"``, ``"flash_attn_2"``, ``"xformers"``,
            ``"sdpa"`` or ``"manual"``. A backend that cannot run falls back along
            ``flash_attn_3 -> flash_attn_2 -> sdpa -> manual`` (``xformers``/``native -> sdpa ->
            manual``) with one :class:`~dilated_attention.BackendFallbackWarning`; see
            ``dilated_attention.backends``.

    Returns:
        ``out`` (B, N, Hq, D) in q's dtype, or ``(out, lse)`` when ``return_lse``.
    """
    return _attention(
        q,
        k,
        v,
        segment_lengths,
        dilation_rates,
        is_causal=is_causal,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        return_lse=return_lse,
        backend=backend,
    )


@overload
def dilated_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    is_causal: bool = ...,
    softmax_scale: float | None = ...,
    dropout_p: float = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
) -> torch.Tensor: ...


@overload
def dilated_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    is_causal: bool = ...,
    softmax_scale: float | None = ...,
    dropout_p: float = ...,
    return_lse: Literal[True],
    backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def dilated_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    is_causal: bool = ...,
    softmax_scale: float | None = ...,
    dropout_p: float = ...,
    return_lse: bool = ...,
    backend: str = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def dilated_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    is_causal: bool = False,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LongNet dilated attention on packed sequences (FlashAttention's varlen convention, SPEC
    section 7).

    Args:
        q: queries of all sequences, one after another, (T, Hq, D).
        k, v: keys and values, (T, Hkv, D), ``Hq % Hkv == 0``.
        cu_seqlens: int32 (S + 1,) on q's device: ``cu_seqlens[0] = 0``, non-decreasing,
            ``cu_seqlens[S] = T``. Sequence ``i`` is the rows ``[cu_seqlens[i], cu_seqlens[i+1])``
            and is a sequence of its own: positions, segments, head phases and causal masking start
            again at its first row, and no query reads a key of another sequence. Empty sequences
            are allowed.
        max_seqlen: the length of the longest sequence (or more; an error if one is longer).
        segment_lengths, dilation_rates, is_causal, softmax_scale, dropout_p, backend: as in
            :func:`dilated_attention`, applied to each sequence.
        return_lse: also return the log-sum-exp, (Hq, T), float32 (float64 for float64 inputs).

    The result equals :func:`dilated_attention` run on each sequence alone, forward and backward.
    The ``native`` backend runs all sequences in one call of the fused kernels; the gather-based
    backends read the sequence lengths on the host (``cu_seqlens.tolist()``) to build their index
    tensors (cached per lengths, branch and head offset).

    Returns:
        ``out`` (T, Hq, D) in q's dtype, or ``(out, lse)`` when ``return_lse``.
    """
    return _attention_varlen(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        segment_lengths,
        dilation_rates,
        is_causal=is_causal,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        return_lse=return_lse,
        backend=backend,
    )
