"""Index patterns of the gather-based backends, and their cache.

For a branch ``(w, r)`` and a head offset ``o = h % r`` (SPEC section 2), the positions that the
branch covers form, in every segment, the dilated sub-sequence ``o, o + r, o + 2r, ...`` of the
segment. Full segments all give sub-sequences of the same length ``m``; a shorter last segment
(``N % w != 0``) gives one shorter sub-sequence. A pattern is therefore at most two *groups*, each
an index tensor ``(rows, m)`` of positions: every row is one dense attention problem of length
``m``, and all rows of a group run as one batched kernel call. Nothing is padded, so no padding
key ever enters a softmax, and no mask is needed besides the causal one (dilation keeps order, so
causal masking inside a sub-sequence is plain lower-triangular masking).

The index tensors are cached per ``(N, w, r, offset, device)`` in a bounded LRU cache that is safe
to use from several threads. They are built outside inference mode, so a call under
``torch.inference_mode()`` leaves nothing in the cache that a later training call cannot use.

Packed sequences (SPEC section 7) are the same per sequence, each sequence's positions shifted by
its first row: the full segments of all sequences form one group, and the shorter last segments
(one per sequence whose length is not a multiple of ``w``) form one group per length. They are
cached per ``(sequence lengths, w, r, offset, device)``.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "CacheInfo",
    "PatternCache",
    "build_positions",
    "build_varlen_positions",
    "dilated_positions",
    "get_pattern_cache",
]

DEFAULT_MAX_ENTRIES = 512
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    entries: int
    max_entries: int
    nbytes: int
    max_bytes: int


def build_positions(N: int, w: int, r: int, offset: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The groups of positions that branch ``(w, r)`` covers at head offset ``offset``.

    Returns a tuple of int64 tensors, each ``(rows, m)`` with ``m >= 1``: the full segments (one
    row per segment) and, when ``N % w != 0``, the shorter last segment (one row). ``w > N``
    makes the whole sequence one segment. Empty groups are left out.
    """
    if N <= 0:
        return ()
    w_eff = min(w, N)
    n_full = N // w_eff
    tail = N - n_full * w_eff  # length of the shorter last segment, 0 if none
    groups = []
    m_full = len(range(offset, w_eff, r))
    if n_full > 0 and m_full > 0:
        seg_start = torch.arange(n_full, device=device, dtype=torch.int64) * w_eff  # (rows,)
        within = offset + r * torch.arange(m_full, device=device, dtype=torch.int64)  # (m,)
        groups.append(seg_start[:, None] + within[None, :])  # (rows, m)
    m_tail = len(range(offset, tail, r))
    if m_tail > 0:
        within = offset + r * torch.arange(m_tail, device=device, dtype=torch.int64)
        groups.append((n_full * w_eff + within)[None, :])  # (1, m')
    return tuple(groups)


