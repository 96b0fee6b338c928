"""The functional API."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _validation as V
from .backends import BackendSelector, check_backend_name, default_selector
from .flops import accumulation_dtype

__all__ = ["dilated_attention"]


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
            manual``) with one logged WARNING; see ``dilated_attention.backends``.

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


def _attention(
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
    selector: BackendSelector | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`dilated_attention` with the backend chosen by ``selector`` (one per module)."""
    check_backend_name(backend)
    V.check_qkv(q, k, v)
    segs, rates = V.normalize_branches(segment_lengths, dilation_rates)
    is_causal = V.check_bool(is_causal, "is_causal")
    return_lse = V.check_bool(return_lse, "return_lse")
    scale = V.check_scale_for_dtype(V.resolve_scale(softmax_scale, q.shape[-1]), q.dtype)
    dropout_p = V.check_dropout(dropout_p)
    B, N, Hq, _ = q.shape
    if B == 0 or N == 0:
        # Empty, but connected to the inputs so that autograd gives (empty) gradients.
        zero = q.sum() + k.sum() + v.sum()  # 0 for empty inputs
        out = q * 0 + zero
        acc = accumulation_dtype(q.dtype)
        lse = q.new_zeros((B, Hq, N), dtype=acc) + zero.to(acc)
        return (out, lse) if return_lse else out
    impl = (selector or default_selector()).select(backend, q, k, dropout_p)
    segs, rates = V.effective_branches(segs, rates, N, Hq)
    out, lse = impl.forward(
        q, k, v, segs, rates, is_causal=is_causal, softmax_scale=scale, dropout_p=dropout_p
    )
    return (out, lse) if return_lse else out
