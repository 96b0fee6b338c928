"""The functional API: :func:`dilated_attention` and :func:`dilated_attention_varlen`, and their
checked core (``_attention``, ``_attention_varlen``: the backend chosen by a selector, the options
checked once, the result for empty inputs), which the modules call with their own selector."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch

from . import _validation as V
from ._padding import has_no_data
from ._validation import accumulation_dtype
from ._warnings import LayoutWarning, UncoveredPositionsWarning, warn_once
from .backends import BackendSelector, check_backend_name, default_selector
from .backends.base import Packed

# More heads than this in dimension 2 of q, with fewer positions in dimension 1, looks like a
# (B, H, N, D) tensor passed for (B, N, H, D).
_MAX_PLAUSIBLE_HEADS = 128


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
    return_lse = V.check_bool(return_lse, "return_lse")
    out, lse = _attention(
        q,
        k,
        v,
        segment_lengths,
        dilation_rates,
        is_causal=is_causal,
        softmax_scale=softmax_scale,
        dropout_p=dropout_p,
        backend=backend,
    )
    return (out, lse) if return_lse else out


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
    return_lse = V.check_bool(return_lse, "return_lse")
    out, lse = _attention_varlen(
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
        backend=backend,
    )
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# The checked core, shared with the modules (which pass their own selector)
# ---------------------------------------------------------------------------------------------


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
    backend: str = "auto",
    selector: BackendSelector | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`dilated_attention` with the backend chosen by ``selector`` (one per
    module; the process's default selector when None)."""
    check_backend_name(backend)
    V.check_qkv(q, k, v)
    segs, rates, is_causal, scale, dropout_p = _check_options(
        segment_lengths, dilation_rates, is_causal, softmax_scale, q.shape[-1], dropout_p, q.dtype
    )
    B, N, Hq, _ = q.shape
    if not torch.compiler.is_compiling():
        _advise(q, segs, rates)
    if B == 0 or N == 0:
        return _empty(q, k, v, (B, Hq, N))
    impl = (selector or default_selector()).select(backend, q, k, dropout_p, len(segs))
    segs, rates = V.effective_branches(segs, rates, N, Hq)
    return impl.forward(q, k, v, segs, rates, is_causal=is_causal, softmax_scale=scale, dropout_p=dropout_p)