def build_varlen_positions(
    lengths: tuple[int, ...], w: int, r: int, offset: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """:func:`build_positions` for packed sequences of the given lengths, rows of a (T, ...) tensor.

    Each sequence is split on its own (its segments start at its first row; a sequence shorter than
    ``w`` is one segment). Returns the full segments of all sequences as one group ``(rows, m)``
    and the shorter last segments as one group per sub-sequence length; empty groups are left out.
    """
    full_starts: list[int] = []
    tails: dict[int, list[int]] = {}  # sub-sequence length -> first rows of those last segments
    start = 0
    for n in lengths:
        n_full, tail = divmod(n, w)
        full_starts.extend(range(start, start + n_full * w, w))
        m_tail = len(range(offset, tail, r))
        if m_tail > 0:
            tails.setdefault(m_tail, []).append(start + n_full * w)
        start += n
    groups = []
    m_full = len(range(offset, w, r))
    if full_starts and m_full > 0:
        seg_start = torch.tensor(full_starts, dtype=torch.int64, device=device)  # (rows,)
        within = offset + r * torch.arange(m_full, device=device, dtype=torch.int64)  # (m,)
        groups.append(seg_start[:, None] + within[None, :])  # (rows, m)
    for m_tail, starts in sorted(tails.items()):
        seg_start = torch.tensor(starts, dtype=torch.int64, device=device)
        within = offset + r * torch.arange(m_tail, device=device, dtype=torch.int64)
        groups.append(seg_start[:, None] + within[None, :])
    return tuple(groups)


class PatternCache:
    """A bounded, thread-safe LRU cache of :func:`build_positions` results.

    Keyed by ``(N, w, r, offset, device)``, where ``N`` is a sequence length or, for packed
    sequences, the tuple of their lengths. Bounded both in entries and in bytes of index tensors;
    the least recently used entries are evicted first.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self._lock = threading.Lock()
        self._data: OrderedDict[tuple, tuple[torch.Tensor, ...]] = OrderedDict()
        self._nbytes = 0
        self._hits = 0
        self._misses = 0
        self.max_entries = 0
        self.max_bytes = 0
        self.resize(max_entries, max_bytes)

    @staticmethod
    def _size(groups: tuple[torch.Tensor, ...]) -> int:
        return sum(t.numel() * t.element_size() for t in groups)

    def resize(self, max_entries: int | None = None, max_bytes: int | None = None) -> None:
        """Change the bounds (entries >= 1, bytes >= 0); evicts what no longer fits."""
        if max_entries is not None:
            if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
                raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        if max_bytes is not None:
            if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
                raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        with self._lock:
            if max_entries is not None:
                self.max_entries = max_entries
            if max_bytes is not None:
                self.max_bytes = max_bytes
            self._evict()

    def _evict(self) -> None:
        # Caller holds the lock.
        while self._data and (len(self._data) > self.max_entries or self._nbytes > self.max_bytes):
            _, groups = self._data.popitem(last=False)
            self._nbytes -= self._size(groups)

    def get(
        self, N: int | tuple[int, ...], w: int, r: int, offset: int, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """The position groups of ``(N, w, r, offset)`` on ``device``, built once and cached; ``N``
        a tuple of lengths: those of packed sequences (:func:`build_varlen_positions`)."""
        n = tuple(int(x) for x in N) if isinstance(N, tuple) else int(N)
        key = (n, int(w), int(r), int(offset), torch.device(device))
        with self._lock:
            groups = self._data.get(key)
            if groups is not None:
                self._data.move_to_end(key)
                self._hits += 1
                return groups
            self._misses += 1
        # Built outside the lock so that other threads are not held up by an allocation, and never
        # as inference tensors: a call under torch.inference_mode() must not leave in the shared
        # cache tensors that a later training call cannot save for backward.
        with torch.inference_mode(False):
            if isinstance(n, tuple):
                groups = build_varlen_positions(n, int(w), int(r), int(offset), key[-1])
            else:
                groups = build_positions(n, w, r, offset, key[-1])
        with self._lock:
            existing = self._data.get(key)
            if existing is not None:  # another thread built it meanwhile
                self._data.move_to_end(key)
                return existing
            self._data[key] = groups
            self._nbytes += self._size(groups)
            self._evict()
        return groups

    def clear(self) -> None:
        """Drop every entry and reset the statistics."""
        with self._lock:
            self._data.clear()
            self._nbytes = 0
            self._hits = 0
            self._misses = 0

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(
                self._hits, self._misses, len(self._data), self.max_entries, self._nbytes, self.max_bytes
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def __contains__(self, key: tuple) -> bool:
        with self._lock:
            return key in self._data


_CACHE = PatternCache()


def get_pattern_cache() -> PatternCache:
    """The process-wide cache used by the gather-based backends."""
    return _CACHE


def dilated_positions(
    N: int | tuple[int, ...], w: int, r: int, offset: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """:func:`build_positions` (``N`` a tuple of lengths: :func:`build_varlen_positions`) through
    the process-wide cache (directly while being compiled)."""
    if torch.compiler.is_compiling():
        if isinstance(N, tuple):
            return build_varlen_positions(N, w, r, offset, torch.device(device))
        return build_positions(N, w, r, offset, torch.device(device))
    return _CACHE.get(N, w, r, offset, device)


@dataclass(frozen=True)
class HeadGroup:
    """The query heads of one offset and the key/value heads they read.

    ``q_heads`` is the slice ``offset::r`` of the query heads. ``kv_heads`` selects key/value
    heads (a slice, or an index tensor that may repeat heads), arranged so that query head ``j``
    of the group reads selected key/value head ``j // group_size``: the grouped-query layout of
    FlashAttention and SDPA.
    """

    offset: int
    q_heads: slice
    num_q_heads: int
    kv_heads: object  # slice or torch.Tensor (int64)
    num_kv_heads: int
    group_size: int


def head_groups(Hq: int, Hkv: int, r: int, native_gqa: bool, device: torch.device) -> list[HeadGroup]:
    """One :class:`HeadGroup` per offset ``o < min(r, Hq)`` (offsets ``>= Hq`` have no heads)."""
    G = Hq // Hkv
    out = []
    for o in range(min(r, Hq)):
        qh = list(range(o, Hq, r))
        kvh = [h // G for h in qh]  # key/value head of each query head (SPEC section 1)
        uniq = sorted(set(kvh))
        g = len(qh) // len(uniq)
        grouped = native_gqa and len(qh) == g * len(uniq) and kvh == [uniq[j // g] for j in range(len(qh))]
        if not grouped:
            uniq, g = kvh, 1
        kv: slice | torch.Tensor
        if len(uniq) == 1:
            kv = slice(uniq[0], uniq[0] + 1)
        elif len({b - a for a, b in itertools.pairwise(uniq)}) == 1 and uniq[1] > uniq[0]:
            kv = slice(uniq[0], uniq[-1] + 1, uniq[1] - uniq[0])
        else:
            kv = torch.tensor(uniq, dtype=torch.int64, device=device)
        out.append(HeadGroup(o, slice(o, Hq, r), len(qh), kv, len(uniq), g))
    return out
