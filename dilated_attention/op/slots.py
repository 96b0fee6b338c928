"""The slot layout of the bounded cache and its plain PyTorch attention (SPEC section 8).

In branch ``(w, r)`` a query at position ``p`` reads only keys of its own segment ``p // w`` at
the phase ``(p % w) % r`` of its head, and key/value head ``j`` serves the query heads
``j*G .. j*G + G - 1`` (``G = Hq // Hkv``), whose phases ``(j*G + g) % r`` are ``min(G, r)``
residues. So per branch and kv head the cache keeps ``min(G, r)`` rows (one per phase that a
reading head has, row ``g % r`` for query head ``j*G + g``) of ``ceil(w / r)`` slots: the key at
position ``x`` of the current segment, with ``t = x % w`` and row ``((t % r) - j*G) mod r`` when
that is below ``min(G, r)``, sits at slot ``t // r``. A query at ``t`` reads slots ``0 .. t // r``
of one row: contiguous keys. A new segment simply overwrites the slots from 0 on, since no query
reads beyond its own ``t // r``.

All rows of all branches of a layer share one (B, Hkv, T, D) tensor, ``T = sum_i min(G, r_i) *
ceil(min(w_i, max_seqlen) / r_i)``, fixed by the branches and heads (and ``max_seqlen`` when it is
shorter than a segment), never by the generated length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._validation import accumulation_dtype

# Scores held at once by the plain attention of several new tokens (elements of (B, m, Hq, keys)).
_SCORE_BUDGET = 1 << 24


@dataclass(frozen=True)
class BranchSlots:
    """Where branch ``(w, r)`` lives in a layer's slot axis: ``rows`` rows of ``length`` slots
    from ``offset`` on (row ``k`` at ``offset + k * length``)."""

    w: int
    r: int
    rows: int
    length: int
    offset: int


def branch_slots(
    segment_lengths: Sequence[int], dilation_rates: Sequence[int], group: int, max_seqlen: int | None
) -> list[BranchSlots]:
    """The layout of every branch, for ``group = Hq // Hkv`` query heads per kv head."""
    out, offset = [], 0
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        span = w if max_seqlen is None else min(w, max_seqlen)
        length = -(-span // r)
        rows = min(group, r)
        out.append(BranchSlots(w, r, rows, length, offset))
        offset += rows * length
    return out


def write_slots(
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    end: torch.Tensor,
    layout: Sequence[BranchSlots],
    group: int,
) -> None:
    """Write the new keys ``k``, ``v`` (B, m, Hkv, D) at positions ``pos`` (B, m; negative: padding,
    not written) into the slots of every branch, for those in the segment of position ``end - 1``
    (``end`` (B, 1): the length after the call): earlier ones are never read again."""
    Hkv = kbuf.shape[1]
    j = torch.arange(Hkv, device=pos.device)
    for br in layout:
        t = pos.remainder(br.w)
        keep = (pos >= 0) & (
            pos.div(br.w, rounding_mode="floor") == (end - 1).div(br.w, rounding_mode="floor")
        )
        row = (t.remainder(br.r)[..., None] - j * group).remainder(br.r)  # (B, m, Hkv)
        keep = keep[..., None] & (row < br.rows)
        b, c, h = keep.nonzero(as_tuple=True)
        slot = br.offset + row[b, c, h] * br.length + t[b, c].div(br.r, rounding_mode="floor")
        kbuf[b, h, slot] = k[b, c, h]
        vbuf[b, h, slot] = v[b, c, h]


def attend_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    lengths: torch.Tensor,
    pos: torch.Tensor,
    layout: Sequence[BranchSlots],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal dilated attention of new tokens, in plain PyTorch, before they are written.

    ``q`` (B, m, Hq, D), ``k``, ``v`` (B, m, Hkv, D) at positions ``pos`` (B, m) (negative:
    padding, ``out = 0``, ``lse = -inf``), after ``lengths`` (B,) positions held in the slots
    ``kbuf``, ``vbuf`` (B, Hkv, T, D). Reads the slots (the keys before the call) and the new keys
    with their multiplicity over the branches; one softmax over both. Returns out (B, m, Hq, D) in
    q's dtype and lse (B, Hq, m). The queries go in chunks whose scores fit ``_SCORE_BUDGET``.
    """
    B, m, Hq, D = q.shape
    Hkv, T = kbuf.shape[1], kbuf.shape[2]
    G = Hq // Hkv
    ct = accumulation_dtype(q.dtype)
    chunk = max(1, _SCORE_BUDGET // max(1, B * Hq * (T + m)))
    kold, knew = kbuf.to(ct), k.to(ct)
    vnew = v.to(ct).masked_fill((pos < 0)[..., None, None], 0)  # padding tokens may hold anything
    outs, lses = [], []
    for c0 in range(0, m, chunk):
        qc = q[:, c0 : c0 + chunk].to(ct)
        mc = qc.shape[1]
        old_mask, mult = _reads(pos[:, c0 : c0 + mc], pos, lengths, layout, Hq, Hkv, ct)
        qc = qc.view(B, mc, Hkv, G, D)
        s_old = torch.einsum("bcjgd,bjtd->bcjgt", qc, kold) * scale
        s_old = s_old.masked_fill(~old_mask, float("-inf")).reshape(B, mc, Hq, -1)
        s_new = torch.einsum("bcjgd,bkjd->bcjgk", qc, knew).reshape(B, mc, Hq, -1) * scale
        s_new = (s_new + mult.clamp(min=1).log()).masked_fill(mult == 0, float("-inf"))
        s = torch.cat([s_old, s_new], dim=-1)
        lse = torch.logsumexp(s, dim=-1)  # (B, mc, Hq)
        # the weights normalised by their own softmax (their largest score subtracted exactly), not
        # as exp(s - lse): at scores of ~1e9 and more lse's rounding would reach every weight; rows
        # whose lse is not finite as exp(s) (no key: 0; an infinite or NaN score carried through)
        w_ = torch.where(torch.isfinite(lse)[..., None], torch.softmax(s, dim=-1), torch.exp(s))
        # Slots never read may hold stale or unwritten values: their weight is exactly 0, and their
        # values are zeroed so that 0 * NaN cannot appear.
        vold = vbuf.to(ct).masked_fill(~old_mask.any(dim=(1, 3))[..., None], 0)  # (B, Hkv, T, D)
        w_old = w_[..., :T].reshape(B, mc, Hkv, G, T)
        w_new = w_[..., T:].reshape(B, mc, Hkv, G, -1)
        out = torch.einsum("bcjgt,bjtd->bcjgd", w_old, vold) + torch.einsum("bcjgk,bkjd->bcjgd", w_new, vnew)
        outs.append(out.reshape(B, mc, Hq, D))
        lses.append(lse.transpose(1, 2))
    return torch.cat(outs, dim=1).to(q.dtype), torch.cat(lses, dim=-1)


def _reads(
    p: torch.Tensor,
    pos: torch.Tensor,
    lengths: torch.Tensor,
    layout: Sequence[BranchSlots],
    Hq: int,
    Hkv: int,
    ct: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the queries at positions ``p`` (B, mc) read (:func:`attend_slots`): the slots, a bool
    mask (B, mc, Hkv, G, T), and how many times each new key at ``pos`` (B, m), summed over the
    branches, (B, mc, Hq, m) in ``ct``."""
    B, mc = p.shape
    G = Hq // Hkv
    dev = p.device
    heads = torch.arange(Hq, device=dev)
    g = torch.arange(G, device=dev)
    j = torch.arange(Hkv, device=dev)
    L = lengths[:, None]  # (B, 1)
    old_masks = []
    mult = torch.zeros(B, mc, Hq, pos.shape[1], dtype=ct, device=dev)
    for br in layout:
        w, r = br.w, br.r
        t = p.remainder(w)
        covers = (p[..., None] >= 0) & (t.remainder(r)[..., None] == heads.remainder(r))  # (B, mc, Hq)
        # The slots: position of (b, j, row, u), read by (p, j*G + g) when row == g % r.
        rows = torch.arange(br.rows, device=dev)
        u = torch.arange(br.length, device=dev)
        start = L - L.remainder(w)  # the slots' segment start, (B, 1)
        phase = (j[:, None] * G + rows).remainder(r)  # (Hkv, rows)
        x = start[:, :, None, None] + phase[None, :, :, None] + u * r  # (B, Hkv, rows, len)
        written = x < L[:, :, None, None]
        same = p.div(w, rounding_mode="floor") == L.div(w, rounding_mode="floor")  # (B, mc)
        reads = (covers & same[..., None]).view(B, mc, Hkv, G)[..., None] & (g.remainder(r)[:, None] == rows)
        mask = reads[..., None] & written[:, None, :, None]  # (B, mc, Hkv, G, rows, len)
        old_masks.append(mask.reshape(B, mc, Hkv, G, br.rows * br.length))
        # The new keys: same segment, same phase as the head, not after the query.
        pk = pos  # (B, m)
        tk = pk.remainder(w)
        kcov = (pk[..., None] >= 0) & (tk.remainder(r)[..., None] == heads.remainder(r))  # (B, m, Hq)
        link = (p.div(w, rounding_mode="floor")[..., None] == pk.div(w, rounding_mode="floor")[:, None]) & (
            pk[:, None] <= p[..., None]
        )  # (B, mc, m)
        mult += (covers[..., None] & kcov.transpose(1, 2)[:, None] & link[:, :, None]).to(ct)
    return torch.cat(old_masks, dim=-1), mult  # (B, mc, Hkv, G, T)
