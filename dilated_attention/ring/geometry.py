"""Which positions each rank holds, and which keys its queries read from other ranks.

Pure arithmetic on positions: no processes, no communication, so every rule here is testable in
one process (``tests/ring/test_ring_pieces.py`` does). The sequence of ``N`` positions is cut into chunks of
equal length and the chunks are dealt to the ``P`` ranks by a :class:`Layout`:

* ``"contiguous"`` (SPEC section 5): ``P`` chunks, rank ``j`` holds chunk ``j``.
* ``"zigzag"``: ``2P`` chunks, rank ``j`` holds chunks ``j`` and ``2P - 1 - j`` (in that order,
  concatenated). With causal masking a query at position ``p`` reads about ``p`` keys, so the
  contiguous layout gives the last rank the most work; zigzag pairs an early chunk with a late
  one and gives every rank the same amount (the layout of ring-attention libraries and of
  PyTorch's context parallelism).

For one branch ``(w, r)`` a segment that lies inside one chunk is computed locally. A segment that
crosses a chunk boundary *spans*: for each head phase ``o`` the rank's queries of that phase form
a :class:`Piece`, which reads :class:`Block` s of keys, one per chunk of the segment (when causal,
only chunks at or before the query's own). Positions of one phase in one segment form the
progression ``seg_lo + o + r*m``; pieces and blocks are ranges of ``m``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "LAYOUTS",
    "Block",
    "HeadSets",
    "Layout",
    "Piece",
    "Plan",
    "block_key",
    "causal_pairs",
    "make_layout",
]

LAYOUTS = ("contiguous", "zigzag")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _progression(seg_lo: int, o: int, r: int, lo: int, hi: int) -> tuple[int, int]:
    """Indices ``m`` with ``seg_lo + o + r*m`` in ``[lo, hi)``, as a half-open range ``(m0, m1)``."""
    m0 = max(0, _ceil_div(lo - seg_lo - o, r))
    m1 = max(0, _ceil_div(hi - seg_lo - o, r))
    return m0, max(m0, m1)


@dataclass(frozen=True)
class Layout:
    """``num_chunks`` chunks of ``chunk`` positions dealt to ``P`` ranks (see the module doc)."""

    kind: str
    P: int
    chunk: int

    @property
    def num_chunks(self) -> int:
        return self.P if self.kind == "contiguous" else 2 * self.P

    @property
    def N(self) -> int:
        return self.num_chunks * self.chunk

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks rank ``rank`` holds, in the order of its local positions."""
        return (rank,) if self.kind == "contiguous" else (rank, 2 * self.P - 1 - rank)

    def owner(self, c: int) -> int:
        return c if c < self.P else 2 * self.P - 1 - c

    def local_start(self, c: int) -> int:
        """Where chunk ``c`` starts in its owner's local positions."""
        return self.chunks_of(self.owner(c)).index(c) * self.chunk

    def local_len(self) -> int:
        return len(self.chunks_of(0)) * self.chunk

    def local_slice(self, c: int, seg_lo: int, o: int, r: int, m0: int, m1: int) -> slice:
        """Positions ``seg_lo + o + r*m``, ``m`` in ``[m0, m1)``, of chunk ``c``, in the local
        coordinates of its owner (a strided slice)."""
        start = seg_lo + o + r * m0 - c * self.chunk + self.local_start(c)
        return slice(start, start + r * (m1 - m0 - 1) + 1, r)

    def positions(self, rank: int) -> torch.Tensor:
        """The global positions that ``rank`` holds, in local order (int64)."""
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk) for c in self.chunks_of(rank)])


