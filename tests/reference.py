"""The plainest PyTorch statement of dilated attention (SPEC sections 2-3): a dense N x N
multiplicity mask per head, then a softmax weighted by it. Quadratic in N: for tests only.

Run it in float64 for the reference; run it in a lower dtype for "PyTorch's own error" in the
tolerance rule of SPEC section 4.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch


def multiplicity(
    N: int, Hq: int, segment_lengths: Sequence[int], dilation_rates: Sequence[int], is_causal: bool
) -> torch.Tensor:
    """(Hq, N, N) count of the branches through which query p of head h reads key x."""
    pos = torch.arange(N)
    mult = torch.zeros(Hq, N, N, dtype=torch.int64)
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        seg, idx = pos // w, pos % w
        same_segment = seg[:, None] == seg[None, :]  # (N, N)
        for h in range(Hq):
            covered = (idx % r) == (h % r)  # (N,)
            m = same_segment & covered[:, None] & covered[None, :]
            if is_causal:
                m &= pos[None, :] <= pos[:, None]
            mult[h] += m.long()
    return mult


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool = False,
    softmax_scale: float | None = None,
    dtype: torch.dtype | None = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out, lse)``: out (B, N, Hq, D), lse (B, Hq, N), computed in ``dtype``
    (float64 by default). Differentiable by autograd. With ``keep`` (bool (B, Hq, N, N), the
    kernels' mask: ``dilated_attention.op.dropout_mask``), attention dropout: the normalised
    weight of query p and key x of head h of batch entry b is multiplied by
    ``keep[b, h, p, x] / (1 - dropout_p)``; lse is that of the weights before dropout."""
    mult = multiplicity(q.shape[1], q.shape[2], segment_lengths, dilation_rates, is_causal)
    return _weighted_attention(q, k, v, mult.to(q.device), softmax_scale, dtype, keep, dropout_p)


def _weighted_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mult: torch.Tensor,
    softmax_scale: float | None,
    dtype: torch.dtype | None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of q (B, nq, Hq, D) over k, v (B, nk, Hkv, D), key ``x`` counted ``mult[h, p, x]``
    times by query ``p`` of head ``h`` (``mult`` (Hq, nq, nk) or (nq, nk); 0: not seen), in
    ``dtype`` (float64 by default). A query that sees no key gets out = 0 and lse = -inf; a score it
    does not see never enters its sums, whatever its value. ``keep`` (B, Hq, nq, nk) and
    ``dropout_p``: attention dropout as in :func:`reference_attention`."""
    dtype = dtype or torch.float64
    D, G = q.shape[3], q.shape[2] // k.shape[2]
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    kd = kd.repeat_interleave(G, dim=2)  # (B, nk, Hq, D)
    vd = vd.repeat_interleave(G, dim=2)
    scores = torch.einsum("bphd,bxhd->bhpx", qd, kd) * scale  # (B, Hq, nq, nk)
    mult = mult.to(dtype)
    seen = mult > 0
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=q.device)
    row_max = torch.where(seen, scores, neg_inf).amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = mult * torch.exp(torch.where(seen, scores, row_max) - row_max)
    denom = weights.sum(dim=-1, keepdim=True)  # (B, Hq, nq, 1)
    covered = (denom > 0) | denom.isnan()  # a NaN score (a NaN query) makes its row NaN, lse too
    safe = torch.where(covered, denom, torch.ones_like(denom))
    probs = weights / safe
    if keep is not None:
        probs = probs * keep.to(device=q.device, dtype=dtype) / (1 - dropout_p)
    out = torch.einsum("bhpx,bxhd->bphd", probs, vd)  # (B, nq, Hq, D)
    lse = torch.where(covered, torch.log(safe) + row_max, neg_inf).squeeze(-1)  # (B, Hq, nq)
    return out, lse


def reference_piece(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal_offset: int | None,
    softmax_scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of q (B, nq, Hq, D) over k, v (B, nk, Hkv, D), key ``j`` visible to query
    ``i`` when ``causal_offset`` is None or ``j <= i + causal_offset`` (the pieces of sequence
    parallelism). Returns ``(out, lse)`` as :func:`reference_attention`; a query that sees no key
    gets out = 0 and lse = -inf. Differentiable by autograd."""
    nq, nk = q.shape[1], k.shape[1]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal_offset is not None:
        visible = (
            torch.arange(nk, device=q.device)[None, :]
            <= torch.arange(nq, device=q.device)[:, None] + causal_offset
        )
    return _weighted_attention(q, k, v, visible, softmax_scale, dtype)


def reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Sequence[int],
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool = False,
    softmax_scale: float | None = None,
    dtype: torch.dtype | None = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences (SPEC section 7), each run alone through :func:`reference_attention`:
    q (T, Hq, D), k and v (T, Hkv, D); returns out (T, Hq, D) and lse (Hq, T). ``keep`` (1, Hq, T,
    T): the dropout mask of the packed rows, sequence i reading it at its rows (``dropout_p``)."""
    dtype = dtype or torch.float64
    _T, Hq, D = q.shape
    outs = [q.new_zeros((0, Hq, D), dtype=dtype)]
    lses = [q.new_zeros((Hq, 0), dtype=dtype)]
    for s, e in itertools.pairwise(cu_seqlens):
        if e == s:
            continue
        o, lse = reference_attention(
            q[s:e][None], k[s:e][None], v[s:e][None], segment_lengths, dilation_rates, is_causal,
            softmax_scale, dtype, None if keep is None else keep[..., s:e, s:e], dropout_p,
        )  # fmt: skip
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def causal_segment_sample(q, k, v, dout, rows, keys, dtype, block=1024):
    """One causal segment (w = N, r = 1, one head) computed densely in ``dtype`` by rows of
    ``block`` queries: out, lse and dq of ``rows``, dk and dv of ``keys`` (a dict of those five).
    For segments too long for the dense reference; q, k, v, dout are (1, N, 1, D)."""
    q, k, v, dout = (t[0, :, 0].to(dtype) for t in (q, k, v, dout))  # (N, D)
    N, D = q.shape
    scale = D**-0.5
    pos = torch.arange(N)
    lse = torch.empty(N, dtype=dtype)
    out = torch.empty(N, D, dtype=dtype)
    for a in range(0, N, block):
        s = (q[a : a + block] @ k.T) * scale
        s = s.masked_fill(pos[None, :] > pos[a : a + block, None], -math.inf)
        lse[a : a + block] = torch.logsumexp(s, dim=-1)
        out[a : a + block] = torch.softmax(s, dim=-1) @ v
    delta = (dout * out).sum(-1)  # (N,)

    s_r = (q[rows] @ k.T) * scale  # (R, N)
    s_r = s_r.masked_fill(pos[None, :] > rows[:, None], -math.inf)
    p_r = torch.exp(s_r - lse[rows, None])
    dq = scale * (p_r * (dout[rows] @ v.T - delta[rows, None])) @ k

    s_k = (q @ k[keys].T) * scale  # (N, X)
    s_k = s_k.masked_fill(pos[:, None] < keys[None, :], -math.inf)
    p_k = torch.exp(s_k - lse[:, None])
    dv = p_k.T @ dout
    dk = scale * (p_k * (dout @ v[keys].T - delta[:, None])).T @ q
    return {"out": out[rows], "lse": lse[rows], "dq": dq, "dk": dk, "dv": dv}
