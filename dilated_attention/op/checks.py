"""The argument checks of the ops' fake kernels: what the C++ entries check (``csrc/checks.h``), in
their order and with their exception types, stated with the rules of :mod:`dilated_attention._validation`.

Under ``FakeTensorMode``, ``torch.compile``, ``torch.export`` and on meta tensors an op runs its
fake kernel, not the C++ one. Without these checks a call that the kernels refuse (a head dim of
257, ``softmax_scale=1e39``, mismatched shapes) would trace into a graph that fails only when it
runs. A fake kernel refuses what the C++ op refuses, with the same exception type (``RuntimeError``
for a ``TORCH_CHECK``, ``ValueError`` for a ``TORCH_CHECK_VALUE``: the softmax scale, dropout) and
a message naming the value; the words are the Python API's (``tests/op/test_op_checks.py``).

Here are only the rules the Python API has no use for: the backward's tensors, the limits of the
CUDA entries, the largest segment length and packed length, the decode step's cache. What the
fake kernels cannot check stays with the kernels: the values of ``cu_seqlens`` and of a decode
step's positions (data). Sizes may be symbolic: every rule goes through
:func:`~dilated_attention._validation.require`, which records a symbolic condition instead of
deciding it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _validation as V

__all__ = ["Grads", "check_decode_step", "check_dropout_mask", "check_fixed", "check_piece", "check_varlen"]

_MAX_SEGMENT = 1 << 40  # csrc/checks.h check_branches: index arithmetic stays far from int64's limit
_CUDA_MAX_ROWS = (2**31 - 1) // 2  # csrc/cuda/dilated_attention_cuda.cpp check_rows
_CUDA_MAX_BATCH = 65535  # check_grid
_CUDA_MAX_HEADS = 32767

# What a backward call adds to its forward's arguments: dout, out, lse, dlse (or None).
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _check_branches(segment_lengths: Sequence[Any], dilation_rates: Sequence[Any]) -> None:
    """The branches' rules, and a segment length of at most 2^40 (the Python API brings a longer
    one down to an equivalent, :func:`V.effective_branches`)."""
    segs, rates = list(segment_lengths), list(dilation_rates)
    V.check_branches(segs, rates, RuntimeError)
    for i, w in enumerate(segs):
        V.require(
            w <= _MAX_SEGMENT,
            RuntimeError,
            lambda i=i, w=w: (
                f"segment_lengths[{i}] = {w} exceeds 2^40; use an equivalent w = max(N, r) "
                "(the whole sequence is one segment)"
            ),
        )


def _check_cuda(q: torch.Tensor, rows: Sequence[tuple[str, Any]]) -> None:
    """The limits of the CUDA entries, for CUDA tensors: each of ``rows`` (what, count) below 2^30,
    q's batch and heads (q (B, ., Hq, D)) within a grid."""
    if q.device.type != "cuda":
        return
    for what, n in rows:
        V.require(
            n <= _CUDA_MAX_ROWS,
            RuntimeError,
            lambda what=what, n=n: f"on CUDA {what} must be below 2^30, got {n}",
        )
    B, Hq = q.shape[0], q.shape[2]
    V.require(
        B <= _CUDA_MAX_BATCH,
        RuntimeError,
        lambda: f"on CUDA the batch size must be at most {_CUDA_MAX_BATCH}, got {B}",
    )
    V.require(
        Hq <= _CUDA_MAX_HEADS,
        RuntimeError,
        lambda: f"on CUDA the number of heads must be at most {_CUDA_MAX_HEADS}, got {Hq}",
    )