def make_layout(kind: str, P: int, local_len: int) -> Layout:
    """The layout of ``P`` ranks holding ``local_len`` positions each."""
    if kind not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {kind!r}")
    if kind == "contiguous":
        return Layout(kind, P, local_len)
    if local_len % 2:
        raise ValueError(
            f'layout="zigzag" splits each rank\'s {local_len} positions into two chunks: N / P must be '
            f"even, got N / P = {local_len}"
        )
    return Layout(kind, P, local_len // 2)


@dataclass(frozen=True)
class Block:
    """Keys ``m0 .. m1-1`` of a piece's progression, in chunk ``chunk`` held by rank ``src``."""

    src: int
    chunk: int
    m0: int
    m1: int

    @property
    def n(self) -> int:
        return self.m1 - self.m0


@dataclass(frozen=True)
class Piece:
    """The queries of one chunk in one spanning segment, for one head phase of one branch.

    Segment ``[seg_lo, seg_lo + w)`` of branch ``branch`` (rate ``r``), phase ``o``; the queries
    are ``seg_lo + o + r*m`` for ``m`` in ``[m0, m1)``, all in chunk ``chunk``; they read the
    ``blocks``, ordered by position.
    """

    branch: int
    seg_lo: int
    r: int
    o: int
    chunk: int
    m0: int
    m1: int
    blocks: tuple[Block, ...]

    @property
    def n(self) -> int:
        return self.m1 - self.m0

    def causal_offset(self, blocks: Sequence[Block]) -> int:
        """For keys = ``blocks`` concatenated (contiguous in ``m``): key ``j`` is visible to query
        ``i`` when ``j <= i + offset``."""
        return self.m0 - blocks[0].m0


def block_key(piece: Piece, blk: Block) -> tuple:
    """What identifies a block's keys: several pieces of one rank may read the same block (with
    the zigzag layout, the two chunks of a rank in one segment); it moves once."""
    return (piece.seg_lo, piece.r, piece.o, blk)


def _unique(items: list[tuple[Piece, Block]]) -> list[tuple[Piece, Block]]:
    seen, out = set(), []
    for piece, blk in items:
        key = block_key(piece, blk)
        if key not in seen:
            seen.add(key)
            out.append((piece, blk))
    return out


def _is_local_branch(w: int, chunk: int) -> bool:
    """Whether segments of length ``w`` tile every chunk exactly."""
    return w <= chunk and chunk % w == 0


def _rank_geometry(
    layout: Layout,
    rank: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    Hq: int,
    is_causal: bool,
) -> tuple[dict[tuple[int, int], list[int]], list[Piece]]:
    """Local runs ``{(lo, hi): [branch indices]}`` (local coordinates) and the pieces of ``rank``."""
    N, cl = layout.N, layout.chunk
    local: dict[tuple[int, int], list[int]] = {}
    pieces: list[Piece] = []
    for bi, (w, r) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
        if _is_local_branch(w, cl):
            local.setdefault((0, layout.local_len()), []).append(bi)
            continue
        for c in layout.chunks_of(rank):
            a, b = c * cl, (c + 1) * cl
            shift = layout.local_start(c) - a  # global position -> local position
            s_first, s_last = a // w, (b - 1) // w

            def bounds(s: int, w: int = w) -> tuple[int, int]:
                return s * w, min(s * w + w, N)

            def inside(s: int, a: int = a, b: int = b) -> bool:
                lo, hi = bounds(s)
                return lo >= a and hi <= b

            i0 = s_first if inside(s_first) else s_first + 1
            i1 = s_last if inside(s_last) else s_last - 1
            if i0 <= i1:  # a run of whole segments inside the chunk
                local.setdefault((bounds(i0)[0] + shift, bounds(i1)[1] + shift), []).append(bi)
            spanning = [] if inside(s_first) else [s_first]
            if not inside(s_last) and s_last != s_first:
                spanning.append(s_last)
            for s in spanning:
                seg_lo, seg_hi = bounds(s)
                for o in range(min(r, Hq)):
                    m0, m1 = _progression(seg_lo, o, r, max(a, seg_lo), min(b, seg_hi))
                    if m1 == m0:
                        continue
                    blocks = []
                    for i in range(seg_lo // cl, (seg_hi - 1) // cl + 1):
                        if is_causal and i > c:
                            continue
                        k0, k1 = _progression(seg_lo, o, r, max(i * cl, seg_lo), min(i * cl + cl, seg_hi))
                        if k1 > k0:
                            blocks.append(Block(layout.owner(i), i, k0, k1))
                    pieces.append(Piece(bi, seg_lo, r, o, c, m0, m1, tuple(blocks)))
    return local, pieces


@dataclass(frozen=True)
class HeadSets:
    """The query heads of one phase, the key/value heads they read, and which one each reads."""

    heads: torch.Tensor  # (nh,) query heads of the phase
    kv_heads: torch.Tensor  # (nkv,) key/value heads they read
    kv_select: torch.Tensor  # (nh,) index into kv_heads for each query head
    grouped: bool  # kv_select == arange(nh) // (nh // nkv): plain grouped-query attention


@dataclass
class Plan:
    """What rank ``rank`` computes and exchanges, for fixed (layout, configuration, heads, causal).

    ``recv_items[src]`` / ``send_items[dst]``: the (piece, block) pairs whose keys come from /
    go to another rank, each block once (:func:`block_key`), in the order of the messages (the
    receiver's piece order). ``readers[key]``: this rank's pieces that read the received block
    ``key``. ``steps``: the
    rank distances at which any two ranks exchange, the same list on every rank, so that every
    rank posts its transfers in the same order (see :mod:`.mode_ring`).
    """

    layout: Layout
    rank: int
    segment_lengths: Sequence[int]
    dilation_rates: Sequence[int]
    Hq: int
    Hkv: int
    is_causal: bool
    local_runs: list[tuple[int, int, list[int], list[int]]] = field(init=False)
    pieces: list[Piece] = field(init=False)
    recv_items: dict[int, list[tuple[Piece, Block]]] = field(init=False)
    send_items: dict[int, list[tuple[Piece, Block]]] = field(init=False)
    readers: dict[tuple, list[Piece]] = field(init=False)
    steps: list[int] = field(init=False)

    def __post_init__(self) -> None:
        L, me = self.layout, self.rank
        geo = [
            _rank_geometry(L, j, self.segment_lengths, self.dilation_rates, self.Hq, self.is_causal)
            for j in range(L.P)
        ]
        local, self.pieces = geo[me]
        self.local_runs = [
            (lo, hi, [self.segment_lengths[i] for i in bis], [self.dilation_rates[i] for i in bis])
            for (lo, hi), bis in sorted(local.items())
        ]
        self.recv_items, self.send_items = {}, {}
        distances = set()
        for j, (_, pieces) in enumerate(geo):
            for piece in pieces:
                for blk in piece.blocks:
                    if blk.src == j:
                        continue
                    distances.add(abs(blk.src - j))
                    if j == me:
                        self.recv_items.setdefault(blk.src, []).append((piece, blk))
                    if blk.src == me:
                        self.send_items.setdefault(j, []).append((piece, blk))
        self.recv_items = {p: _unique(items) for p, items in self.recv_items.items()}
        self.send_items = {p: _unique(items) for p, items in self.send_items.items()}
        self.readers = {}
        for piece in self.pieces:
            for blk in piece.blocks:
                if blk.src != me:
                    self.readers.setdefault(block_key(piece, blk), []).append(piece)
        self.steps = sorted(distances)
        self._heads: dict[tuple[int, int, torch.device], HeadSets] = {}

    @property
    def any_span(self) -> bool:
        """Whether this rank has spanning pieces or keys that other ranks read."""
        # len(), not bool(): torch.compile in PyTorch 2.11 cannot trace bool() of a list.
        return len(self.pieces) > 0 or len(self.send_items) > 0

    @property
    def joins_exchange(self) -> bool:
        """Whether this rank enters the exchange modes: when it has spanning pieces or sends keys,
        and whenever any two ranks exchange (``steps`` is the same on every rank), since
        ``comm="all_gather"`` is a collective that every rank of the group must join."""
        return self.any_span or len(self.steps) > 0

    def head_sets(self, r: int, o: int, device: torch.device) -> HeadSets:
        key = (r, o, device)
        if key not in self._heads:
            G = self.Hq // self.Hkv
            heads = list(range(o, self.Hq, r))
            kv_heads = sorted({h // G for h in heads})
            kv_select = [kv_heads.index(h // G) for h in heads]
            nh, nkv = len(heads), len(kv_heads)
            grouped = nh % nkv == 0 and kv_select == [i // (nh // nkv) for i in range(nh)]
            with torch.inference_mode(False):  # kept for later calls, which may be training ones
                heads_t, kv_heads_t, kv_select_t = (
                    torch.tensor(x, dtype=torch.long, device=device) for x in (heads, kv_heads, kv_select)
                )
                self._heads[key] = HeadSets(heads_t, kv_heads_t, kv_select_t, grouped)
        return self._heads[key]

    def num_kv_heads(self, r: int, o: int) -> int:
        """How many key/value heads the query heads of phase ``o`` (rate ``r``) read."""
        G = self.Hq // self.Hkv
        return len({h // G for h in range(o, self.Hq, r)})

    def item_numel(self, piece: Piece, blk: Block, B: int, D: int) -> int:
        """Elements of one block of keys (the values have as many)."""
        return B * blk.n * self.num_kv_heads(piece.r, piece.o) * D

    def query_slice(self, piece: Piece) -> slice:
        return self.layout.local_slice(piece.chunk, piece.seg_lo, piece.o, piece.r, piece.m0, piece.m1)

    def key_slice(self, piece: Piece, blk: Block) -> slice:
        """The block's keys in the local coordinates of their owner ``blk.src``."""
        return self.layout.local_slice(blk.chunk, piece.seg_lo, piece.o, piece.r, blk.m0, blk.m1)


def causal_pairs(
    layout: Layout, segment_lengths: Sequence[int], dilation_rates: Sequence[int], Hq: int, is_causal: bool
) -> list[int]:
    """(query, key) pairs each rank computes, summed over heads (per batch row): the work that
    the layout deals out. Used to compare layouts; runs in O(P * branches * segments)."""
    N, cl = layout.N, layout.chunk
    work = [0] * layout.P
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        for h in range(Hq):
            o = h % r
            for seg_lo in range(0, N, w):
                seg_hi = min(seg_lo + w, N)
                for c in range(layout.num_chunks):
                    m0, m1 = _progression(seg_lo, o, r, max(c * cl, seg_lo), min(c * cl + cl, seg_hi))
                    if m1 <= m0:
                        continue
                    kall = _progression(seg_lo, o, r, seg_lo, seg_hi)[1]
                    if is_causal:  # query m reads keys 0..m
                        n = (m1 * (m1 + 1) - m0 * (m0 + 1)) // 2
                    else:
                        n = (m1 - m0) * kall
                    work[layout.owner(c)] += n
    return work
