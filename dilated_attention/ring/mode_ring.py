"""``comm="ring"``: pass the sparsified keys around point to point, merging partial results.

At step ``d`` a rank exchanges with the ranks ``d`` places left and right of it (the step list
``plan.steps`` is the same on every rank). No rank holds a whole segment's keys at once.

Forward: post the transfer of the first step; attend to this rank's own blocks; then for each
step, wait for its keys, post the next step's transfer (so that it runs while this step is
computed) and attend to the received blocks, merging every partial result into the output by its
log-sum-exp.

Backward: the same passes of keys, and after each step the key/value gradients of the blocks
received in it go back to their owners. Every rank posts its transfers in one global order,

    kv(steps[0]), kv(steps[1]), grad(steps[0]), kv(steps[2]), grad(steps[1]), ..., grad(steps[-1])

(:func:`posting_order`), skipping the batches in which it has nothing to send or receive. A
library that matches point-to-point messages in the order they were posted (NCCL ignores tags)
therefore pairs every message with its counterpart, and since each transfer waits only for
transfers posted before it everywhere, no rank can wait on a peer that waits on it, even where
some ranks hold none of a head's positions (``r > N/P``) and exchange at fewer distances than
others. ``tests/ring/test_ring_pieces.py`` checks this order on a model of in-order matching.
"""

from __future__ import annotations

import torch

from .geometry import Block, Piece, Plan
from .node import SpanJob
from .transport import Pending, as_bytes

__all__ = ["backward", "batch_items", "forward", "posting_order"]

Items = list[tuple[Piece, Block]]


def posting_order(steps: list[int], phase: str) -> list[tuple[str, int]]:
    """The order in which every rank posts its batches of transfers: ``("kv", d)`` or ``("grad", d)``."""
    if phase == "forward":
        return [("kv", d) for d in steps]
    order = [("kv", steps[0])] if steps else []
    for n, d in enumerate(steps):
        if n + 1 < len(steps):
            order.append(("kv", steps[n + 1]))
        order.append(("grad", d))
    return order


def batch_items(plan: Plan, kind: str, d: int) -> tuple[dict[int, Items], dict[int, Items]]:
    """What this rank sends and receives in batch ``(kind, d)``: ``({peer: items}, {peer: items})``.
    Keys go from their owner to the reader; gradients the other way."""
    me = plan.rank
    to_readers = {p: items for p, items in plan.send_items.items() if abs(p - me) == d}
    from_owners = {p: items for p, items in plan.recv_items.items() if abs(p - me) == d}
    return (to_readers, from_owners) if kind == "kv" else (from_owners, to_readers)


def _post_kv(job: SpanJob, k: torch.Tensor, v: torch.Tensor, d: int, phase: str) -> Pending:
    B, D = k.shape[0], k.shape[3]
    sends, recvs = batch_items(job.plan, "kv", d)
    data = {p: as_bytes(job.pack(k, v, items)) for p, items in sends.items()}
    sizes = {p: job.nbytes(items, B, D, k.dtype) for p, items in recvs.items()}
    return job.comm.post(data, sizes, tag=2 * d, phase=phase)


def _receive_kv(job: SpanJob, pending: Pending, k: torch.Tensor) -> dict:
    B, D = k.shape[0], k.shape[3]
    blocks = {}
    for src, buf in pending.wait().items():
        blocks.update(job.unpack(buf, job.plan.recv_items[src], k.dtype, k.device, B, D))
    return blocks


def _own_blocks(job: SpanJob, k: torch.Tensor, v: torch.Tensor):
    for piece in job.plan.pieces:
        for blk in piece.blocks:
            if blk.src == job.plan.rank:
                yield piece, blk, job.local_block(k, v, piece, blk)


def forward(job: SpanJob, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """Runs every piece (into ``job``'s accumulators); keeps nothing for the backward but q, k, v."""
    steps = job.plan.steps
    pending = _post_kv(job, k, v, steps[0], "forward") if steps else None
    for piece, blk, (kb, vb) in _own_blocks(job, k, v):
        job.attend(q, piece, (blk,), kb, vb)
    for n in range(len(steps)):
        assert pending is not None  # posted for every step
        blocks = _receive_kv(job, pending, k)
        pending = _post_kv(job, k, v, steps[n + 1], "forward") if n + 1 < len(steps) else None
        for key, (kb, vb) in blocks.items():
            for piece in job.plan.readers[key]:
                job.attend(q, piece, (key[-1],), kb, vb)
    return []


def backward(
    job: SpanJob, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, saved: list[torch.Tensor]
) -> None:
    """Adds to ``job.grads`` this rank's gradients, including those other ranks computed for its keys."""
    steps, B, D = job.plan.steps, q.shape[0], q.shape[3]
    cdt = job.out.dtype
    pending = _post_kv(job, k, v, steps[0], "backward") if steps else None
    for piece, blk, (kb, vb) in _own_blocks(job, k, v):
        job.add_key_grads(piece, blk, *job.attend_backward(q, piece, (blk,), kb, vb))
    grad_pending: Pending | None = None
    for n, d in enumerate(steps):
        assert pending is not None  # posted for every step
        blocks = _receive_kv(job, pending, k)
        pending = _post_kv(job, k, v, steps[n + 1], "backward") if n + 1 < len(steps) else None
        back: dict[int, list[torch.Tensor]] = {}  # per owner, in message order
        for key, (kb, vb) in blocks.items():
            blk = key[-1]
            gk: torch.Tensor | None = None
            gv: torch.Tensor | None = None
            for piece in job.plan.readers[key]:  # summed over the pieces that read the block
                g = job.attend_backward(q, piece, (blk,), kb, vb)
                gk, gv = (g[0], g[1]) if gk is None or gv is None else (gk + g[0], gv + g[1])
            assert gk is not None and gv is not None  # a block is received only when a piece reads it
            back.setdefault(blk.src, []).extend([gk.reshape(-1), gv.reshape(-1)])
        sends, recvs = batch_items(job.plan, "grad", d)
        data = {p: as_bytes(torch.cat(back[p])) for p in sends}
        sizes = {p: job.nbytes(items, B, D, cdt) for p, items in recvs.items()}
        posted = job.comm.post(data, sizes, tag=2 * d + 1, phase="backward")
        if grad_pending is not None:
            job.add_returned(grad_pending.wait(), q.device, B, D)
        grad_pending = posted
    if grad_pending is not None:
        job.add_returned(grad_pending.wait(), q.device, B, D)