def check_backward(
    q: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: Any
) -> None:
    """check_backward_inputs: dout and out of q's shape, dtype and device, lse (B, Hq, N) in the
    accumulation dtype or float64 on q's device, dlse (None or) of lse's shape on q's device."""
    for name, t in (("dout", dout), ("out", out)):
        V.require_shape(
            t,
            q.shape,
            RuntimeError,
            lambda n=name, t=t: f"{n} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}",
        )
        V.check_like_q(q, t, name, RuntimeError)
    want = (q.shape[0], q.shape[2], q.shape[1])
    V.require_shape(
        lse, want, RuntimeError, lambda: f"lse must have shape (B, Hq, N) = {want}, got {tuple(lse.shape)}"
    )
    accumulate = V.accumulation_dtype(q.dtype)
    V.require(
        lse.dtype in (accumulate, torch.float64),
        RuntimeError,
        lambda: f"lse must be {str(accumulate).removeprefix('torch.')} or float64, got {lse.dtype}",
    )
    V.require(lse.device == q.device, RuntimeError, lambda: f"lse must be on {q.device}, got {lse.device}")
    if dlse is not None:
        V.require_shape(
            dlse,
            lse.shape,
            RuntimeError,
            lambda: f"dlse must have shape {tuple(lse.shape)}, got {tuple(dlse.shape)}",
        )
        V.require(
            dlse.device == q.device, RuntimeError, lambda: f"dlse must be on {q.device}, got {dlse.device}"
        )


def check_fixed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[Any],
    dilation_rates: Sequence[Any],
    softmax_scale: float,
    dropout_p: float,
    grads: Grads | None = None,
    *,
    cuda_limits: bool = True,
) -> None:
    """The checks of ``fwd``, or with ``grads`` of ``bwd``, in the order of their C++ entries (the
    scale a ValueError, as TORCH_CHECK_VALUE). ``cuda_limits=False``: not those of the CUDA
    kernels (``views_fwd``/``views_bwd``, which run PyTorch's attention)."""
    V.check_qkv(q, k, v, error=RuntimeError)
    V.check_scale_for_dtype(softmax_scale, q.dtype)
    _check_branches(segment_lengths, dilation_rates)
    if grads is not None:
        check_backward(q, *grads)
    V.check_dropout(dropout_p)
    if cuda_limits:
        _check_cuda(q, [("the sequence length", q.shape[1])])


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: Any,
    segment_lengths: Sequence[Any],
    dilation_rates: Sequence[Any],
    softmax_scale: float,
    dropout_p: float,
    grads: Grads | None = None,
) -> None:
    """The checks of ``varlen_fwd``, or with ``grads`` of ``varlen_bwd``, in the order of their C++
    entries (not cu_seqlens' values): q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,)
    on q's device, max_seqlen >= 0, T within int32; the backward's tensors on their (1, ...) views."""
    V.check_packed(q, k, v, cu_seqlens, RuntimeError)
    V.check_max_seqlen(max_seqlen, RuntimeError)
    T = q.shape[0]
    V.require(T <= 2**31 - 1, RuntimeError, lambda: f"T must fit in int32 (cu_seqlens), got {T}")
    V.check_scale_for_dtype(softmax_scale, q.dtype)
    _check_branches(segment_lengths, dilation_rates)
    q4 = q.unsqueeze(0)
    if grads is not None:
        dout, out, lse, dlse = grads
        for name, t in (("dout", dout), ("out", out)):
            V.check_rank(t, name, "(T, Hq, D)", RuntimeError)
        dlse4 = None if dlse is None else dlse.unsqueeze(0)
        check_backward(q4, dout.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0), dlse4)
    V.check_dropout(dropout_p)
    _check_cuda(q4, [("the sequence length", T)])


def check_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, grads: Grads | None = None
) -> None:
    """The checks of ``piece_fwd``, or with ``grads`` of ``piece_bwd``: q (B, nq, Hq, D), k and v
    (B, nk, Hkv, D), the softmax scale, on CUDA the limits of its entries."""
    V.check_qkv(q, k, v, error=RuntimeError, same_length=False)
    V.check_scale_for_dtype(softmax_scale, q.dtype)
    _check_cuda(
        q, [("the number of queries of a piece", q.shape[1]), ("the number of keys of a piece", k.shape[1])]
    )
    if grads is not None:
        check_backward(q, *grads)


