"""The spanning pieces of one forward call, and the local runs on the fused op, as one autograd node.

:class:`SpanAttention` returns ``(out, lse)`` (B, l, Hq, D), (B, Hq, l) of this rank's pieces,
merged by log-sum-exp in the accumulation dtype; its backward returns the gradients of this rank's
q, k and v, with the key/value gradients other ranks computed for its keys. The exchange is in
:mod:`.mode_all_gather` and :mod:`.mode_ring`; :class:`SpanJob` holds what both need (plan,
transport, piece attention, the cutting of tensors into pieces, blocks and messages). The local runs
on the fused op (``native``, ``SpanJob.local_runs``) join the pieces in one running merge
(:mod:`dilated_attention.merge`, float64 for float32 inputs), normalised once; the backward hands the
op and every piece the *merged* ``out`` and ``lse`` (exact, docs/SPEC.md section 3), so the merge
needs no backward and no full-size copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import op
from .._validation import accumulation_dtype
from ..merge import State, across, beside, finish_state, merge_dtype, merge_state_, start_state
from ..op.autograd import no_double_backward
from .consistency import CallCheck
from .geometry import Block, Piece, Plan, block_key
from .pieces import PieceAttention
from .transport import Comm, from_bytes

__all__ = ["SpanAttention", "SpanJob"]

Items = list[tuple[Piece, Block]]
Run = tuple[int, int, list[int], list[int]]  # (lo, hi, segment lengths, rates): a plan's local run


class SpanJob:
    """One forward call's pieces: plan, transport, piece attention, scale, mode, and the call's
    fingerprint, which the backward compares across the ranks before it exchanges."""

    def __init__(
        self,
        plan: Plan,
        comm: Comm,
        pieces: PieceAttention,
        mode: str,
        scale: float,
        is_causal: bool,
        local_runs: Sequence[Run] = (),
        check: CallCheck | None = None,
    ) -> None:
        self.plan, self.comm, self.pieces, self.mode = plan, comm, pieces, mode
        self.check = check  # compared again before the backward's exchange (check_consistency=True)
        self.scale, self.is_causal = scale, is_causal
        self.local_runs = list(local_runs)  # the local runs computed in this node, on the fused op
        self.aux: dict[tuple, Any] = {}  # per kernel call, what its backward needs
        self.acc: dict[Piece, State] = {}  # per piece: its running merge
        self.state: State | None = None  # the rank's running merge (local_forward)
        self.piece_rows: dict[Piece, dict[str, torch.Tensor]] = {}  # per piece: its rows of q, dout, ...
        self.grads: dict[str, torch.Tensor] = {}  # the backward's accumulators
        self.upcast = False  # set by the node: parts in float32 for float16/bfloat16, forward and backward

    # -- cutting tensors into pieces and blocks --------------------------------------------------
    def rows(self, t: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The piece's query rows of t (B, l, Hq, D): (B, nq, nh, D)."""
        heads = self.plan.head_sets(piece.r, piece.o, t.device).heads
        return t[:, self.plan.query_slice(piece)].index_select(2, heads)

    def lse_rows(self, t: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The piece's rows of t (B, Hq, l): (B, nh, nq)."""
        heads = self.plan.head_sets(piece.r, piece.o, t.device).heads
        return t[:, :, self.plan.query_slice(piece)].index_select(1, heads)

    def local_block(
        self, k: torch.Tensor, v: torch.Tensor, piece: Piece, blk: Block
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A block of this rank's keys and values: (B, n, nkv, D) each."""
        sl = self.plan.key_slice(piece, blk)
        kvh = self.plan.head_sets(piece.r, piece.o, k.device).kv_heads
        return k[:, sl].index_select(2, kvh), v[:, sl].index_select(2, kvh)

    def pack(self, k: torch.Tensor, v: torch.Tensor, items: Items) -> torch.Tensor:
        """Keys and values of ``items`` from this rank, as one flat tensor in k's dtype."""
        parts = []
        for piece, blk in items:
            kb, vb = self.local_block(k, v, piece, blk)
            parts += [kb.reshape(-1), vb.reshape(-1)]
        return torch.cat(parts) if parts else k.new_empty(0)

    def unpack(
        self, buf: torch.Tensor, items: Items, dtype: torch.dtype, device: torch.device, B: int, D: int
    ) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
        """The inverse of :meth:`pack` on received bytes: {block_key: (keys, values)}."""
        flat = from_bytes(buf, dtype, device)
        out, pos = {}, 0
        for piece, blk in items:
            shape = (B, blk.n, self.plan.num_kv_heads(piece.r, piece.o), D)
            n = self.plan.item_numel(piece, blk, B, D)
            out[block_key(piece, blk)] = (
                flat[pos : pos + n].view(shape),
                flat[pos + n : pos + 2 * n].view(shape),
            )
            pos += 2 * n
        return out

    def nbytes(self, items: Items, B: int, D: int, dtype: torch.dtype) -> int:
        """Bytes of the keys and values of ``items`` in ``dtype``."""
        return sum(2 * self.plan.item_numel(p, b, B, D) for p, b in items) * dtype.itemsize

    def offset(self, piece: Piece, blocks: tuple[Block, ...]) -> int | None:
        """The causal offset of the keys ``blocks`` (concatenated) for the piece's queries."""
        return piece.causal_offset(blocks) if self.is_causal else None

    # -- the forward's accumulation ---------------------------------------------------------------
    def _rows(self, piece: Piece, name: str, t: torch.Tensor) -> torch.Tensor:
        """The piece's rows of ``t`` (q, dout, out; lse, dlse), gathered once per piece."""
        rows = self.piece_rows.setdefault(piece, {})
        if name not in rows:
            rows[name] = self.lse_rows(t, piece) if t.dim() == 3 else self.rows(t, piece)
        return rows[name]

    def _acc_rows(self, piece: Piece, q_rows: torch.Tensor) -> torch.Tensor:
        """The piece's query rows ``q_rows`` in the accumulation dtype, converted once per piece."""
        rows = self.piece_rows[piece]
        if "q_acc" not in rows:
            rows["q_acc"] = q_rows.to(accumulation_dtype(q_rows.dtype))
        return rows["q_acc"]

    def attend(
        self, q: torch.Tensor, piece: Piece, blocks: tuple[Block, ...], kb: torch.Tensor, vb: torch.Tensor
    ) -> None:
        """Attention of the piece's queries over the keys ``blocks``, added to the piece's running
        merge (:mod:`dilated_attention.merge`)."""
        hs = self.plan.head_sets(piece.r, piece.o, q.device)
        q_rows = self._rows(piece, "q", q)
        if self.upcast:  # the piece's out unrounded: merged and read by the backward in float32
            q_rows = self._acc_rows(piece, q_rows)
            kb, vb = kb.to(q_rows.dtype), vb.to(q_rows.dtype)
        o, lse, aux = self.pieces.forward(q_rows, kb, vb, hs, self.offset(piece, blocks), self.scale)
        self.aux[(piece, blocks)] = aux
        lse = beside(lse)
        state = self.acc.get(piece)
        if state is None:
            self.acc[piece] = start_state(o, lse, merge_dtype(q.dtype, q.device))
        else:
            merge_state_(*state, o, lse)

    def finish_forward(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank's ``out`` (B, l, Hq, D) and ``lse`` (B, Hq, l), in the accumulation dtype: every
        piece added to the running merge of the local runs (:meth:`local_forward`), normalised."""
        assert self.state is not None  # set by local_forward wherever pieces or runs are merged
        (acc, m, den), self.state = self.state, None
        for piece, state in self.acc.items():
            heads = self.plan.head_sets(piece.r, piece.o, q.device).heads
            rows = [t[:, self.plan.query_slice(piece)] for t in (acc, m, den)]
            acc_p, m_p, den_p = (t.index_select(2, heads) for t in rows)
            merge_state_(acc_p, m_p, den_p, *finish_state(*state))
            for t, new in zip(rows, (acc_p, m_p, den_p), strict=True):
                t.index_copy_(2, heads, new)
        self.acc, self.piece_rows = {}, {}
        out, lse = finish_state(acc, m, den)
        cdt = accumulation_dtype(q.dtype)
        return out.to(cdt), across(lse).to(cdt).contiguous()

    # -- the local runs on the fused op ------------------------------------------------------------
    def local_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """out (B, n, Hq, D) and lse (B, Hq, n) of the local runs in the accumulation dtype where
        they are the rank's result: one run over all ``n`` rows and no piece (the op's result
        itself, with no copy in float32 and float64). Otherwise None: the runs are added to the
        rank's running merge (``state``, in :func:`~dilated_attention.merge.merge_dtype` of q), which
        :meth:`finish_forward` completes with the pieces; a row that nothing covers has out 0 and
        lse -inf."""
        B, n, Hq, D = q.shape
        cdt = accumulation_dtype(q.dtype)
        wt = merge_dtype(q.dtype, q.device)
        wdt = self.local_dtype(q.dtype)
        if wdt != q.dtype:  # the runs' outs unrounded: merged and read by the backward in float32
            q, k, v = q.to(wdt), k.to(wdt), v.to(wdt)
        runs = self.local_runs
        if len(self.plan.pieces) == 0 and len(runs) == 1 and runs[0][:2] == (0, n):
            _, _, segs, rates = runs[0]
            o, lse = op.native_forward(q, k, v, segs, rates, self.is_causal, self.scale)
            return o.to(cdt), lse.to(cdt)
        acc = q.new_zeros((B, n, Hq, D), dtype=wt)
        m = q.new_full((B, n, Hq, 1), -math.inf, dtype=wt)
        den = q.new_zeros((B, n, Hq, 1), dtype=wt)
        for lo, hi, segs, rates in runs:
            o, lse = op.native_forward(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], segs, rates, self.is_causal, self.scale
            )
            merge_state_(acc[:, lo:hi], m[:, lo:hi], den[:, lo:hi], o, beside(lse))
        self.state = (acc, m, den)
        return None

    def local_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the local runs compute in, forward and backward, for inputs in ``dtype``.

        float16/bfloat16: when a row's out or a gradient collects more than one part (several runs,
        pieces, or gradients returned by other ranks), every part is computed in the accumulation
        dtype and the result is rounded once, as the one-process op rounds once. The forward then
        keeps the runs' outs unrounded too: the backward reads the merged out in float32 for its
        ``rowsum(dout * out)``, where out rounded to 16 bits would leave its rounding, times
        ``|dout|`` summed over D, in every score's gradient (the one-process op's backward reads
        its float32 out for the same reason). Otherwise the inputs' dtype: one run, nothing merged,
        whose backward recomputes the op's float32 out itself."""
        if self.upcast and (len(self.local_runs) > 1 or self.plan.any_span):
            return accumulation_dtype(dtype)
        return dtype

    def local_backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """dq, dk, dv of the local runs, in the accumulation dtype, given the rank's merged ``out``
        and ``lse`` and their gradients (the op's backward is exact for merged rows)."""
        cdt, n = out.dtype, q.shape[1]
        wdt = self.local_dtype(q.dtype)
        out_q, dout_q = out.to(wdt), dout.to(wdt)
        q, k, v = q.to(wdt), k.to(wdt), v.to(wdt)
        grads: dict[str, torch.Tensor] = {}
        for lo, hi, segs, rates in self.local_runs:
            g = torch.ops.dilated_attention.bwd(
                dout_q[:, lo:hi],
                q[:, lo:hi],
                k[:, lo:hi],
                v[:, lo:hi],
                out_q[:, lo:hi],
                lse[:, :, lo:hi],
                None if dlse is None else dlse[:, :, lo:hi],
                segs,
                rates,
                self.is_causal,
                self.scale,
            )
            if not grads and (lo, hi) == (0, n):
                grads = {name: x.to(cdt) for name, x in zip(("dq", "dk", "dv"), g, strict=True)}
                continue
            if not grads:
                grads = self.zero_grads(q, k, cdt)
            for name, x in zip(("dq", "dk", "dv"), g, strict=True):
                grads[name][:, lo:hi] += x
        return grads or self.zero_grads(q, k, cdt)

    @staticmethod
    def zero_grads(q: torch.Tensor, k: torch.Tensor, cdt: torch.dtype) -> dict[str, torch.Tensor]:
        return {
            "dq": q.new_zeros(q.shape, dtype=cdt),
            "dk": k.new_zeros(k.shape, dtype=cdt),
            "dv": k.new_zeros(k.shape, dtype=cdt),
        }

    # -- the backward's accumulation --------------------------------------------------------------
    def start_backward(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        grads: dict[str, torch.Tensor],
    ) -> None:
        """The pieces' backward reads the rank's (merged) ``out``, ``lse`` and their gradients, and
        adds into ``grads`` (dq, dk, dv in the accumulation dtype); :meth:`end_backward` lets go of
        them.

        Detached: ``out`` and ``lse`` as the node's backward unpacks them have the node itself as
        ``grad_fn``, and the node holds this job (``ctx.job``). Kept as they are, they would close a
        loop through autograd's C++ graph, which Python's collector cannot follow, and the node, its
        saved tensors, this job, its transport and the process group (with its communication
        threads, even after ``destroy_process_group``) would never be freed."""
        self.out, self.lse, self.dout = out.detach(), lse.detach(), dout.detach()
        self.dlse = (
            torch.zeros_like(self.lse)
            if dlse is None
            else torch.where(torch.isfinite(self.lse), dlse.detach(), 0)
        )
        self.dq_piece: dict[Piece, torch.Tensor] = {}
        self.grads = grads

    def attend_backward(
        self, q: torch.Tensor, piece: Piece, blocks: tuple[Block, ...], kb: torch.Tensor, vb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds the piece's query gradients; returns the key/value gradients of ``blocks``
        (B, n, nkv, D), in the accumulation dtype."""
        hs = self.plan.head_sets(piece.r, piece.o, q.device)
        cdt = self.out.dtype
        q_rows = self._rows(piece, "q", q)
        if self.upcast:  # every part in the accumulation dtype, rounded once when summed
            q_rows = self._acc_rows(piece, q_rows)
            kb, vb = kb.to(cdt), vb.to(cdt)
        gq, gk, gv = self.pieces.backward(
            self._rows(piece, "dout", self.dout),
            self._rows(piece, "dlse", self.dlse),
            q_rows,
            kb,
            vb,
            hs,
            self._rows(piece, "out", self.out),
            self._rows(piece, "lse", self.lse),
            self.offset(piece, blocks),
            self.scale,
            self.aux[(piece, blocks)],
        )
        dq = self.dq_piece.get(piece)
        self.dq_piece[piece] = gq.to(cdt) if dq is None else dq.add_(gq)
        return gk.to(cdt), gv.to(cdt)

    def finish_backward(self) -> None:
        """Add every piece's query gradients to dq."""
        dq = self.grads["dq"]
        for piece, g in self.dq_piece.items():
            heads = self.plan.head_sets(piece.r, piece.o, g.device).heads
            dq[:, self.plan.query_slice(piece)].index_add_(2, heads, g)

    def end_backward(self) -> None:
        """Let go of what the backward read and accumulated (also when it raised): a job lives as
        long as its autograd node (with ``retain_graph=True``, or while the caller holds the output),
        and no reference to the gradients is kept: autograd hands a gradient that nothing else
        holds to ``.grad`` as it is, and copies one that something still references."""
        self.dq_piece, self.piece_rows, self.grads = {}, {}, {}
        for name in ("out", "lse", "dout", "dlse"):  # set again by the next start_backward
            self.__dict__.pop(name, None)

    def add_key_grads(self, piece: Piece, blk: Block, gk: torch.Tensor, gv: torch.Tensor) -> None:
        """Add the gradients of one block of this rank's keys and values."""
        sl = self.plan.key_slice(piece, blk)
        kvh = self.plan.head_sets(piece.r, piece.o, gk.device).kv_heads
        self.grads["dk"][:, sl].index_add_(2, kvh, gk)
        self.grads["dv"][:, sl].index_add_(2, kvh, gv)

    def add_returned(self, bufs: dict[int, torch.Tensor], device: torch.device, B: int, D: int) -> None:
        """Add the key/value gradients other ranks computed for this rank's keys."""
        cdt = self.out.dtype
        for dst, buf in bufs.items():
            items = self.plan.send_items[dst]
            grads = self.unpack(buf, items, cdt, device, B, D)
            for piece, blk in items:
                self.add_key_grads(piece, blk, *grads[block_key(piece, blk)])


# What a second backward through the spanning pieces (a fused backward on every backend) is told.
SPAN_ADVICE = (
    "the pieces of a segment that spans ranks have a fused backward on every attention_backend; "
    "differentiate twice on one process with DilatedAttention(backend='manual')"
)


class SpanAttention(torch.autograd.Function):
    """(out, lse) of the spanning pieces and of ``job.local_runs``, merged; the backward returns
    key/value gradients to their owners."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, job: SpanJob, mode: Any):
        # float16/bfloat16: the parts are computed, merged and kept for the backward in float32
        # (local_dtype, attend), rounded once by the caller.
        job.upcast = q.dtype in (torch.float16, torch.bfloat16)
        local = job.local_forward(q, k, v)
        # Every rank enters the exchange whenever any two ranks exchange (plan.steps is the same
        # list on every rank): comm="all_gather" is a collective that every rank must join, even
        # one with no spanning piece.
        saved = mode.forward(job, q, k, v) if job.plan.joins_exchange else []
        out, lse = local if local is not None else job.finish_forward(q)
        ctx.job, ctx.mode = job, mode
        ctx.set_materialize_grads(False)  # an unused lse needs no zero-filled gradient
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        job = ctx.job
        dout_in = dout
        with torch.no_grad():  # a fused backward: first order only (below)
            if dout is None:
                dout = torch.zeros_like(out)
            g = job.local_backward(q, k, v, out, lse, dout, dlse)
            if job.plan.joins_exchange:
                # The ranks are in the backward of the same call, whenever anything moves (steps is
                # the same on every rank; without steps a rank may have no backward to run).
                if job.check is not None and job.plan.steps:
                    job.check.backward(job.comm)
                job.start_backward(out, lse, dout, dlse, g)
                try:
                    ctx.mode.backward(job, q, k, v, saved)
                    job.finish_backward()
                finally:
                    job.end_backward()
            grads = (g["dq"].to(q.dtype), g["dk"].to(k.dtype), g["dv"].to(v.dtype))
        # Under create_graph=True, a second backward raises the package's error, not PyTorch's.
        dq, dk, dv = no_double_backward(
            f"ring ({job.pieces.name} pieces)", grads, (dout_in, dlse, q, k, v), advice=SPAN_ADVICE
        )
        return dq, dk, dv, None, None
