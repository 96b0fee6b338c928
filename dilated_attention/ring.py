"""Sequence parallelism for dilated attention (SPEC section 5, LongNet section 3.1).

A process group of ``P`` ranks splits the sequence into ``P`` contiguous chunks of ``l = N / P``
positions. Rank ``j`` passes its chunk ``(B, l, H, D)`` of q, k and v and gets the same positions
of the output; the result equals :func:`dilated_attention.dilated_attention` on the whole
sequence, forward and backward.

How one rank computes its chunk, branch by branch:

* A segment of branch ``(w, r)`` that lies inside the chunk is computed locally (one call of the
  local backend on the run of such segments; no communication).
* A segment that crosses a chunk boundary (``w > l``, or ``l % w != 0``) *spans* ranks. Each rank
  sparsifies first: for head phase ``o = h % r`` it keeps only positions ``o, o + r, ...`` of the
  segment (strided views), and only the key/value heads that the query heads of that phase read.
  Those keys and values go to the ranks whose queries share the segment (and, when causal, only
  to ranks further right). What one rank sends and receives for a branch is at most about
  ``2 * w / r`` positions per key/value head, whatever ``N`` is.

  - ``comm="all_gather"`` (the paper's): one ``all_to_all_single`` with per-peer sizes, which is an
    all-gather of each spanning segment's sparsified keys among the ranks that share it. Its
    backward is the reverse all-to-all: a reduce-scatter of the key/value gradients to their
    owners.
  - ``comm="ring"``: point to point (``batch_isend_irecv``). At step ``t`` a rank exchanges with
    the ranks ``t`` places left and right of it; the transfer of step ``t + 1`` runs while step
    ``t`` is computed, and partial results are merged by their log-sum-exp in float32. No rank
    holds a whole segment's keys at once. The backward passes the blocks again and sends each
    block's key/value gradients back to its owner, also overlapped.

* All pieces (local runs and spanning segments of every branch) are merged by log-sum-exp in
  float32 (float64 for float64 inputs), exactly as SPEC section 3: a key found by two branches
  counts twice. Gradients are exact through the mixing weights: the local pieces are
  differentiated by the local backend, the spanning pieces by an explicit backward that uses
  their merged ``out`` and ``lse``, and the merge itself by autograd.

Before any data moves, the ranks compare a small fingerprint of their configuration and shapes
(one ``all_gather`` of a few int64): ranks that disagree all raise the same ``ValueError`` instead
of hanging. A peer that never calls surfaces as a ``RuntimeError`` after the process group's
timeout.

:func:`comm_stats` counts the bytes this process sent to and received from other ranks.
"""

from __future__ import annotations

import logging
import numbers
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import _validation as V
from . import backends as _backends
from .flops import accumulation_dtype
from .functional import dilated_attention

__all__ = [
    "COMM_MODES",
    "RingDilatedAttention",
    "RingDilatedAttentionV2Collective",
    "RingMultiheadDilatedAttention",
    "StandardizedRingConfig",
    "comm_stats",
    "gather_sequence",
    "reset_comm_stats",
    "shard_sequence",
]

logger = logging.getLogger(__name__)

COMM_MODES = ("all_gather", "ring")

# Elements of one score block computed at once by the spanning pieces (queries are chunked so that
# (B, heads, queries, keys) stays under this size).
_SCORE_BLOCK_ELEMS = 1 << 24

# ---------------------------------------------------------------------------------------------
# Communication accounting
# ---------------------------------------------------------------------------------------------

_STATS: dict[str, dict[str, int]] = {}


def _count(phase: str, sent: int, received: int) -> None:
    entry = _STATS.setdefault(phase, {"sent": 0, "received": 0, "calls": 0})
    entry["sent"] += int(sent)
    entry["received"] += int(received)
    entry["calls"] += 1


def comm_stats() -> dict[str, dict[str, int]]:
    """Bytes this process sent to and received from other ranks since the last reset.

    Keys: ``"check"`` (the configuration fingerprint), ``"forward"`` and ``"backward"`` (keys,
    values and their gradients of spanning segments); each maps to ``{"sent", "received",
    "calls"}``. Bytes a rank keeps for itself are not counted.
    """
    return {phase: dict(entry) for phase, entry in _STATS.items()}


def reset_comm_stats() -> None:
    """Set the counters of :func:`comm_stats` to zero."""
    _STATS.clear()


# ---------------------------------------------------------------------------------------------
# Geometry: which positions of which rank each spanning segment needs
# ---------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _progression(seg_lo: int, o: int, r: int, lo: int, hi: int) -> tuple[int, int]:
    """Indices ``m`` with ``seg_lo + o + r*m`` in ``[lo, hi)``, as a half-open range ``(m0, m1)``."""
    m0 = max(0, _ceil_div(lo - seg_lo - o, r))
    m1 = max(0, _ceil_div(hi - seg_lo - o, r))
    return m0, max(m0, m1)


@dataclass(frozen=True)
class _Block:
    """Keys ``m0 .. m1-1`` of a piece's phase progression, held by rank ``src``."""

    src: int
    m0: int
    m1: int


@dataclass(frozen=True)
class _Piece:
    """Queries of one rank in one spanning segment, for one head phase of one branch.

    The segment ``[seg_lo, seg_hi)`` of branch ``branch`` with rate ``r``; head phase ``o``; the
    rank's queries are the positions ``seg_lo + o + r*m`` for ``m`` in ``[m0, m1)``; the keys they
    read are the ``blocks`` (ordered by source rank, hence by position).
    """

    branch: int
    seg_lo: int
    r: int
    o: int
    m0: int
    m1: int
    blocks: tuple[_Block, ...]

    def slice_of(self, m0: int, m1: int, chunk_start: int) -> slice:
        """Strided slice, in the local coordinates of the chunk starting at ``chunk_start``."""
        start = self.seg_lo + self.o + self.r * m0 - chunk_start
        return slice(start, start + self.r * (m1 - m0 - 1) + 1, self.r)


def _is_local_branch(w: int, chunk: int) -> bool:
    """Whether the segments of length ``w`` tile every chunk of length ``l`` exactly."""
    return w <= chunk and chunk % w == 0


