"""``dilated_attention_decode``: new queries against a full key/value cache (SPEC section 8)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from .. import _validation as V
from .._warnings import CacheUsageWarning, warn_once
from ..backends import check_backend_name
from ..flops import accumulation_dtype
from ..functional import _attention
from . import _gather


def _as_lengths(value: object, B: int, device: torch.device, name: str) -> torch.Tensor:
    """An int or an integer tensor of shape () or (B,) as an int64 (B,) tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != B):
            raise ValueError(f"{name} must be an int or a ({B},) tensor, got shape {tuple(value.shape)}")
        return value.to(device=device, dtype=torch.int64).expand(B)
    n = V._as_int(value, name)
    return torch.full((B,), n, dtype=torch.int64, device=device)


def _check_lengths(
    cache_seqlens: object,
    seqlens: torch.Tensor,
    end: torch.Tensor,
    leftpad: torch.Tensor,
    lo_bound: int,
    hi_bound: int,
    Ncap: int,
    m: int,
    has_new: bool,
) -> int:
    """Check the cache lengths and left padding; return an upper bound of the slots in use after
    the call (exact in eager mode; ``Ncap`` for tensor lengths under ``torch.compile``, where the
    checks run on the device instead of reading the tensors back)."""
    if not isinstance(cache_seqlens, torch.Tensor):
        n = V._as_int(cache_seqlens, "cache_seqlens")
        lengths_ok, hi = lo_bound <= n <= hi_bound, n + (m if has_new else 0)
    elif torch.compiler.is_compiling():
        torch._assert_async(
            ((seqlens >= lo_bound) & (seqlens <= hi_bound)).all(), "cache_seqlens out of range"
        )
        lengths_ok, hi = True, Ncap
    else:
        lengths_ok = lo_bound <= int(seqlens.min()) and int(seqlens.max()) <= hi_bound
        hi = int(end.max())
    if not lengths_ok:
        raise ValueError(
            f"cache_seqlens must be in [{lo_bound}, {hi_bound}] "
            f"(cache of {Ncap} slots, {m} new queries, new keys {'given' if has_new else 'not given'}), "
            f"got {seqlens.tolist()}"
        )
    if torch.compiler.is_compiling():
        torch._assert_async(((leftpad >= 0) & (leftpad <= Ncap)).all(), "cache_leftpad out of range")
    elif int(leftpad.min()) < 0 or int(leftpad.max()) > Ncap:
        raise ValueError(f"cache_leftpad must be in [0, {Ncap}], got {leftpad.tolist()}")
    return hi


@overload
def dilated_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: int | torch.Tensor,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    k: torch.Tensor | None = ...,
    v: torch.Tensor | None = ...,
    cache_leftpad: torch.Tensor | None = ...,
    softmax_scale: float | None = ...,
    return_lse: Literal[False] = ...,
    backend: str = ...,
) -> torch.Tensor: ...


