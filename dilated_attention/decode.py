"""Generation with a key/value cache (SPEC section 8), in the spirit of ``flash_attn_with_kvcache``.

``dilated_attention_decode(q, k_cache, v_cache, cache_seqlens, ...)`` appends the new keys and
values to a preallocated cache and attends the new queries to exactly the keys that causal
dilated attention on the whole sequence gives them. In branch ``(w, r)`` the query at position
``p`` reads the keys ``p, p - r, p - 2r, ...`` down to the first position of its segment
(``p - p % w``), and only when the branch covers ``(p, h)`` (``(p % w) % r == h % r``). So a
query reads at most ``sum_i ceil(w_i / r_i)`` keys however long the cache is: they are gathered
from the cache (one index per slot, a key found by two branches taking two slots, so that it
counts twice as SPEC section 3 says), and one softmax runs over all of them.

:class:`DilatedKVCache` holds the caches of every layer of a model and the length of each
sequence of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, overload

import torch

from . import _validation as V
from .backends import check_backend_name
from .flops import accumulation_dtype
from .functional import _attention

__all__ = ["DilatedKVCache", "decode_key_positions", "dilated_attention_decode"]

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
    if cache.stride(3) != 1 or row < D:
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, m, Hq, D) at cache slots ``slots`` (B, m), position ``slot - leftpad``, against the
    caches (B, Ncap, Hkv, D). Returns out (B, m, Hq, D) in q's dtype and lse (B, Hq, m)."""
    B, m, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    ct = accumulation_dtype(q.dtype)
    pos = slots - leftpad[:, None]  # (B, m)
    keys, mask = decode_key_positions(pos, Hq, segs, rates)  # (B, m, K), (B, m, Hq, K)
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
    scale = V.resolve_scale(softmax_scale, D)
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
    lo, hi = int(seqlens.min()), int(end.max())
    if lo < (0 if k is not None else m) or hi > Ncap:
        raise ValueError(
            f"cache_seqlens must be in [{0 if k is not None else m}, {Ncap - (m if k is not None else 0)}] "
            f"(cache of {Ncap} slots, {m} new queries, new keys {'given' if k is not None else 'not given'}), "
            f"got {seqlens.tolist()}"
        )
    if int(leftpad.min()) < 0 or int(leftpad.max()) > Ncap:
        raise ValueError(f"cache_leftpad must be in [0, {Ncap}], got {leftpad.tolist()}")

    if k is not None and hi == m and cache_leftpad is None:
        assert v is not None  # given together with k, checked above
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
    chunk = max(1, _GATHER_BUDGET // max(1, B * n_slots * Hkv * D))
    outs, lses = [], []
    for i in range(0, m, chunk):
        o, s = _gather_attention(
            q[:, i : i + chunk], k_cache, v_cache, slots[:, i : i + chunk], leftpad, segs, rates, scale
        )
        outs.append(o)
        lses.append(s)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]
    return (out, lse) if return_lse else out


class DilatedKVCache:
    """Keys and values of every layer of a model for a batch of sequences of different lengths.

    ``k[layer]``, ``v[layer]``: (B, max_seqlen, Hkv, D), preallocated; ``seqlens`` (B,) int64:
    the positions cached per sequence. Use it as::

        cache = DilatedKVCache(n_layer, B, max_seqlen, n_kv_head, head_dim, dtype=dtype, device=device)
        # in layer i of the model, for the new tokens' q (B, T, Hq, D), k, v (B, T, Hkv, D):
        out = cache.attend(i, q, k, v, segment_lengths, dilation_rates)
        # after the last layer:
        cache.advance(T)  # or a (B,) tensor: e.g. the real lengths of right-padded prompts

    A batch of prompts of different lengths can be prefilled right-padded to one length ``T``
    and then advanced by the real lengths: causal attention never lets a real token read the
    padding after it, and the next tokens overwrite it.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seqlen: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("max_seqlen", max_seqlen),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if V._as_int(value, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        shape = (batch_size, max_seqlen, num_kv_heads, head_dim)
        dtype = dtype or torch.get_default_dtype()
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.max_seqlen = max_seqlen

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        *,
        softmax_scale: float | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        """Append ``k``, ``v`` (B, T, Hkv, D) to ``layer`` after each sequence's cached positions
        and return the causal dilated attention of ``q`` (B, T, Hq, D) there, (B, T, Hq, D)."""
        if not 0 <= layer < len(self.k):
            raise ValueError(f"layer must be in [0, {len(self.k)}), got {layer}")
        dtype = self.k[layer].dtype
        out = dilated_attention_decode(
            q.to(dtype),
            self.k[layer],
            self.v[layer],
            self.seqlens,
            segment_lengths,
            dilation_rates,
            k=k.to(dtype),
            v=v.to(dtype),
            softmax_scale=softmax_scale,
            backend=backend,
        )
        return out.to(q.dtype)

    def advance(self, n: int | torch.Tensor) -> None:
        """Count ``n`` (an int, or a (B,) tensor) more positions as cached, after every layer."""
        new = self.seqlens + _as_lengths(n, self.seqlens.shape[0], self.seqlens.device, "n")
        if int(new.min()) < 0 or int(new.max()) > self.max_seqlen:
            raise ValueError(f"cache lengths must stay in [0, {self.max_seqlen}], got {new.tolist()}")
        self.seqlens = new

    def reset(self) -> None:
        """Forget every cached position."""
        self.seqlens.zero_()