def _rank_layout(
    j: int,
    P: int,
    chunk: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    Hq: int,
    is_causal: bool,
) -> tuple[dict[tuple[int, int], list[int]], list[_Piece]]:
    """Local runs ``{(lo, hi): [branch indices]}`` and spanning pieces of rank ``j``."""
    N = chunk * P
    a, b = j * chunk, (j + 1) * chunk
    local: dict[tuple[int, int], list[int]] = {}
    pieces: list[_Piece] = []
    for bi, (w, r) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
        if _is_local_branch(w, chunk):
            local.setdefault((0, chunk), []).append(bi)
            continue
        s_first, s_last = a // w, (b - 1) // w

        def bounds(s: int, w: int = w) -> tuple[int, int]:
            return s * w, min(s * w + w, N)

        def contained(s: int) -> bool:
            lo, hi = bounds(s)
            return lo >= a and hi <= b

        first_in = contained(s_first)
        last_in = contained(s_last)
        i0 = s_first if first_in else s_first + 1
        i1 = s_last if last_in else s_last - 1
        if i0 <= i1:  # a run of whole segments inside the chunk
            local.setdefault((bounds(i0)[0] - a, bounds(i1)[1] - a), []).append(bi)
        spanning = [] if first_in else [s_first]
        if not last_in and s_last != s_first:
            spanning.append(s_last)
        for s in spanning:
            seg_lo, seg_hi = bounds(s)
            owners = range(seg_lo // chunk, (seg_hi - 1) // chunk + 1)
            for o in range(min(r, Hq)):
                m0, m1 = _progression(seg_lo, o, r, max(a, seg_lo), min(b, seg_hi))
                if m1 == m0:
                    continue
                blocks = []
                for i in owners:
                    if is_causal and i > j:
                        continue
                    k0, k1 = _progression(
                        seg_lo, o, r, max(i * chunk, seg_lo), min(i * chunk + chunk, seg_hi)
                    )
                    if k1 > k0:
                        blocks.append(_Block(i, k0, k1))
                pieces.append(_Piece(bi, seg_lo, r, o, m0, m1, tuple(blocks)))
    return local, pieces


@dataclass(frozen=True)
class _HeadSets:
    heads: torch.Tensor  # (nh,) query heads of the phase
    kv_heads: torch.Tensor  # (nkv,) key/value heads they read
    kv_select: torch.Tensor  # (nh,) index into kv_heads for each query head


class _Plan:
    """Everything one rank needs to know about the exchange, for fixed (P, rank, l, config)."""

    def __init__(
        self,
        rank: int,
        P: int,
        chunk: int,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        Hq: int,
        Hkv: int,
        is_causal: bool,
    ) -> None:
        self.rank, self.P, self.chunk = rank, P, chunk
        self.Hq, self.Hkv = Hq, Hkv
        local, self.pieces = _rank_layout(rank, P, chunk, segment_lengths, dilation_rates, Hq, is_causal)
        self.local_runs = [
            (lo, hi, [segment_lengths[i] for i in bis], [dilation_rates[i] for i in bis])
            for (lo, hi), bis in sorted(local.items())
        ]
        self.any_span = any(not _is_local_branch(w, chunk) for w in segment_lengths)
        # Keys this rank receives, per source rank, in message order.
        self.recv_items: dict[int, list[tuple[_Piece, _Block]]] = {}
        for piece in self.pieces:
            for blk in piece.blocks:
                if blk.src != rank:
                    self.recv_items.setdefault(blk.src, []).append((piece, blk))
        # Keys this rank sends, per destination rank, in the destination's message order.
        self.send_items: dict[int, list[tuple[_Piece, _Block]]] = {}
        N = chunk * P
        reach = max(
            (_ceil_div(min(w, N), chunk) + 1 for w in segment_lengths if not _is_local_branch(w, chunk)),
            default=0,
        )
        for dst in range(max(0, rank - reach), min(P, rank + reach + 1)):
            if dst == rank:
                continue
            _, dst_pieces = _rank_layout(dst, P, chunk, segment_lengths, dilation_rates, Hq, is_causal)
            items = [(piece, blk) for piece in dst_pieces for blk in piece.blocks if blk.src == rank]
            if items:
                self.send_items[dst] = items
        distances = {abs(p - rank) for p in list(self.recv_items) + list(self.send_items)}
        self.steps = sorted(distances)
        self._heads: dict[tuple[int, int, torch.device], _HeadSets] = {}

    def head_sets(self, r: int, o: int, device: torch.device) -> _HeadSets:
        key = (r, o, device)
        if key not in self._heads:
            G = self.Hq // self.Hkv
            heads = list(range(o, self.Hq, r))
            kv_heads = sorted({h // G for h in heads})
            kv_select = [kv_heads.index(h // G) for h in heads]
            with torch.inference_mode(False):  # kept for later calls, which may be training ones
                self._heads[key] = _HeadSets(
                    *(torch.tensor(x, dtype=torch.long, device=device) for x in (heads, kv_heads, kv_select))
                )
        return self._heads[key]

    def num_kv_heads(self, r: int, o: int) -> int:
        """How many key/value heads the query heads of phase ``o`` (rate ``r``) read."""
        G = self.Hq // self.Hkv
        return len({h // G for h in range(o, self.Hq, r)})

    def item_numel(self, piece: _Piece, blk: _Block, B: int, D: int) -> int:
        """Elements of one block of keys (the values have as many)."""
        return B * (blk.m1 - blk.m0) * self.num_kv_heads(piece.r, piece.o) * D


# ---------------------------------------------------------------------------------------------
# The math of one spanning piece (plain PyTorch, explicit backward)
# ---------------------------------------------------------------------------------------------


def _causal_mask(nq: int, nk: int, offset: int | None, device: torch.device) -> torch.Tensor | None:
    """(nq, nk) mask ``key <= query + offset``; None when nothing is masked."""
    if offset is None or offset >= nk - 1:
        return None
    qi = torch.arange(nq, device=device)[:, None]
    ki = torch.arange(nk, device=device)[None, :]
    return ki <= qi + offset


def _query_chunks(B: int, nq: int, nh: int, nk: int) -> Iterator[tuple[int, int]]:
    step = max(1, _SCORE_BLOCK_ELEMS // max(1, B * nh * nk))
    for s in range(0, nq, step):
        yield s, min(nq, s + step)


def _attend_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_select: torch.Tensor,
    offset: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (B, nq, nh, D) over k, v (B, nk, nkv, D); query head ``i`` reads
    key/value head ``kv_select[i]``; with ``offset`` set, key ``x`` is read only by queries
    ``>= x - offset``. Returns out (B, nq, nh, D) and lse (B, nh, nq), in q's dtype."""
    B, nq, nh, _ = q.shape
    nk = k.shape[1]
    ke = k.index_select(2, kv_select)  # (B, nk, nh, D)
    ve = v.index_select(2, kv_select)
    outs, lses = [], []
    for s, e in _query_chunks(B, nq, nh, nk):
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, s:e], ke) * scale  # (B, nh, nc, nk)
        mask = _causal_mask(e - s, nk, None if offset is None else offset + s, q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # (B, nh, nc)
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = torch.exp(scores - safe[..., None])
        outs.append(torch.einsum("bhqk,bkhd->bqhd", p, ve))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _attend_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_select: torch.Tensor,
    nkv: int,
    offset: int | None,
    scale: float,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one piece given the *merged* ``lse`` (B, nh, nq) and
    ``delta = rowsum(dout * out) - dlse`` (B, nh, nq): dq (B, nq, nh, D), dk and dv (B, nk, nkv, D)."""
    B, nq, nh, D = q.shape
    nk = k.shape[1]
    ke = k.index_select(2, kv_select)  # (B, nk, nh, D)
    ve = v.index_select(2, kv_select)
    dq = torch.empty_like(q)
    dke = torch.zeros_like(ke)
    dve = torch.zeros_like(ve)
    for s, e in _query_chunks(B, nq, nh, nk):
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, s:e], ke) * scale  # (B, nh, nc, nk)
        mask = _causal_mask(e - s, nk, None if offset is None else offset + s, q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        row = lse[:, :, s:e]
        safe = torch.where(torch.isfinite(row), row, torch.full_like(row, float("inf")))
        p = torch.exp(scores - safe[..., None])  # rows no piece covers get 0
        do = dout[:, s:e]
        dve += torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, ve)
        ds = p * (dp - delta[:, :, s:e, None])
        dq[:, s:e] = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
        dke += torch.einsum("bhqk,bqhd->bkhd", ds, q[:, s:e]) * scale
    dk = k.new_zeros((B, nk, nkv, D)).index_add_(2, kv_select, dke)
    dv = v.new_zeros((B, nk, nkv, D)).index_add_(2, kv_select, dve)
    return dq, dk, dv


def _merge_into(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    sl: slice,
    heads: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge a partial result (out (B, n, nh, D), lse (B, nh, n)) into the accumulators
    out_acc (B, l, Hq, D) and lse_acc (B, Hq, l) at positions ``sl`` and heads ``heads``."""
    out_view = out_acc[:, sl]  # (B, n, Hq, D), a view
    lse_view = lse_acc[:, :, sl]  # (B, Hq, n), a view
    old_out = out_view.index_select(2, heads)
    old_lse = lse_view.index_select(1, heads)
    new_lse = torch.logaddexp(old_lse, lse)
    safe = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    w_old = torch.exp(old_lse - safe).transpose(1, 2)[..., None]  # (B, n, nh, 1)
    w_new = torch.exp(lse - safe).transpose(1, 2)[..., None]
    out_view.index_copy_(2, heads, old_out * w_old + out * w_new)
    lse_view.index_copy_(1, heads, new_lse)


# ---------------------------------------------------------------------------------------------
# Transport
# ---------------------------------------------------------------------------------------------


class _Comm:
    """Collective and point-to-point calls on one group, with byte counting and clear errors."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, P: int, device: torch.device) -> None:
        self.group, self.rank, self.P = group, rank, P
        backend = str(dist.get_backend(group))
        # NCCL moves CUDA tensors; gloo moves CPU tensors (CUDA data is staged through the host).
        self.device = device if (device.type == "cuda" and "nccl" in backend) else torch.device("cpu")
        self.backend = backend

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def fail(self, what: str, err: Exception) -> RuntimeError:
        return RuntimeError(
            f"RingDilatedAttention (rank {self.rank} of {self.P}, {self.backend}): {what} failed: {err}. "
            "A peer that does not answer surfaces here after the process group's timeout: every rank of "
            "the group must call forward (and backward) with the same configuration."
        )

    def all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], phase: str
    ) -> torch.Tensor:
        """Bytes ``send`` (uint8) cut by ``send_splits`` per destination; returns the bytes received."""
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        try:
            dist.all_to_all_single(recv, send.to(self.device), recv_splits, send_splits, group=self.group)
        except RuntimeError as err:
            raise self.fail(f"the {phase} all-to-all exchange", err) from err
        _count(phase, sum(send_splits) - send_splits[self.rank], sum(recv_splits) - recv_splits[self.rank])
        return recv

    def post(
        self, sends: dict[int, torch.Tensor], recv_sizes: dict[int, int], tag: int, phase: str
    ) -> _Pending:
        """Start point-to-point transfers: ``sends`` {peer: uint8 bytes}, ``recv_sizes`` {peer: bytes}."""
        ops, recvs = [], {}
        for peer, nbytes in sorted(recv_sizes.items()):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            recvs[peer] = buf
            ops.append(dist.P2POp(dist.irecv, buf, self.global_rank(peer), self.group, tag))
        staged = {}
        for peer, data in sorted(sends.items()):
            staged[peer] = data.to(self.device)
            ops.append(dist.P2POp(dist.isend, staged[peer], self.global_rank(peer), self.group, tag))
        works = []
        if ops:
            try:
                works = dist.batch_isend_irecv(ops)
            except RuntimeError as err:
                raise self.fail(f"the {phase} point-to-point exchange", err) from err
        _count(phase, sum(int(t.numel()) for t in staged.values()), sum(recv_sizes.values()))
        return _Pending(self, works, recvs, staged, phase)


class _Pending:
    """Transfers in flight; :meth:`wait` returns the received bytes per peer."""

    def __init__(
        self,
        comm: _Comm,
        works: list,
        recvs: dict[int, torch.Tensor],
        staged: dict[int, torch.Tensor],
        phase: str,
    ) -> None:
        self.comm, self.works, self.recvs, self.staged, self.phase = comm, works, recvs, staged, phase

    def wait(self) -> dict[int, torch.Tensor]:
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as err:
            raise self.comm.fail(f"the {self.phase} point-to-point exchange", err) from err
        self.works, self.staged = [], {}
        return self.recvs


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(buf: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return buf.view(dtype).to(device)


# ---------------------------------------------------------------------------------------------
# The spanning pieces as one autograd node
# ---------------------------------------------------------------------------------------------


class _SpanJob:
    """One forward call's spanning pieces: plan, group, mode, scale; runs forward and backward."""

    def __init__(self, plan: _Plan, comm: _Comm, mode: str, scale: float, is_causal: bool) -> None:
        self.plan, self.comm, self.mode, self.scale, self.is_causal = plan, comm, mode, scale, is_causal

    # -- helpers ---------------------------------------------------------------------------
    def _pack(self, k: torch.Tensor, v: torch.Tensor, items: list[tuple[_Piece, _Block]]) -> torch.Tensor:
        """Keys and values of ``items`` from the local chunk, as one flat tensor in k's dtype."""
        parts = []
        a = self.plan.rank * self.plan.chunk
        for piece, blk in items:
            sl = piece.slice_of(blk.m0, blk.m1, a)
            kvh = self.plan.head_sets(piece.r, piece.o, k.device).kv_heads
            parts.append(k[:, sl].index_select(2, kvh).reshape(-1))
            parts.append(v[:, sl].index_select(2, kvh).reshape(-1))
        return torch.cat(parts) if parts else k.new_empty(0)

    def _unpack(
        self, flat: torch.Tensor, items: list[tuple[_Piece, _Block]], B: int, D: int
    ) -> dict[tuple[_Piece, _Block], tuple[torch.Tensor, torch.Tensor]]:
        out, pos = {}, 0
        for piece, blk in items:
            nkv = self.plan.num_kv_heads(piece.r, piece.o)
            shape = (B, blk.m1 - blk.m0, nkv, D)
            n = B * (blk.m1 - blk.m0) * nkv * D
            kb = flat[pos : pos + n].view(shape)
            vb = flat[pos + n : pos + 2 * n].view(shape)
            pos += 2 * n
            out[(piece, blk)] = (kb, vb)
        return out

    def _nbytes(self, items: list[tuple[_Piece, _Block]], B: int, D: int, dtype: torch.dtype) -> int:
        """Bytes of the keys and values of ``items`` in ``dtype``."""
        return sum(2 * self.plan.item_numel(p, b, B, D) for p, b in items) * dtype.itemsize

    def _local_block(
        self, k: torch.Tensor, v: torch.Tensor, piece: _Piece, blk: _Block
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sl = piece.slice_of(blk.m0, blk.m1, self.plan.rank * self.plan.chunk)
        kvh = self.plan.head_sets(piece.r, piece.o, k.device).kv_heads
        return k[:, sl].index_select(2, kvh), v[:, sl].index_select(2, kvh)

    def _offset(self, piece: _Piece, blk: _Block) -> int | None:
        """Causal offset of a block: only the rank's own block needs a mask (others lie to its left)."""
        if not self.is_causal or blk.src != self.plan.rank:
            return None
        return piece.m0 - blk.m0

    def _queries(self, t: torch.Tensor, piece: _Piece, heads: torch.Tensor) -> torch.Tensor:
        return t[:, piece.slice_of(piece.m0, piece.m1, self.plan.rank * self.plan.chunk)].index_select(
            2, heads
        )

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Returns out (B, l, Hq, D) and lse (B, Hq, l) in the compute dtype, and tensors to save."""
        B, chunk, Hq, D = q.shape
        cdt = accumulation_dtype(q.dtype)
        out_acc = q.new_zeros((B, chunk, Hq, D), dtype=cdt)
        lse_acc = q.new_full((B, Hq, chunk), float("-inf"), dtype=cdt)
        qc = q.to(cdt)

        def attend(piece: _Piece, blk_offset: int | None, kb: torch.Tensor, vb: torch.Tensor) -> None:
            hs = self.plan.head_sets(piece.r, piece.o, q.device)
            o, lse = _attend_forward(
                self._queries(qc, piece, hs.heads),
                kb.to(cdt),
                vb.to(cdt),
                hs.kv_select,
                blk_offset,
                self.scale,
            )
            _merge_into(
                out_acc, lse_acc, piece.slice_of(piece.m0, piece.m1, self.plan.rank * chunk), hs.heads, o, lse
            )

        if self.mode == "all_gather":
            recv = self._exchange_all(k, v, B, D)
            received = self._unpack_all(recv, k.dtype, q.device, B, D)
            for piece in self.plan.pieces:
                ks, vs = [], []
                for blk in piece.blocks:
                    kb, vb = (
                        self._local_block(k, v, piece, blk)
                        if blk.src == self.plan.rank
                        else received[(piece, blk)]
                    )
                    ks.append(kb)
                    vs.append(vb)
                offset = (piece.m0 - piece.blocks[0].m0) if self.is_causal else None
                attend(piece, offset, torch.cat(ks, dim=1), torch.cat(vs, dim=1))
            return out_acc, lse_acc, [recv]  # the gathered keys and values, kept for the backward

        # ring: own blocks first, then step t = 1, 2, ... with step t + 1 in flight meanwhile
        steps = self.plan.steps
        pending = self._post_kv(k, v, steps[0], "forward") if steps else None
        for piece in self.plan.pieces:
            for blk in piece.blocks:
                if blk.src == self.plan.rank:
                    attend(piece, self._offset(piece, blk), *self._local_block(k, v, piece, blk))
        for n, d in enumerate(steps):
            blocks = self._receive_kv(pending, d, k.dtype, q.device, B, D)
            pending = self._post_kv(k, v, steps[n + 1], "forward") if n + 1 < len(steps) else None
            for (piece, blk), (kb, vb) in blocks.items():
                attend(piece, self._offset(piece, blk), kb, vb)
        return out_acc, lse_acc, []

    def _exchange_all(self, k: torch.Tensor, v: torch.Tensor, B: int, D: int) -> torch.Tensor:
        """One all-to-all: every rank gets the sparsified keys and values of its spanning segments.
        Returns the received bytes (on k's device), ordered by source rank."""
        P, plan = self.plan.P, self.plan
        send_parts = [_as_bytes(self._pack(k, v, plan.send_items.get(dst, []))) for dst in range(P)]
        send_splits = [int(t.numel()) for t in send_parts]
        recv_splits = [self._nbytes(plan.recv_items.get(src, []), B, D, k.dtype) for src in range(P)]
        return self.comm.all_to_all(torch.cat(send_parts), send_splits, recv_splits, "forward").to(k.device)

    def _unpack_all(
        self, recv: torch.Tensor, dtype: torch.dtype, device: torch.device, B: int, D: int
    ) -> dict[tuple[_Piece, _Block], tuple[torch.Tensor, torch.Tensor]]:
        received, pos = {}, 0
        for src in range(self.plan.P):
            items = self.plan.recv_items.get(src, [])
            n = self._nbytes(items, B, D, dtype)
            if n:
                received.update(self._unpack(_from_bytes(recv[pos : pos + n], dtype, device), items, B, D))
            pos += n
        return received

    def _step_peers(self, d: int) -> tuple[list[int], list[int]]:
        """(sources, destinations) of this rank at distance ``d``."""
        me = self.plan.rank
        srcs = [p for p in (me - d, me + d) if p in self.plan.recv_items]
        dsts = [p for p in (me - d, me + d) if p in self.plan.send_items]
        return srcs, dsts

    def _post_kv(self, k: torch.Tensor, v: torch.Tensor, d: int, phase: str) -> _Pending:
        srcs, dsts = self._step_peers(d)
        B, D = k.shape[0], k.shape[3]
        sends = {p: _as_bytes(self._pack(k, v, self.plan.send_items[p])) for p in dsts}
        sizes = {p: self._nbytes(self.plan.recv_items[p], B, D, k.dtype) for p in srcs}
        return self.comm.post(sends, sizes, tag=2 * d, phase=phase)

    def _receive_kv(
        self, pending: _Pending | None, d: int, dtype: torch.dtype, device: torch.device, B: int, D: int
    ) -> dict[tuple[_Piece, _Block], tuple[torch.Tensor, torch.Tensor]]:
        assert pending is not None
        out = {}
        for src, buf in pending.wait().items():
            out.update(self._unpack(_from_bytes(buf, dtype, device), self.plan.recv_items[src], B, D))
        return out

    # -- backward --------------------------------------------------------------------------
    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_s: torch.Tensor,
        lse_s: torch.Tensor,
        saved: list[torch.Tensor],
        dout: torch.Tensor | None,
        dlse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients (dq, dk, dv) of this rank's chunk: its own keys' gradients from every rank that
        read them, and its queries' gradients."""
        B, chunk, _, D = q.shape
        cdt = out_s.dtype
        plan, me = self.plan, self.plan.rank
        dout = torch.zeros_like(out_s) if dout is None else dout.to(cdt)
        delta = (dout * out_s).sum(-1).transpose(1, 2)  # (B, Hq, l)
        if dlse is not None:
            delta = delta - torch.where(torch.isfinite(lse_s), dlse.to(cdt), torch.zeros_like(lse_s))
        qc = q.to(cdt)
        dq = torch.zeros_like(qc)
        dk = k.new_zeros(k.shape, dtype=cdt)
        dv = v.new_zeros(v.shape, dtype=cdt)
        a = me * chunk

        def grads(
            piece: _Piece, offset: int | None, kb: torch.Tensor, vb: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            hs = plan.head_sets(piece.r, piece.o, q.device)
            sl = piece.slice_of(piece.m0, piece.m1, a)
            gq, gk, gv = _attend_backward(
                qc[:, sl].index_select(2, hs.heads),
                kb.to(cdt),
                vb.to(cdt),
                hs.kv_select,
                int(hs.kv_heads.numel()),
                offset,
                self.scale,
                dout[:, sl].index_select(2, hs.heads),
                lse_s[:, :, sl].index_select(1, hs.heads),
                delta[:, :, sl].index_select(1, hs.heads),
            )
            dq[:, sl].index_add_(2, hs.heads, gq)
            return gk, gv

        def add_local(piece: _Piece, blk: _Block, gk: torch.Tensor, gv: torch.Tensor) -> None:
            sl = piece.slice_of(blk.m0, blk.m1, a)
            kvh = plan.head_sets(piece.r, piece.o, q.device).kv_heads
            dk[:, sl].index_add_(2, kvh, gk)
            dv[:, sl].index_add_(2, kvh, gv)

        def add_returned(flat_by_dst: dict[int, torch.Tensor]) -> None:
            for dst, buf in flat_by_dst.items():
                items = plan.send_items[dst]
                for (piece, blk), (gk, gv) in self._unpack(
                    _from_bytes(buf, cdt, q.device), items, B, D
                ).items():
                    add_local(piece, blk, gk, gv)

        if self.mode == "all_gather":
            received = self._unpack_all(saved[0], k.dtype, q.device, B, D)  # what the forward gathered
            back: dict[int, list[torch.Tensor]] = {}
            for piece in plan.pieces:
                kbs, vbs = [], []
                for blk in piece.blocks:
                    kb, vb = self._local_block(k, v, piece, blk) if blk.src == me else received[(piece, blk)]
                    kbs.append(kb)
                    vbs.append(vb)
                offset = (piece.m0 - piece.blocks[0].m0) if self.is_causal else None
                gk, gv = grads(piece, offset, torch.cat(kbs, dim=1), torch.cat(vbs, dim=1))
                pos = 0
                for blk in piece.blocks:
                    n = blk.m1 - blk.m0
                    gkb, gvb = gk[:, pos : pos + n], gv[:, pos : pos + n]
                    pos += n
                    if blk.src == me:
                        add_local(piece, blk, gkb, gvb)
                    else:
                        back.setdefault(blk.src, []).extend([gkb.reshape(-1), gvb.reshape(-1)])
            # reverse all-to-all: gradients go back to the ranks that own the keys (a reduce-scatter)
            P = plan.P
            parts = [
                _as_bytes(torch.cat(back[p]))
                if p in back
                else torch.empty(0, dtype=torch.uint8, device=q.device)
                for p in range(P)
            ]
            send_splits = [int(t.numel()) for t in parts]
            recv_splits = [self._nbytes(plan.send_items.get(p, []), B, D, cdt) for p in range(P)]
            recv = self.comm.all_to_all(torch.cat(parts), send_splits, recv_splits, "backward")
            pos, returned = 0, {}
            for p in range(P):
                if recv_splits[p]:
                    returned[p] = recv[pos : pos + recv_splits[p]]
                pos += recv_splits[p]
            add_returned(returned)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

        # ring: pass the key/value blocks again; send each block's gradients back to its owner
        steps = plan.steps
        pending = self._post_kv(k, v, steps[0], "backward") if steps else None
        for piece in plan.pieces:
            for blk in piece.blocks:
                if blk.src == me:
                    gk, gv = grads(piece, self._offset(piece, blk), *self._local_block(k, v, piece, blk))
                    add_local(piece, blk, gk, gv)
        grad_pending: _Pending | None = None
        for n, d in enumerate(steps):
            blocks = self._receive_kv(pending, d, k.dtype, q.device, B, D)
            pending = self._post_kv(k, v, steps[n + 1], "backward") if n + 1 < len(steps) else None
            back = {}
            for (piece, blk), (kb, vb) in blocks.items():
                gk, gv = grads(piece, self._offset(piece, blk), kb, vb)
                back.setdefault(blk.src, []).extend([gk.reshape(-1), gv.reshape(-1)])
            srcs, dsts = self._step_peers(d)
            sends = {p: _as_bytes(torch.cat(back[p])) for p in srcs}
            sizes = {p: self._nbytes(plan.send_items[p], B, D, cdt) for p in dsts}
            if grad_pending is not None:
                add_returned(grad_pending.wait())
            grad_pending = self.comm.post(sends, sizes, tag=2 * d + 1, phase="backward")
        if grad_pending is not None:
            add_returned(grad_pending.wait())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _SpanAttention(torch.autograd.Function):
    """(out, lse) of the spanning pieces; backward returns key/value gradients to their owners."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, job: _SpanJob
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, saved = job.forward(q, k, v)
        ctx.job = job
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        dq, dk, dv = ctx.job.backward(q, k, v, out, lse, saved, dout, dlse)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------------------------
# Merging pieces
# ---------------------------------------------------------------------------------------------


def _merge(
    pieces: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable log-sum-exp merge of (out (B, l, H, D), lse (B, H, l)) pieces, in ``dtype``."""
    if len(pieces) == 1:
        out, lse = pieces[0]
        return out, lse.to(dtype)
    lses = torch.stack([lse.to(dtype) for _, lse in pieces])  # (n, B, H, l)
    m = lses.detach().amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(lses - m).sum(dim=0)  # (B, H, l)
    covered = s > 0
    lse = torch.where(
        covered, torch.log(torch.where(covered, s, torch.ones_like(s))) + m, torch.full_like(s, float("-inf"))
    )
    lse_w = torch.where(covered, lse, torch.zeros_like(lse))
    out = None
    for (o, _), li in zip(pieces, lses, strict=True):
        weight = torch.exp(li - lse_w).transpose(1, 2)[..., None]  # (B, l, H, 1)
        term = o.to(dtype) * weight
        out = term if out is None else out + term
    return out, lse


# ---------------------------------------------------------------------------------------------
# Sharding helpers
# ---------------------------------------------------------------------------------------------


def _resolve_group(process_group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, size, rank); size 1 when torch.distributed is not initialised."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        return None, dist.get_world_size(), dist.get_rank()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "a process_group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first"
        )
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the process_group given")
    return process_group, dist.get_world_size(process_group), rank


def shard_sequence(
    x: torch.Tensor, process_group: dist.ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (the sequence dimension of (B, N, H, D)).

    Raises ValueError when ``N`` is not divisible by the number of ranks.
    """
    _, P, rank = _resolve_group(process_group)
    N = x.shape[dim]
    if N % P != 0:
        raise ValueError(
            f"the sequence length N = {N} must be divisible by the number of ranks P = {P} "
            f"(each rank holds N / P positions); pad the sequence to a multiple of {P}"
        )
    chunk = N // P
    return x.narrow(dim, rank * chunk, chunk)


def gather_sequence(
    x: torch.Tensor, process_group: dist.ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` (the inverse of :func:`shard_sequence`).
    Not differentiable; for checks and inference."""
    group, P, _ = _resolve_group(process_group)
    if P == 1:
        return x
    chunks = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(chunks, x.contiguous(), group=group)
    return torch.cat(chunks, dim=dim)


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_FINGERPRINT_MAGIC = 0x44_41_52_49  # "DARI"


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


class RingDilatedAttention(nn.Module):
    """Dilated attention with the sequence split across the ranks of a process group.

    Each rank calls ``forward`` with its contiguous chunk ``(B, N/P, H, D)`` of q, k and v (use
    :func:`shard_sequence`) and gets its chunk of the output; together the chunks equal
    :func:`dilated_attention.dilated_attention` on the whole sequence, forward and backward.
    Without an initialised process group, or with a group of one, it runs the local op.

    Args:
        segment_lengths, dilation_rates: the branches (SPEC sections 2-3).
        softmax_scale: multiplies the scores; ``1/sqrt(D)`` by default.
        attention_dropout: must be 0.0 (attention dropout is not supported across ranks).
        process_group: the ranks that share the sequence; the default group when None.
        comm: ``"all_gather"`` (gather each spanning segment's sparsified keys at once) or
            ``"ring"`` (pass them point to point, overlapping transfers with compute).
        device, dtype: accepted for compatibility; the module has no parameters and runs on the
            device and in the dtype of its inputs.
        use_pattern_cache: keep the exchange plan of each (rank, chunk length, heads, causal)
            instead of rebuilding it on every call.
        enable_memory_pool, memory_pool_threshold_mb: accepted and ignored: PyTorch's caching
            allocator already pools memory, and the kernels free their own buffers on return.
        attention_backend: backend of the local pieces (see :mod:`dilated_attention.backends`).
        check_consistency: compare a fingerprint of the configuration and shapes across ranks on
            every call (one small all-gather), so that a mismatch raises on every rank instead of
            hanging. Leave it on unless the saving matters.
        ring_size: the number of ranks expected; a group of another size (larger than one) is an
            error. None accepts any.
    """

    def __init__(
        self,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        softmax_scale: float | None = None,
        attention_dropout: float = 0.0,
        process_group: dist.ProcessGroup | None = None,
        comm: str = "all_gather",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        use_pattern_cache: bool = True,
        enable_memory_pool: bool = False,
        memory_pool_threshold_mb: float = 16.0,
        attention_backend: str = "auto",
        check_consistency: bool = True,
        ring_size: int | None = None,
    ) -> None:
        super().__init__()
        self.segment_lengths, self.dilation_rates = V.normalize_branches(segment_lengths, dilation_rates)
        if softmax_scale is not None:
            V.resolve_scale(softmax_scale, 1)
        self.softmax_scale = softmax_scale
        if V.check_dropout(attention_dropout) != 0.0:
            raise ValueError(
                f"RingDilatedAttention does not support attention dropout, got "
                f"attention_dropout={attention_dropout!r}; use 0.0"
            )
        self.attention_dropout = 0.0
        if comm not in COMM_MODES:
            raise ValueError(f"comm must be one of {COMM_MODES}, got {comm!r}")
        self.comm = comm
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, got "
                f"{type(process_group).__name__}"
            )
        self.process_group = process_group
        if dtype is not None and dtype not in V.FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {V.FLOAT_DTYPES} or None, got {dtype!r}")
        self.device = None if device is None else torch.device(device)
        self.dtype = dtype
        self.use_pattern_cache = V.check_bool(use_pattern_cache, "use_pattern_cache")
        self.enable_memory_pool = V.check_bool(enable_memory_pool, "enable_memory_pool")
        if (
            isinstance(memory_pool_threshold_mb, bool)
            or not isinstance(memory_pool_threshold_mb, numbers.Real)
            or not memory_pool_threshold_mb >= 0
        ):
            raise ValueError(
                f"memory_pool_threshold_mb must be a number >= 0, got {memory_pool_threshold_mb!r}"
            )
        self.memory_pool_threshold_mb = float(memory_pool_threshold_mb)
        if not isinstance(attention_backend, str):
            raise ValueError(f"attention_backend must be a string, got {attention_backend!r}")
        check_name = getattr(_backends, "check_backend_name", None)
        if check_name is not None:
            check_name(attention_backend)
        self.attention_backend = attention_backend
        self.check_consistency = V.check_bool(check_consistency, "check_consistency")
        if ring_size is not None and (
            isinstance(ring_size, bool) or not isinstance(ring_size, numbers.Integral) or ring_size < 1
        ):
            raise ValueError(f"ring_size must be an int >= 1 or None, got {ring_size!r}")
        self.ring_size = None if ring_size is None else int(ring_size)
        self._plans: dict[tuple, _Plan] = {}

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
            f"comm={self.comm!r}, attention_backend={self.attention_backend!r}"
        )

    # -- helpers -------------------------------------------------------------------------
    def _fingerprint(self, q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: float) -> dict[str, int]:
        B, chunk, Hq, D = q.shape
        fields = {
            "magic": _FINGERPRINT_MAGIC,
            "batch size B": B,
            "chunk length N/P": chunk,
            "query heads": Hq,
            "key/value heads": k.shape[2],
            "head dim D": D,
            "dtype": _DTYPE_CODES[q.dtype],
            "is_causal": int(is_causal),
            "comm": COMM_MODES.index(self.comm),
            "number of branches": len(self.segment_lengths),
            "softmax_scale (bits)": _float_bits(scale),
        }
        for i, (w, r) in enumerate(zip(self.segment_lengths, self.dilation_rates, strict=True)):
            fields[f"segment_lengths[{i}]"] = w
            fields[f"dilation_rates[{i}]"] = r
        for i in range(len(self.segment_lengths), V.MAX_BRANCHES):
            fields[f"segment_lengths[{i}]"] = 0
            fields[f"dilation_rates[{i}]"] = 0
        return fields

    def _check_ranks(self, comm: _Comm, fields: dict[str, int]) -> None:
        mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=comm.device)
        rows = [torch.empty_like(mine) for _ in range(comm.P)]
        try:
            dist.all_gather(rows, mine, group=comm.group)
        except RuntimeError as err:
            raise comm.fail("the consistency check (an all_gather of the configuration)", err) from err
        _count("check", mine.numel() * 8 * (comm.P - 1), mine.numel() * 8 * (comm.P - 1))
        table = torch.stack(rows).cpu().tolist()
        if all(row == table[0] for row in table):
            return
        names = list(fields)
        if any(row[0] != _FINGERPRINT_MAGIC for row in table):
            raise ValueError(
                "RingDilatedAttention: another collective ran on the process group at the same "
                "time as the consistency check; every rank must call forward together"
            )
        diffs = []
        for col, name in enumerate(names):
            values = [row[col] for row in table]
            if len(set(values)) > 1:
                if name == "dtype":
                    inv = {c: str(t).replace("torch.", "") for t, c in _DTYPE_CODES.items()}
                    values = [inv.get(x, x) for x in values]
                elif name == "comm":
                    values = [COMM_MODES[x] for x in values]
                diffs.append(f"{name}: " + ", ".join(f"rank {r}: {x}" for r, x in enumerate(values)))
        hint = ""
        if any(d.startswith("chunk length") for d in diffs):
            hint = (
                " (every rank must hold N / P positions: N must be divisible by P; split the sequence "
                "with dilated_attention.ring.shard_sequence)"
            )
        raise ValueError(
            f"RingDilatedAttention: the ranks of the group were called with different "
            f"configurations or shapes{hint}: " + "; ".join(diffs)
        )

    def _plan(self, rank: int, P: int, chunk: int, Hq: int, Hkv: int, is_causal: bool) -> _Plan:
        key = (rank, P, chunk, Hq, Hkv, is_causal)
        plan = self._plans.get(key)
        if plan is None:
            plan = _Plan(rank, P, chunk, self.segment_lengths, self.dilation_rates, Hq, Hkv, is_causal)
            logger.debug(
                "ring plan for rank %d of %d, chunk %d: local runs %s, %d spanning pieces, peers %s",
                rank,
                P,
                chunk,
                [(lo, hi, s, r) for lo, hi, s, r in plan.local_runs],
                len(plan.pieces),
                sorted(set(plan.recv_items) | set(plan.send_items)),
            )
            if self.use_pattern_cache:
                self._plans[key] = plan
        return plan

    # -- forward -------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of this rank's chunk.

        Args:
            q: (B, N/P, Hq, D), this rank's queries (positions ``[rank*N/P, (rank+1)*N/P)``).
            k, v: (B, N/P, Hkv, D), the same positions of the keys and values.
            is_causal: each query reads only keys at positions ``<=`` its own (global positions).
            return_lse: also return the log-sum-exp (B, Hq, N/P), float32 (float64 for float64).

        Returns:
            out (B, N/P, Hq, D) in q's dtype, or ``(out, lse)``.
        """
        V.check_qkv(q, k, v)
        is_causal = V.check_bool(is_causal, "is_causal")
        return_lse = V.check_bool(return_lse, "return_lse")
        scale = V.check_scale_for_dtype(V.resolve_scale(self.softmax_scale, q.shape[-1]), q.dtype)
        group, P, rank = _resolve_group(self.process_group)
        if self.ring_size is not None and P > 1 and P != self.ring_size:
            raise ValueError(f"ring_size={self.ring_size} but the process group has {P} ranks")
        local = {"is_causal": is_causal, "softmax_scale": scale, "backend": self.attention_backend}
        if P == 1:
            return dilated_attention(
                q, k, v, self.segment_lengths, self.dilation_rates, return_lse=return_lse, **local
            )
        comm = _Comm(group, rank, P, q.device)
        if self.check_consistency:
            self._check_ranks(comm, self._fingerprint(q, k, is_causal, scale))
        B, chunk, Hq, _ = q.shape
        lse_dtype = accumulation_dtype(q.dtype)
        if B == 0 or chunk == 0:
            return dilated_attention(
                q, k, v, self.segment_lengths, self.dilation_rates, return_lse=return_lse, **local
            )
        plan = self._plan(rank, P, chunk, Hq, k.shape[2], is_causal)
        pieces = []
        for lo, hi, segs, rates in plan.local_runs:
            o, lse = dilated_attention(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], segs, rates, return_lse=True, **local
            )
            if (lo, hi) != (0, chunk):
                o = F.pad(o, (0, 0, 0, 0, lo, chunk - hi))  # zeros outside the run
                lse = F.pad(lse, (lo, chunk - hi), value=float("-inf"))
            pieces.append((o, lse))
        if plan.any_span:
            job = _SpanJob(plan, comm, self.comm, scale, is_causal)
            pieces.append(_SpanAttention.apply(q, k, v, job))
        out, lse = _merge(pieces, lse_dtype)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out


RingDilatedAttentionV2Collective = RingDilatedAttention


# ---------------------------------------------------------------------------------------------
# Multi-head wrapper and configuration
# ---------------------------------------------------------------------------------------------


def _one_of(name: str, value: int | None, alias: str, alias_value: int | None) -> int | None:
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"{name}={value!r} and {alias}={alias_value!r} disagree; give one of them")
    chosen = value if value is not None else alias_value
    if chosen is not None and (
        isinstance(chosen, bool) or not isinstance(chosen, numbers.Integral) or chosen < 1
    ):
        raise ValueError(f"{name} must be an int >= 1, got {chosen!r}")
    return None if chosen is None else int(chosen)


@dataclass
class StandardizedRingConfig:
    """Configuration of :class:`RingMultiheadDilatedAttention`.

    ``dim`` is the model width (an alias of ``embed_dim``) and ``heads`` the number of heads (an
    alias of ``num_heads``); the head dim is ``dim // heads``. ``ring_size`` is the number of
    ranks expected (checked against the process group when there is one with more than one rank).
    ``dtype`` and ``device`` are those of the projection weights. Attention dropout is not
    supported across ranks: ``dropout`` must be 0.0.

    Example: ``StandardizedRingConfig(dim=768, heads=12, segment_lengths=[2048, 4096],
    dilation_rates=[1, 2], ring_size=2, dtype=torch.float32)``.
    """

    dim: int | None = None
    heads: int | None = None
    segment_lengths: Sequence[int] | None = None
    dilation_rates: Sequence[int] | None = None
    ring_size: int | None = None
    dtype: torch.dtype | None = None
    device: str | torch.device | None = None
    embed_dim: int | None = None
    num_heads: int | None = None
    dropout: float = 0.0
    bias: bool = True
    layer_norm: bool = True
    comm: str = "all_gather"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        self.embed_dim = self.dim = _one_of("embed_dim", self.embed_dim, "dim", self.dim)
        self.num_heads = self.heads = _one_of("num_heads", self.num_heads, "heads", self.heads)
        if self.embed_dim is None or self.num_heads is None:
            raise TypeError(
                f"StandardizedRingConfig needs dim (or embed_dim) and heads (or num_heads), got "
                f"dim={self.embed_dim!r}, heads={self.num_heads!r}"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(f"dim ({self.embed_dim}) must be divisible by heads ({self.num_heads})")
        if self.segment_lengths is None or self.dilation_rates is None:
            raise TypeError("StandardizedRingConfig needs segment_lengths and dilation_rates")
        self.segment_lengths, self.dilation_rates = V.normalize_branches(
            self.segment_lengths, self.dilation_rates
        )
        if self.ring_size is not None:
            self.ring_size = _one_of("ring_size", self.ring_size, "ring_size", None)
        if V.check_dropout(self.dropout) != 0.0:
            raise ValueError(
                f"attention dropout is not supported across ranks, got dropout={self.dropout!r}; use 0.0"
            )
        if self.comm not in COMM_MODES:
            raise ValueError(f"comm must be one of {COMM_MODES}, got {self.comm!r}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


def _multihead_base() -> type:
    from .modules import MultiheadDilatedAttention

    return MultiheadDilatedAttention


class RingMultiheadDilatedAttention(_multihead_base()):
    """:class:`dilated_attention.MultiheadDilatedAttention` whose attention is a
    :class:`RingDilatedAttention`: each rank passes its chunk (B, N/P, E) of the sequence and gets
    its chunk of the output. The projections and the sub-layer LayerNorm act per position, so
    they run on the chunk unchanged; keep the weights equal on every rank (as DDP or FSDP do).

    Args: those of :class:`~dilated_attention.MultiheadDilatedAttention` (``embed_dim``/``dim``,
    ``num_heads``/``heads``, ``segment_lengths``, ``dilation_rates``, ``bias``, ``layer_norm``,
    ``gamma_init``, ``device``, ``dtype``, ``attention_backend``, ``layer_norm_eps``), with
    ``dropout`` 0.0 only, and those of :class:`RingDilatedAttention` (``process_group``,
    ``comm``, ``ring_size``, ``use_pattern_cache``, ``enable_memory_pool``,
    ``memory_pool_threshold_mb``, ``check_consistency``).

    ``forward(query, key=None, value=None, is_causal=False) -> (out, None)``.
    """

    def __init__(
        self,
        embed_dim: int | None = None,
        num_heads: int | None = None,
        segment_lengths: int | Sequence[int] | None = None,
        dilation_rates: int | Sequence[int] | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
        gamma_init: float = 1.0,
        device: str | torch.device | None = None,
        dtype: Any | None = None,
        attention_backend: str = "auto",
        *,
        dim: int | None = None,
        heads: int | None = None,
        layer_norm_eps: float = 1e-5,
        process_group: dist.ProcessGroup | None = None,
        comm: str = "all_gather",
        ring_size: int | None = None,
        use_pattern_cache: bool = True,
        enable_memory_pool: bool = False,
        memory_pool_threshold_mb: float = 16.0,
        check_consistency: bool = True,
    ) -> None:
        if V.check_dropout(dropout) != 0.0:
            raise ValueError(
                f"RingMultiheadDilatedAttention does not support attention dropout, got "
                f"dropout={dropout!r}; use 0.0"
            )
        super().__init__(
            embed_dim,
            num_heads,
            segment_lengths,
            dilation_rates,
            dropout=0.0,
            bias=bias,
            layer_norm=layer_norm,
            gamma_init=gamma_init,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            dim=dim,
            heads=heads,
            layer_norm_eps=layer_norm_eps,
        )
        self.attention = RingDilatedAttention(
            self.attention.segment_lengths,
            self.attention.dilation_rates,
            process_group=process_group,
            comm=comm,
            attention_backend=attention_backend,
            use_pattern_cache=use_pattern_cache,
            enable_memory_pool=enable_memory_pool,
            memory_pool_threshold_mb=memory_pool_threshold_mb,
            check_consistency=check_consistency,
            ring_size=ring_size,
        )

    @classmethod
    def from_config(
        cls, config: StandardizedRingConfig, process_group: dist.ProcessGroup | None = None, **kwargs: Any
    ) -> RingMultiheadDilatedAttention:
        """Build the module of a :class:`StandardizedRingConfig` (``kwargs`` add or override arguments)."""
        if not isinstance(config, StandardizedRingConfig):
            raise TypeError(f"config must be a StandardizedRingConfig, got {type(config).__name__}")
        args = {
            "embed_dim": config.embed_dim,
            "num_heads": config.num_heads,
            "segment_lengths": config.segment_lengths,
            "dilation_rates": config.dilation_rates,
            "dropout": config.dropout,
            "bias": config.bias,
            "layer_norm": config.layer_norm,
            "device": config.device,
            "dtype": config.dtype,
            "attention_backend": config.attention_backend,
            "comm": config.comm,
            "ring_size": config.ring_size,
            "process_group": process_group,
        }
        args.update(kwargs)
        return cls(**args)

    @property
    def comm(self) -> str:
        return self.attention.comm

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, comm={self.attention.comm!r}, "
            f"attention_backend={self.attention_backend!r}"
        )
