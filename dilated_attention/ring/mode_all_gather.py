"""``comm="all_gather"`` (LongNet's): gather each spanning segment's sparsified keys at once.

Forward: one ``all_to_all_single`` with per-peer sizes, which is an all-gather of each spanning
segment's sparsified keys and values among the ranks that share it (when causal, only towards
ranks on the right). Every piece then runs once over its keys, concatenated in position order.
The gathered bytes are kept for the backward.

Backward: every piece runs its backward over the same keys; the gradients of keys that other
ranks own go back in the reverse all-to-all (a reduce-scatter), and each rank adds what it
receives to its own key/value gradients.
"""

from __future__ import annotations

import torch

from .geometry import Piece, block_key
from .node import SpanJob

__all__ = ["backward", "forward"]


def _keys(
    job: SpanJob, k: torch.Tensor, v: torch.Tensor, received: dict, piece: Piece
) -> tuple[torch.Tensor, torch.Tensor]:
    """The piece's keys and values, its own and received ones, concatenated in position order."""
    me = job.plan.rank
    kvs = [
        job.local_block(k, v, piece, blk) if blk.src == me else received[block_key(piece, blk)]
        for blk in piece.blocks
    ]
    if len(kvs) == 1:
        return kvs[0]
    return torch.cat([kb for kb, _ in kvs], dim=1), torch.cat([vb for _, vb in kvs], dim=1)


def _unpack_all(
    job: SpanJob, recv: torch.Tensor, dtype: torch.dtype, device: torch.device, B: int, D: int
) -> dict:
    received, pos = {}, 0
    for src in range(job.plan.layout.P):
        items = job.plan.recv_items.get(src, [])
        n = job.nbytes(items, B, D, dtype)
        if n:
            received.update(job.unpack(recv[pos : pos + n], items, dtype, device, B, D))
        pos += n
    return received


def forward(job: SpanJob, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """Runs every piece (into ``job``'s accumulators); returns the gathered bytes, kept for the backward."""
    plan, B, D = job.plan, q.shape[0], q.shape[3]
    sends = [
        job.pack(k, v, plan.send_items.get(dst, [])).view(-1).view(torch.uint8)
        for dst in range(plan.layout.P)
    ]
    recv_splits = [job.nbytes(plan.recv_items.get(src, []), B, D, k.dtype) for src in range(plan.layout.P)]
    if plan.steps:  # the same on every rank: every rank joins the collective, or none does
        recv = job.comm.all_to_all(torch.cat(sends), [int(t.numel()) for t in sends], recv_splits, "forward")
        recv = recv.to(q.device)
    else:
        recv = torch.empty(0, dtype=torch.uint8, device=q.device)
    received = _unpack_all(job, recv, k.dtype, q.device, B, D)
    for piece in plan.pieces:
        job.attend(q, piece, piece.blocks, *_keys(job, k, v, received, piece))
    return [recv]


def backward(
    job: SpanJob, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, saved: list[torch.Tensor]
) -> None:
    """Adds to ``job.grads`` this rank's gradients, including those other ranks computed for its keys."""
    plan, me, B, D = job.plan, job.plan.rank, q.shape[0], q.shape[3]
    received = _unpack_all(job, saved[0], k.dtype, q.device, B, D)
    back: dict[tuple, list[torch.Tensor]] = {}  # block_key -> [dk, dv], summed over the pieces
    for piece in plan.pieces:
        gk, gv = job.attend_backward(q, piece, piece.blocks, *_keys(job, k, v, received, piece))
        pos = 0
        for blk in piece.blocks:
            gkb, gvb = gk[:, pos : pos + blk.n], gv[:, pos : pos + blk.n]
            pos += blk.n
            if blk.src == me:
                job.add_key_grads(piece, blk, gkb, gvb)
            elif (key := block_key(piece, blk)) in back:
                back[key][0] += gkb
                back[key][1] += gvb
            else:
                back[key] = [gkb.clone(), gvb.clone()]
    # the reverse all-to-all: gradients go back to the ranks that own the keys
    cdt = job.out.dtype
    P = plan.layout.P
    empty = torch.empty(0, dtype=torch.uint8, device=q.device)
    parts = []
    for p in range(P):
        grads = [g.reshape(-1) for pc, blk in plan.recv_items.get(p, []) for g in back[block_key(pc, blk)]]
        parts.append(torch.cat(grads).view(torch.uint8) if grads else empty)
    recv_splits = [job.nbytes(plan.send_items.get(p, []), B, D, cdt) for p in range(P)]
    if not plan.steps:  # nothing moves anywhere (the same on every rank)
        return
    recv = job.comm.all_to_all(torch.cat(parts), [int(t.numel()) for t in parts], recv_splits, "backward")
    returned, pos = {}, 0
    for p in range(P):
        if recv_splits[p]:
            returned[p] = recv[pos : pos + recv_splits[p]]
        pos += recv_splits[p]
    job.add_returned(returned, q.device, B, D)