def check_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    segment_lengths: Sequence[Any],
    dilation_rates: Sequence[Any],
    slot_lengths: Sequence[Any],
    softmax_scale: float,
) -> None:
    """check_decode_step of csrc/cpu/decode_cpu.cpp: q (B, Hq, D), k and v (B, Hkv, D), the caches
    (B, Hkv, T, D), contiguous, of q's dtype and device, pos int64 (B,), the branches and the slots
    they take (not the positions' values: data)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.check_rank(t, name, "(B, H, D)", RuntimeError)
    V.check_rank(k_cache, "k_cache", "(B, Hkv, T, D)", RuntimeError)
    V.require_shape(
        v_cache,
        k_cache.shape,
        RuntimeError,
        lambda: (
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        ),
    )
    B, Hq, D, Hkv = q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1]
    for name, t in (("k", k), ("v", v)):
        V.require_shape(
            t,
            (B, Hkv, D),
            RuntimeError,
            lambda n=name, t=t: (
                f"{n} must be (B, Hkv, D) = {(B, Hkv, D)} (q {tuple(q.shape)}, k_cache "
                f"{tuple(k_cache.shape)}), got {tuple(t.shape)}"
            ),
        )
    for i, size in ((0, B), (3, D)):
        V.require(
            k_cache.shape[i] == size,
            RuntimeError,
            lambda: (
                f"k_cache must be (B, Hkv, T, D) with q's B and D (q {tuple(q.shape)}), got {tuple(k_cache.shape)}"
            ),
        )
    V.check_heads(Hq, Hkv, D, RuntimeError)
    V.check_float(q, "q", RuntimeError)
    V.check_scale_for_dtype(softmax_scale, q.dtype)
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        V.check_like_q(q, t, name, RuntimeError)
    V.require(
        k_cache.is_contiguous() and v_cache.is_contiguous(),
        RuntimeError,
        lambda: (
            f"k_cache and v_cache must be contiguous, got strides {k_cache.stride()} and {v_cache.stride()}"
        ),
    )
    V.require(pos.dtype == torch.int64, RuntimeError, lambda: f"pos must be int64, got {pos.dtype}")
    V.require_shape(
        pos, (B,), RuntimeError, lambda: f"pos must be (B,) = ({B},), got shape {tuple(pos.shape)}"
    )
    V.require(
        pos.device == q.device,
        RuntimeError,
        lambda: f"pos must be on q's device {q.device}, got {pos.device}",
    )
    segs, rates, lengths = list(segment_lengths), list(dilation_rates), list(slot_lengths)
    V.require(
        len(segs) == len(rates) == len(lengths) and len(segs) > 0,
        RuntimeError,
        lambda: (
            "segment_lengths, dilation_rates and slot_lengths must have one entry per branch, got "
            f"{segs}, {rates} and {lengths}"
        ),
    )
    total: Any = 0
    for i, (w, r, n) in enumerate(zip(segs, rates, lengths, strict=True)):
        V.require(
            1 <= r <= w and 1 <= n <= (w + r - 1) // r,
            RuntimeError,
            lambda i=i, w=w, r=r, n=n: (
                f"branch {i} must have 1 <= r <= w and 1 <= slots <= ceil(w / r), got w={w} r={r} slots={n}"
            ),
        )
        total = total + min(Hq // Hkv, r) * n
    V.require(
        k_cache.shape[2] == total,
        RuntimeError,
        lambda: f"the caches must have {total} slots for these branches, got {k_cache.shape[2]}",
    )


def check_dropout_mask(B: Any, H: Any, Nq: Any, Nk: Any, dropout_p: float) -> None:
    """dropout_mask's sizes (>= 0) and dropout_p (ValueError, as the C++ entry)."""
    V.require(
        B >= 0 and H >= 0 and Nq >= 0 and Nk >= 0,
        ValueError,
        lambda: f"dropout_mask: sizes must be >= 0, got B={B}, H={H}, Nq={Nq}, Nk={Nk}",
    )
    V.check_dropout(dropout_p)
