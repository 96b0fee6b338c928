"""The common driver of the gather-based backends (sdpa, manual, flash_attn_2/3, xformers).

For every branch ``(w, r)`` and every head offset ``o < min(r, Hq)``, the positions that the
branch covers (see :mod:`.patterns`) are gathered with ``index_select`` from the query heads
``o::r`` and the key/value heads they read, giving dense problems of shape (rows, m, heads, D)
that one kernel call solves together, returning ``out`` and its log-sum-exp. Per branch, the
results are written back to (B, N, Hq, D) and (B, Hq, N); rows that the branch does not cover
keep ``out = 0`` and ``lse = -inf``. Branches are then merged in float32 (float64 for float64
inputs) by their log-sum-exp (SPEC section 3):

    lse = logsumexp_i lse_i,    out = sum_i exp(lse_i - lse) * out_i.

Two ways to differentiate, both exact:

* **merged** (:class:`_MergedAttention`): a custom ``autograd.Function`` whose backward calls the
  kernel's own backward once per group with the *merged* ``out`` and ``lse`` (as ring attention
  does): with ``P = exp(s - lse)`` the merged probabilities, the kernel computes
  ``dS = P * (dout @ v^T - rowsum(dout * out))``, which summed over groups is the exact gradient
  through the mixing weights. A gradient ``dlse`` of the returned ``lse`` adds ``dS += P * dlse``;
  it is obtained from one more backward call with ``v = 0``, ``out = e_0`` and
  ``dout = -dlse * e_0`` (``e_0`` the first unit vector of the head dim), for which the kernel's
  formula gives exactly ``P * dlse``. Used where the kernel has a backward that takes ``out``
  and ``lse`` and no dropout is asked for.
* **autograd**: every group returns an ``out`` and an ``lse`` that autograd can differentiate,
  and the merge runs in plain PyTorch. Used by ``manual``, by ``flash_attn_*`` (whose public
  API differentiates ``out`` only) and for dropout. Where the kernel's ``lse`` carries no
  gradient, :func:`lse_with_grad` gives it its exact first-order gradient from one extra kernel
  call with the keys as values: ``d lse_p / d q_p = scale * sum_x P(p, x) k_x``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._autograd import first_order_only, no_double_backward
from ..merge import merge as merge_branches
from ..merge import merge_into_
from .base import Backend, lse_dtype
from .patterns import HeadGroup, dilated_positions, head_groups

__all__ = ["GatheredBackend", "kernel_backward", "lse_with_grad", "merge_branches"]


@dataclass(frozen=True)
class _Item:
    """One kernel call: the positions ``pos`` (rows, m) of one branch for one head group."""

    heads: HeadGroup
    pos: torch.Tensor  # (R, m) int64

    @property
    def rows(self) -> int:
        return int(self.pos.shape[0])

    @property
    def m(self) -> int:
        return int(self.pos.shape[1])


def _plan(
    N: int | tuple[int, ...],
    Hq: int,
    Hkv: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    native_gqa: bool,
    device: torch.device,
) -> list[list[_Item]]:
    plan = []
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        items = []
        for hg in head_groups(Hq, Hkv, r, native_gqa, device):
            for pos in dilated_positions(N, w, r, hg.offset, device):
                items.append(_Item(hg, pos))
        plan.append(items)
    return plan


def _gather(x: torch.Tensor, heads: Any, pos: torch.Tensor) -> torch.Tensor:
    """x (B, N, H, D) -> (B*R, m, h, D): the positions ``pos`` (R, m) of the heads ``heads``."""
    B, R, m = x.shape[0], pos.shape[0], pos.shape[1]
    flat = pos.reshape(-1)
    if isinstance(heads, slice):
        g = x[:, :, heads].index_select(1, flat)  # (B, R*m, h, D)
    else:
        g = x.index_select(1, flat).index_select(2, heads)
    return g.view(B * R, m, g.shape[2], g.shape[3])


def _gather_rows(t: torch.Tensor, heads: slice, pos: torch.Tensor) -> torch.Tensor:
    """t (B, Hq, N) -> (B*R, h, m), contiguous."""
    B, R, m = t.shape[0], pos.shape[0], pos.shape[1]
    g = t[:, heads].index_select(2, pos.reshape(-1))  # (B, h, R*m)
    h = g.shape[1]
    return g.view(B, h, R, m).permute(0, 2, 1, 3).reshape(B * R, h, m)


def _scatter_rows_(dst: torch.Tensor, heads: slice, pos: torch.Tensor, val: torch.Tensor) -> None:
    """dst (B, Hq, N)[:, heads, pos] = val (B*R, h, m), in place."""
    B, R, m = dst.shape[0], pos.shape[0], pos.shape[1]
    h = val.shape[1]
    v = val.reshape(B, R, h, m).permute(0, 2, 1, 3).reshape(B, h, R * m)
    dst[:, heads].index_copy_(2, pos.reshape(-1), v.to(dst.dtype))


def _add_heads_(dst: torch.Tensor, heads: Any, pos: torch.Tensor, val: torch.Tensor) -> None:
    """dst (B, N, H, D)[:, pos, heads] += val (B*R, m, h, D); ``heads`` may repeat a head."""
    B, N, H, D = dst.shape
    R, m = pos.shape
    h = val.shape[2]
    flat = pos.reshape(-1)
    if isinstance(heads, slice):
        dst[:, :, heads].index_add_(1, flat, val.reshape(B, R * m, h, D).to(dst.dtype))
    else:  # dst is one of our contiguous accumulators
        idx = (flat[:, None] * H + heads[None, :]).reshape(-1)
        dst.view(B, N * H, D).index_add_(1, idx, val.reshape(B, R * m * h, D).to(dst.dtype))


class _NonFinite:
    """Non-finite values reach exactly the rows that read them (SPEC sections 2-3), which dense
    kernels do not do on their own.

    * Causal: a masked key's weight is 0, but 0 * inf and 0 * NaN are NaN, so a non-finite value
      would reach the earlier rows of its sub-sequence. The kernel gets v with non-finite entries
      replaced by 0, and each row then adds the non-finite entries of the keys it reads, a prefix
      sum along the sub-sequence: + 0 where there are none (exact), inf or NaN where there are.
    * ``poison_scores`` (kernels that turn a NaN score into weight 0, as PyTorch's fused CPU kernel
      does): a row whose query, or one of whose keys, is non-finite gets NaN in out and lse.
    """

    def __init__(self, q, k, v, is_causal: bool, poison_scores: bool):
        self.is_causal = is_causal
        self.v_kernel: torch.Tensor = v
        self.v_bad: torch.Tensor | None = None
        if is_causal:
            self.v_kernel = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
            self.v_bad = v - self.v_kernel  # 0 where finite, else the inf or NaN itself
        self.zq: torch.Tensor | None = None
        self.zk: torch.Tensor | None = None
        if poison_scores:
            self.zq = q.sum(-1, keepdim=True) * 0  # (B, N, Hq, 1): NaN for a non-finite row, else 0
            self.zk = k.sum(-1, keepdim=True) * 0

    @staticmethod
    def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
        """(Bb, m, hk, E) -> (Bb, m, h, E): the key/value head of each query head."""
        return x if x.shape[2] == h else x.repeat_interleave(h // x.shape[2], dim=2)

    def _reads(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the keys each row reads: a prefix sum when causal, else the whole sub-sequence."""
        return x.cumsum(1) if self.is_causal else x.sum(1, keepdim=True)

    def apply(self, it: _Item, og: torch.Tensor, lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's out (Bb, m, h, D) and lse (Bb, h, m) of item ``it``, corrected."""
        hg, h = it.heads, og.shape[2]
        if self.v_bad is not None:
            og = og + self._reads(self._heads(_gather(self.v_bad, hg.kv_heads, it.pos), h)).to(og.dtype)
        if self.zq is not None:
            assert self.zk is not None  # set together with zq
            z = _gather(self.zq, hg.q_heads, it.pos) + self._reads(
                self._heads(_gather(self.zk, hg.kv_heads, it.pos), h)
            )  # (Bb, m, h, 1)
            og = og + z.to(og.dtype)
            lg = lg + z[..., 0].transpose(1, 2).to(lg.dtype)
        return og, lg


def lse_with_grad(
    lse: torch.Tensor, q: torch.Tensor, out_k: torch.Tensor, scale: float, backend: str = "gather-based"
) -> torch.Tensor:
    """Give a kernel's non-differentiable ``lse`` its exact first-order gradient.

    lse (Bb, H, m); q (Bb, m, H, D); ``out_k`` = attention(q.detach(), k.detach(), values=k), the
    same kernel with the keys as values (differentiable in its value argument). Since
    ``d lse_p / d s_px = P_px``: ``d lse_p / d q_p = scale * out_k[p]`` and
    ``d lse_p / d k_x = scale * P_px q_p``, which is the value-gradient of ``out_k`` along ``q``.
    The added term is exactly zero in value. Its gradient is exact to first order only, so a second
    backward through it raises a ``RuntimeError`` naming ``backend``.
    """
    q, out_k = first_order_only(backend, q), first_order_only(backend, out_k)
    qd, okd = q.detach(), out_k.detach()
    t = ((q - qd) * okd).sum(-1) + (qd * (out_k - okd)).sum(-1)  # (Bb, m, H), == 0
    return lse + (scale * t).transpose(1, 2).to(lse.dtype)


def kernel_backward(
    backend: GatheredBackend,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    extra: Any,
    *,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one kernel call's q, k, v given the *merged* ``out`` and ``lse`` of its rows
    and the gradients ``dout`` (Bb, m, h, D) and ``dlse`` (Bb, h, m) of the merged result (either
    may be None). ``lse`` is in the layout :meth:`GatheredBackend.attn_forward` returned.

    The ``dlse`` term ``dS += P * dlse`` comes from one more backward call with ``v = 0``,
    ``out = e_0`` and ``dout = -dlse * e_0`` (``e_0`` the first unit vector of the head dim), for
    which the kernel's formula gives exactly ``P * dlse``.
    """
    grads: list[torch.Tensor] | None = None
    if dout is not None:
        grads = list(
            backend.attn_backward(
                dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, extra, is_causal=is_causal, scale=scale
            )
        )
    if dlse is not None:
        unit_out = torch.zeros_like(q)
        unit_out[..., 0] = 1
        d_unit = torch.zeros_like(q)
        d_unit[..., 0] = -dlse.transpose(1, 2).to(q.dtype)
        g = backend.attn_backward(
            d_unit, q, k, torch.zeros_like(v), unit_out, lse, extra, is_causal=is_causal, scale=scale
        )
        if grads is None:
            grads = [g[0], g[1], torch.zeros_like(v)]
        else:  # summed in the accumulation dtype
            grads[0] = grads[0].to(lse.dtype) + g[0].to(lse.dtype)
            grads[1] = grads[1].to(lse.dtype) + g[1].to(lse.dtype)
    if grads is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return grads[0], grads[1], grads[2]


class _MergedAttention(torch.autograd.Function):
    """Forward: all groups, merged by lse. Backward: each group's kernel backward, fed the merged
    ``out`` and ``lse``."""

    @staticmethod
    def forward(ctx, q, k, v, backend, plan, is_causal, scale):
        B, N, Hq, D = q.shape
        acc = lse_dtype(q.dtype)
        out_acc: torch.Tensor | None = None
        lse_acc: torch.Tensor | None = None
        aux = []
        nonfinite = _NonFinite(q, k, v, is_causal, backend.hides_nonfinite_scores)
        for items in plan:
            out_b = q.new_zeros((B, N, Hq, D), dtype=acc)
            lse_b = q.new_full((B, Hq, N), -math.inf, dtype=acc)
            for it in items:
                hg = it.heads
                qg = _gather(q, hg.q_heads, it.pos)  # (B*R, m, h, D)
                kg = _gather(k, hg.kv_heads, it.pos)  # (B*R, m, hk, D)
                vg = _gather(nonfinite.v_kernel, hg.kv_heads, it.pos)
                og, lg, extra = backend.attn_forward(qg, kg, vg, is_causal=is_causal, scale=scale)
                aux.append((lg.shape[-1], extra))
                og, lg = nonfinite.apply(it, og, lg[..., : it.m])
                out_b[:, :, hg.q_heads].index_copy_(
                    1, it.pos.reshape(-1), og.reshape(B, it.rows * it.m, hg.num_q_heads, D).to(acc)
                )
                _scatter_rows_(lse_b, hg.q_heads, it.pos, lg[..., : it.m])
            if out_acc is None or lse_acc is None:
                out_acc, lse_acc = out_b, lse_b
            else:
                lse_acc = merge_into_(out_acc, lse_acc, out_b, lse_b)
        assert out_acc is not None  # the plan has at least one branch
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.backend, ctx.plan, ctx.is_causal, ctx.scale, ctx.aux = backend, plan, is_causal, scale, aux
        ctx.set_materialize_grads(False)
        return out, lse_acc

    @staticmethod
    def backward(ctx, dout, dlse):
        with torch.no_grad():
            dq, dk, dv = _MergedAttention._backward(ctx, dout, dlse)
        # A kernel backward has no derivative: a second backward raises, naming the backend.
        dq, dk, dv = no_double_backward(ctx.backend.name, (dq, dk, dv), (dout, dlse, *ctx.saved_tensors[:3]))
        return dq, dk, dv, None, None, None, None

    @staticmethod
    def _backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        backend, is_causal, scale = ctx.backend, ctx.is_causal, ctx.scale
        acc = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        if dout is not None:
            dout = dout.to(q.dtype)
        # Where a position's gradient sums several kernel calls (several branches, or the extra call
        # for dlse), low-precision kernels would round each call's share before the sum: run them in
        # the accumulation dtype instead, so that the sum is rounded once.
        wide = acc if q.dtype != acc and (len(ctx.plan) > 1 or dlse is not None) else None
        i = 0
        for items in ctx.plan:
            for it in items:
                hg = it.heads
                lse_len, extra = ctx.aux[i]
                i += 1
                qg = _gather(q, hg.q_heads, it.pos)
                kg = _gather(k, hg.kv_heads, it.pos)
                vg = _gather(v, hg.kv_heads, it.pos)
                if wide is not None:
                    qg, kg, vg = qg.to(wide), kg.to(wide), vg.to(wide)
                lg = _gather_rows(lse, hg.q_heads, it.pos)  # merged lse of these rows: (B*R, h, m)
                if lse_len != it.m:  # the kernel pads its lse: hand it back in the same layout
                    padded = lg.new_zeros((*lg.shape[:-1], lse_len))
                    padded[..., : it.m] = lg
                    lg = padded
                og = _gather(out, hg.q_heads, it.pos)
                dog = None if dout is None else _gather(dout, hg.q_heads, it.pos)
                if wide is not None:
                    og = og.to(wide)
                    dog = None if dog is None else dog.to(wide)
                dl = None if dlse is None else _gather_rows(dlse, hg.q_heads, it.pos)  # (B*R, h, m)
                dqg, dkg, dvg = kernel_backward(
                    backend, dog, dl, qg, kg, vg, og, lg, extra, is_causal=is_causal, scale=scale
                )
                _add_heads_(dq, hg.q_heads, it.pos, dqg)
                _add_heads_(dk, hg.kv_heads, it.pos, dkg)
                _add_heads_(dv, hg.kv_heads, it.pos, dvg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _autograd_attention(
    backend: GatheredBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: list[list[_Item]],
    is_causal: bool,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, N, Hq, D = q.shape
    acc = lse_dtype(q.dtype)
    out_dtype = q.dtype
    if backend.computes_in_accumulation_dtype:
        # One cast up front: the gradients of every gather and branch then add up in float32, and
        # are rounded to q's dtype once, by the backward of this cast.
        q, k, v = (t.to(acc) for t in (q, k, v))
    nonfinite = _NonFinite(q, k, v, is_causal, backend.hides_nonfinite_scores)
    outs, lses = [], []
    for items in plan:
        vals_o, idx_o, vals_l, idx_l = [], [], [], []
        for it in items:
            hg = it.heads
            R, m, h = it.rows, it.m, hg.num_q_heads
            qg = _gather(q, hg.q_heads, it.pos)
            kg = _gather(k, hg.kv_heads, it.pos)
            vg = _gather(nonfinite.v_kernel, hg.kv_heads, it.pos)
            og, lg = backend.attn_autograd(qg, kg, vg, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
            og, lg = nonfinite.apply(it, og, lg[..., :m])
            hq = torch.arange(hg.q_heads.start, Hq, hg.q_heads.step, device=q.device)  # (h,)
            idx_o.append((it.pos.reshape(R, m, 1) * Hq + hq).reshape(-1))  # into (N*Hq)
            vals_o.append(og.reshape(B, R * m * h, D).to(acc))
            idx_l.append((hq.view(1, h, 1) * N + it.pos.view(R, 1, m)).reshape(-1))  # into (Hq*N)
            vals_l.append(lg[..., :m].reshape(B, R * h * m).to(acc))
        out_b = q.new_zeros((B, N * Hq, D), dtype=acc)
        lse_b = q.new_full((B, Hq * N), -math.inf, dtype=acc)
        if idx_o:
            out_b = out_b.index_copy(1, torch.cat(idx_o), torch.cat(vals_o, dim=1))
            lse_b = lse_b.index_copy(1, torch.cat(idx_l), torch.cat(vals_l, dim=1))
        outs.append(out_b.view(B, N, Hq, D))
        lses.append(lse_b.view(B, Hq, N))
    out, lse = merge_branches(outs, lses)
    return out.to(out_dtype), lse


class GatheredBackend(Backend):
    """A backend that runs a dense attention kernel on the gathered dilated sub-sequences.

    Subclasses provide, on tensors q (Bb, m, h, D), k and v (Bb, m, hk, D) with ``h % hk == 0``
    (query head ``j`` reads key/value head ``j // (h // hk)``; ``hk == h`` unless
    :meth:`native_gqa` is true):

    * :meth:`attn_forward` and :meth:`attn_backward` (the merged path), and/or
    * :meth:`attn_autograd` (the autograd path).
    """

    #: Whether :meth:`attn_autograd` computes in the accumulation dtype (float32 for float16 and
    #: bfloat16) anyway: the driver then casts q, k and v once, not every gathered copy.
    computes_in_accumulation_dtype = False

    #: Whether the kernel turns a NaN score into weight 0 (the driver then makes such rows NaN).
    hides_nonfinite_scores = False

    def native_gqa(self, device: torch.device) -> bool:
        """Whether the kernel takes fewer key/value heads than query heads."""
        return False

    def merged_backward(self, device: torch.device, dropout_p: float) -> bool:
        """Whether to use the merged path (kernel backward fed the merged out/lse)."""
        return False

    def attn_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Returns ``out`` (Bb, m, h, D), ``lse`` (Bb, h, >= m) float32/64 and anything the
        backward needs."""
        raise NotImplementedError

    def attn_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        extra: Any,
        *,
        is_causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kernel backward with the given ``out`` and ``lse`` (shaped as attn_forward's)."""
        raise NotImplementedError

    def attn_autograd(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        scale: float,
        dropout_p: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable ``out`` (Bb, m, h, D) and ``lse`` (Bb, h, m)."""
        raise NotImplementedError

    def forward(self, q, k, v, segment_lengths, dilation_rates, *, is_causal, softmax_scale, dropout_p=0.0):
        return self._run(
            q, k, v, q.shape[1], segment_lengths, dilation_rates, is_causal, softmax_scale, dropout_p
        )

    def forward_varlen(
        self,
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        lengths,
        segment_lengths,
        dilation_rates,
        *,
        is_causal,
        softmax_scale,
        dropout_p=0.0,
    ):
        # The packed rows as one (1, T, H, D) batch whose index patterns restart at every sequence.
        out, lse = self._run(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            tuple(lengths),
            segment_lengths,
            dilation_rates,
            is_causal,
            softmax_scale,
            dropout_p,
        )
        return out.squeeze(0), lse.squeeze(0)

    def _run(self, q, k, v, N, segment_lengths, dilation_rates, is_causal, softmax_scale, dropout_p):
        Hq = q.shape[2]
        plan = _plan(N, Hq, k.shape[2], segment_lengths, dilation_rates, self.native_gqa(q.device), q.device)
        if self.merged_backward(q.device, dropout_p):
            return _MergedAttention.apply(q, k, v, self, plan, bool(is_causal), float(softmax_scale))
        return _autograd_attention(
            self, q, k, v, plan, bool(is_causal), float(softmax_scale), float(dropout_p)
        )