def _attention_varlen(
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
    backend: str = "auto",
    selector: BackendSelector | None = None,
    lengths: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`dilated_attention_varlen` with the backend chosen by ``selector``;
    ``lengths``, when the caller knows them, spares reading ``cu_seqlens`` on the host."""
    check_backend_name(backend)
    max_seqlen = V.check_varlen_qkv(q, k, v, cu_seqlens, max_seqlen)
    segs, rates, is_causal, scale, dropout_p = _check_options(
        segment_lengths, dilation_rates, is_causal, softmax_scale, q.shape[-1], dropout_p, q.dtype
    )
    T, Hq, _ = q.shape
    segs, rates = V.effective_branches(segs, rates, max_seqlen, Hq)
    impl = (selector or default_selector()).select(
        backend, q.unsqueeze(0), k.unsqueeze(0), dropout_p, len(segs)
    )
    # The lengths, read and checked on the host where cu_seqlens has data. Under torch.compile
    # (or on the meta device) nothing is read back: the ops that check cu_seqlens themselves (the
    # native op, sdpa's C++ driver) stay in one graph; for the others torch.compile breaks the
    # graph to read them (an error with fullgraph=True, naming why), and meta or fake tensors
    # outside torch.compile cannot run them.
    if lengths is None:
        if not has_no_data(cu_seqlens):
            lengths = V.varlen_lengths(cu_seqlens, T, max_seqlen)
        elif impl.varlen_reads_lengths(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), dropout_p):
            if not torch.compiler.is_compiling():
                raise ValueError(
                    f"the {impl.name!r} backend reads the sequence lengths of cu_seqlens on the host, "
                    f"which a meta or fake tensor does not have; the 'native' backend and the 'sdpa' "
                    f"backend without dropout read them in their ops"
                )
            lengths = _lengths_on_the_host(cu_seqlens, T, max_seqlen)
    if T == 0:
        return _empty(q, k, v, (Hq, 0))
    return impl.forward_varlen(
        q,
        k,
        v,
        Packed(cu_seqlens, max_seqlen, lengths),
        segs,
        rates,
        is_causal=is_causal,
        softmax_scale=scale,
        dropout_p=dropout_p,
    )


@torch.compiler.disable(
    reason="a backend that reads the lengths of cu_seqlens on the host (manual, flash_attn, xformers, "
    "sdpa with dropout): the graph breaks to read them; backend='native' and 'sdpa' without dropout "
    "read them in their ops, in one graph"
)
def _lengths_on_the_host(cu_seqlens: torch.Tensor, T: int, max_seqlen: int) -> list[int]:
    """The sequence lengths of ``cu_seqlens``, read and checked outside torch.compile's graph."""
    return V.varlen_lengths(cu_seqlens, T, max_seqlen)


def _check_options(
    segment_lengths: Any,
    dilation_rates: Any,
    is_causal: Any,
    softmax_scale: Any,
    head_dim: int,
    dropout_p: Any,
    dtype: torch.dtype,
) -> tuple[list[int], list[int], bool, float, float]:
    """The checked options of both functions: (segs, rates, is_causal, scale, dropout_p); the scale
    must be finite in the inputs' ``dtype``."""
    segs, rates = V.normalize_branches(segment_lengths, dilation_rates)
    return (
        segs,
        rates,
        V.check_bool(is_causal, "is_causal"),
        V.check_scale_for_dtype(V.resolve_scale(softmax_scale, head_dim), dtype),
        V.check_dropout(dropout_p),
    )


def _empty(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The result for empty inputs, connected to them so that autograd gives (empty) gradients."""
    zero = q.sum() + k.sum() + v.sum()  # 0 for empty inputs
    out = q * 0 + zero
    acc = accumulation_dtype(q.dtype)
    lse = q.new_zeros(lse_shape, dtype=acc) + zero.to(acc)
    return out, lse


def _advise(q: torch.Tensor, segment_lengths: list[int], dilation_rates: list[int]) -> None:
    """Warn (once per cause) about inputs that run but are most likely not what was meant."""
    N, Hq = int(q.shape[1]), int(q.shape[2])
    if N < Hq and Hq > _MAX_PLAUSIBLE_HEADS:
        warn_once(
            ("layout", N, Hq),
            f"dilated_attention: q of shape {tuple(q.shape)} is read as (B, N, H, D): {N} positions and "
            f"{Hq} heads. If it is (B, H, N, D), pass q.transpose(1, 2), k.transpose(1, 2) and "
            f"v.transpose(1, 2) (the output is then (B, N, H, D)).",
            LayoutWarning,
        )
    # Branch (w, r) gives head h the positions whose index in their segment is h % r modulo r, so
    # the heads of a branch reach the phases 0 .. min(r, Hq) - 1 only. Position p = Hq then has no
    # head in any branch exactly when every r exceeds Hq (and N > Hq): its output is 0.
    if N > Hq and min(dilation_rates) > Hq:
        warn_once(
            ("uncovered", tuple(segment_lengths), tuple(dilation_rates), Hq),
            f"dilated_attention: every dilation rate ({dilation_rates}) exceeds the number of query "
            f"heads ({Hq}), so the positions whose index in their segment is >= {Hq} modulo the rate "
            f"are attended from by no head of any branch: their output is 0 (docs/SPEC.md section 3). "
            f"Use a rate <= {Hq} in at least one branch (LongNet's first branch has r = 1).",
            UncoveredPositionsWarning,
        )