@overload
def dilated_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: int | torch.Tensor,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    k: torch.Tensor | None = ...,
    v: torch.Tensor | None = ...,
    cache_leftpad: torch.Tensor | None = ...,
    softmax_scale: float | None = ...,
    return_lse: Literal[True],
    backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def dilated_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: int | torch.Tensor,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    k: torch.Tensor | None = ...,
    v: torch.Tensor | None = ...,
    cache_leftpad: torch.Tensor | None = ...,
    softmax_scale: float | None = ...,
    return_lse: bool = ...,
    backend: str = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def dilated_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: int | torch.Tensor,
    segment_lengths: int | Sequence[int],
    dilation_rates: int | Sequence[int],
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal dilated attention of new queries against a key/value cache (SPEC section 8).

    Args:
        q: the new queries, (B, m, Hq, D).
        k_cache, v_cache: (B, Ncap, Hkv, D) caches, any strides (a ``(B, Hkv, Ncap, D)`` tensor
            seen through ``.transpose(1, 2)`` works); written in place when ``k``, ``v`` are given.
        cache_seqlens: int or (B,) integer tensor: the number of cache slots in use per sequence.
        segment_lengths, dilation_rates: the branches, as for
            :func:`~dilated_attention.dilated_attention`.
        k, v: the new keys and values, (B, m, Hkv, D), or both None. Given, they are written at
            slots ``[cache_seqlens, cache_seqlens + m)`` and the queries sit there; not given, the
            cache already holds them and the queries are the last ``m`` slots in use.
        cache_leftpad: None or (B,) integer tensor: the slot that holds position 0 of each sequence
            (left padding); slots before it are not read, and a query at a slot before it gets
            ``out = 0``, ``lse = -inf``.
        softmax_scale: ``1/sqrt(D)`` by default.
        return_lse: also return the log-sum-exp, (B, Hq, m), float32 (float64 for float64).
        backend: the backend of a prefill, i.e. a call with ``k``, ``v`` on an empty cache without
            left padding, which is the causal :func:`~dilated_attention.dilated_attention` of the
            ``m`` new tokens. Every other call gathers the keys read (at most
            ``sum_i ceil(w_i / r_i)`` per query) and runs in plain PyTorch on any device and dtype.

    Returns:
        ``out`` (B, m, Hq, D) in q's dtype, or ``(out, lse)`` when ``return_lse``. The caller
        advances ``cache_seqlens`` by ``m`` (``DilatedKVCache.advance`` does).

    The result equals the last ``m`` rows of the causal dilated attention of each whole sequence.
    """
    check_backend_name(backend)
    if (k is None) != (v is None):
        raise ValueError("give both k and v (the new keys and values) or neither")
    V.check_qkv(q, q, q)  # q alone: a 4-D float tensor with a valid head dim
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, Ncap, Hkv, D), got shape {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}"
            )
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    B, m, Hq, D = q.shape
    _, Ncap, Hkv, Dk = k_cache.shape
    if k_cache.shape[0] != B or Dk != D or Hq % Hkv != 0:
        raise ValueError(
            f"q (B, m, Hq, D) and k_cache (B, Ncap, Hkv, D) must agree in B and D with Hq a multiple of "
            f"Hkv, got q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}"
        )
    if k is not None:
        V.check_qkv(q, k, v)
        if k.shape[2] != Hkv:
            raise ValueError(f"k must have the cache's {Hkv} heads, got shape {tuple(k.shape)}")
    segs, rates = V.normalize_branches(segment_lengths, dilation_rates)
    scale = V.check_scale_for_dtype(V.resolve_scale(softmax_scale, D), q.dtype)
    return_lse = V.check_bool(return_lse, "return_lse")
    seqlens = _as_lengths(cache_seqlens, B, q.device, "cache_seqlens")
    leftpad = (
        torch.zeros(B, dtype=torch.int64, device=q.device)
        if cache_leftpad is None
        else _as_lengths(cache_leftpad, B, q.device, "cache_leftpad")
    )
    if B == 0 or m == 0:
        out = q.new_zeros(q.shape)
        lse = q.new_full((B, Hq, m), float("-inf"), dtype=accumulation_dtype(q.dtype))
        return (out, lse) if return_lse else out
    end = seqlens + (m if k is not None else 0)  # slots in use after the call, (B,)
    lo_bound, hi_bound = (0 if k is not None else m), Ncap - (m if k is not None else 0)
    hi = _check_lengths(cache_seqlens, seqlens, end, leftpad, lo_bound, hi_bound, Ncap, m, k is not None)
    # A prefill (new keys on an empty cache without left padding), known without reading a tensor
    # back under torch.compile only for an int cache_seqlens.
    traced_lengths = isinstance(cache_seqlens, torch.Tensor) and torch.compiler.is_compiling()
    prefill = k is not None and cache_leftpad is None and hi == m and not traced_lengths

    if prefill and k is not None and v is not None:
        # A prefill: the whole causal forward of the new tokens, by the backend asked for.
        k_cache[:, :m] = k
        v_cache[:, :m] = v
        return _attention(
            q, k, v, segs, rates, is_causal=True, softmax_scale=scale, return_lse=return_lse, backend=backend
        )

    if k is not None:
        assert v is not None  # given together with k, checked above
        new = seqlens[:, None] + torch.arange(m, device=q.device)  # (B, m)
        b = torch.arange(B, device=q.device)[:, None]
        k_cache[b, new] = k
        v_cache[b, new] = v
    slots = end[:, None] - m + torch.arange(m, device=q.device)  # cache slots of the queries, (B, m)
    n_slots = sum(min(hi, w) // r + 1 for w, r in zip(segs, rates, strict=True))
    chunk = max(1, _gather._GATHER_BUDGET // max(1, B * n_slots * Hkv * D))
    outs, lses = [], []
    for i in range(0, m, chunk):
        o, s = _gather._gather_attention(
            q[:, i : i + chunk],
            k_cache,
            v_cache,
            slots[:, i : i + chunk],
            leftpad,
            segs,
            rates,
            scale,
            hi - 1,
        )
        outs.append(o)
        lses.append(s)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]
    return (out, lse) if return_lse else out


class StepGuard:
    """Which layers of a cache took new tokens since its last ``advance``: a layer that attends
    again before it is warned about (:class:`~dilated_attention.CacheUsageWarning`), since its new
    tokens go to the positions of the previous call's, which they overwrite."""

    def __init__(self, num_layers: int, owner: str) -> None:
        self.owner = owner
        self.attended = [False] * num_layers

    def attend(self, layer: int) -> None:
        if self.attended[layer]:
            warn_once(
                ("cache-attend-again", self.owner),
                f"{self.owner}.attend(layer={layer}) was called again before advance(): its new tokens "
                "take the positions of the previous call's on this layer and overwrite them. Call "
                "cache.advance(n) once after the last layer of every step (n: the step's new tokens); "
                "repeating a step with the same tokens is harmless.",
                CacheUsageWarning,
            )
        self.attended[layer] = True

    def advance(self) -> None:
        self.attended = [False] * len(self.attended)
