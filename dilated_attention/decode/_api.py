"""``dilated_attention_decode``: new queries against a full key/value cache (SPEC section 8)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from .. import _validation as V
from .._validation import accumulation_dtype
from .._warnings import CacheUsageWarning, warn_user
from ..backends import check_backend_name
from ..functional import _attention
from . import _gather


def _as_lengths(value: object, B: int, device: torch.device, name: str) -> torch.Tensor:
    """An int or an integer tensor of shape () or (B,) as an int64 (B,) tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {value.dtype}")
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != B):
            raise ValueError(f"{name} must be an int or a ({B},) tensor, got shape {tuple(value.shape)}")
        if value.device.type == "meta" and device.type != "meta":
            raise ValueError(
                f"{name} is a meta tensor (it holds no values), where its values are needed on {device}: "
                "give it as an int or a tensor with values"
            )
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
    lo_bound, hi_bound = (0 if k is not None else m), Ncap - (m if k is not None else 0)
    if q.device.type == "meta":
        # Shape propagation, as the ops' fake kernels do: the lengths are checked where they have
        # values (an int, or tensors on a real device); nothing is written or read.
        given = [t for t in (cache_seqlens, cache_leftpad) if isinstance(t, torch.Tensor)]
        if all(t.device.type != "meta" for t in given):
            cpu = torch.device("cpu")
            host = _as_lengths(cache_seqlens, B, cpu, "cache_seqlens")
            pad = (
                torch.zeros(B, dtype=torch.int64)
                if cache_leftpad is None
                else _as_lengths(cache_leftpad, B, cpu, "cache_leftpad")
            )
            end = host + (m if k is not None else 0)
            _check_lengths(cache_seqlens, host, end, pad, lo_bound, hi_bound, Ncap, m, k is not None)
        out = q.new_empty(q.shape)
        lse = q.new_empty((B, Hq, m), dtype=accumulation_dtype(q.dtype))
        return (out, lse) if return_lse else out
    end = seqlens + (m if k is not None else 0)  # slots in use after the call, (B,)
    hi = _check_lengths(cache_seqlens, seqlens, end, leftpad, lo_bound, hi_bound, Ncap, m, k is not None)
    # A prefill (new keys on an empty cache without left padding), known without reading a tensor
    # back under torch.compile only for an int cache_seqlens.
    traced_lengths = isinstance(cache_seqlens, torch.Tensor) and torch.compiler.is_compiling()
    prefill = k is not None and cache_leftpad is None and hi == m and not traced_lengths

    if prefill and k is not None and v is not None:
        # A prefill: the whole causal forward of the new tokens, by the backend asked for.
        k_cache[:, :m] = k
        v_cache[:, :m] = v
        out, lse = _attention(q, k, v, segs, rates, is_causal=True, softmax_scale=scale, backend=backend)
        return (out, lse) if return_lse else out

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


def cache_dtype_device(dtype: object, device: object, owner: str) -> tuple[torch.dtype, torch.device | None]:
    """A cache's dtype and device, checked (:func:`~dilated_attention._validation.cache_dtype_device`),
    and the device one this process can use: a cache for ``"cuda"`` where
    ``torch.cuda.is_available()`` is False is a ValueError naming the device, at construction."""
    from .. import hardware

    dtype, dev = V.cache_dtype_device(dtype, device)
    cuda_note = (
        ""
        if torch.cuda.is_available()
        else f" (torch.cuda.is_available() is False: this PyTorch {torch.__version__}, built "
        f"{'for CUDA ' + str(torch.version.cuda) if torch.version.cuda else 'without CUDA'}, finds no "
        "usable CUDA GPU or driver)"
    )
    fix = "; build it on a device this process has, e.g. device='cpu'"
    if dev is None:
        try:  # torch.set_default_device: the device a tensor is made on
            where = torch.get_default_device()
        except RuntimeError as err:  # torch cannot even name its index: the device is not there
            text = str(err)
            note = cuda_note if "cuda" in text.lower() or "nvidia" in text.lower() else ""
            raise ValueError(
                f"{owner}: cannot hold the cache on torch's default device (device=None, the device of "
                f"torch.set_default_device): {text}{note}{fix}"
            ) from None
    else:
        where = dev
    if where.type in ("cpu", "meta"):
        return dtype, dev
    why = hardware.device_unavailable(where)
    if why:
        named = f"device={str(where)!r}" + ("" if dev is not None else " (torch's default device)")
        if where.type == "cuda":
            why += cuda_note
        raise ValueError(f"{owner}: cannot hold the cache on {named}: {why}{fix}")
    return dtype, dev


def _counts_text(counts: Sequence[int]) -> str:
    """``4 new tokens in every row`` or ``[4, 2] new tokens per row``."""
    if len(set(counts)) == 1:
        return f"{counts[0]} new token{'s' if counts[0] != 1 else ''} in every row"
    return f"{list(counts)} new tokens per row"


class StepGuard:
    """The order of a cache's calls: which layers took new tokens since its last ``advance``, and
    how many per row.

    A layer that attends again before ``advance`` is warned about
    (:class:`~dilated_attention.CacheUsageWarning`, once per cache), since its new tokens go to the
    positions of the previous call's, which they overwrite. ``advance(n)`` is checked against what
    the layers took: ``exact`` (the bounded cache) wants exactly those counts per row; otherwise (the
    full cache) at most them per row, fewer being the real lengths of right-padded rows. An
    ``advance`` with no layer attended since the previous one counts positions the caller wrote into
    the cache directly, and is not checked."""

    def __init__(self, num_layers: int, owner: str, *, exact: bool) -> None:
        self.owner = owner
        self.exact = exact
        self.taken: list[list[int] | None] = [None] * num_layers  # per layer: new tokens per row
        self.warned = False  # this cache warned already: each cache warns once

    def attend(self, layer: int, counts: list[int]) -> None:
        if self.taken[layer] is not None and not self.warned:
            self.warned = True
            warn_user(
                f"{self.owner}.attend(layer={layer}) was called again before advance(): its new tokens "
                "take the positions of the previous call's on this layer and overwrite them. Call "
                "cache.advance(n) once after the last layer of every step (n: the step's new tokens); "
                "repeating a step with the same tokens is harmless. (This cache warns once.)",
                CacheUsageWarning,
            )
        self.taken[layer] = counts

    def counts(self, n: list[int] | None, given: object) -> list[int]:
        """The positions ``advance`` counts per row: ``n`` (from the argument ``given``) checked
        against what the layers took since the last ``advance``, or, for ``n`` None, what they took."""
        taken = [(layer, c) for layer, c in enumerate(self.taken) if c is not None]
        if n is None:
            if not taken:
                raise ValueError(
                    f"{self.owner}.advance() without n: no layer took new tokens since the last "
                    "advance() or reset(), so there is nothing to count; pass n, the positions to "
                    "count as cached"
                )
            first_layer, first = taken[0]
            for layer, c in taken[1:]:
                if c != first:
                    raise ValueError(
                        f"{self.owner}.advance() without n: the layers took different numbers of new "
                        f"tokens since the last advance(): layer {first_layer} {_counts_text(first)}, "
                        f"layer {layer} {_counts_text(c)}; every layer of a step takes the same tokens"
                    )
            return first
        arg = f"{given}" if isinstance(given, int) else f"{n}"
        got = f"n = {given}" if isinstance(given, int) else f"{n} per row"
        for layer, c in taken:
            if self.exact and n != c:
                raise ValueError(
                    f"{self.owner}.advance({arg}): layer {layer} took {_counts_text(c)} since the last "
                    f"advance() (attend's num_new, or every token of the call), and advance must count "
                    f"exactly those (the cache kept those tokens and no others), got {got}. "
                    f"Call advance() without n to advance by what the layers took."
                )
            if not self.exact and any(a > b for a, b in zip(n, c, strict=True)):
                raise ValueError(
                    f"{self.owner}.advance({arg}): layer {layer} appended {_counts_text(c)} since the "
                    f"last advance(), and a row can advance by at most its appended tokens (fewer: the "
                    f"real length of a right-padded row), got {got}: the positions beyond were "
                    f"never written. Call advance() without n to advance by what the layers appended."
                )
        return n

    def advance(self) -> None:
        self.taken = [None] * len(self.taken)
