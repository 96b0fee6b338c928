"""The common driver of the gather-based backends (sdpa, manual, flash_attn_2/3, xformers).

Every branch ``(w, r)`` is a handful of dense kernel calls on *strided views* of q, k and v
(:mod:`.strided`): viewing x (B, N, H, D) as (B * N / w, w, H, D), the query heads of phase ``o``
read ``x[:, o::r, o::r]``, and when ``r >= Hq`` all heads fit one call on a diagonal view. No
index is gathered and nothing is copied where a view serves. Branches are merged by their
log-sum-exp (SPEC section 3):

    lse = logsumexp_i lse_i,    out = sum_i exp(lse_i - lse) * out_i.

Two ways to differentiate, both exact:

* **merged** (:mod:`.accumulated`): the forward merges every call into one accumulator as it goes; the
  backward calls the kernel's own backward once per call with the *merged* ``out`` and ``lse``
  (as ring attention does): with ``P = exp(s - lse)`` the merged probabilities, the kernel computes
  ``dS = P * (dout @ v^T - rowsum(dout * out))``, which summed over calls is the exact gradient
  through the mixing weights, and adds it in place into strided views of dq, dk, dv. A gradient
  ``dlse`` of the returned ``lse`` adds ``dS += P * dlse`` (:func:`.accumulated.kernel_backward`). Used
  where the kernel has a backward that takes ``out`` and ``lse`` and no dropout is asked for.
* **autograd**: every call returns an ``out`` and an ``lse`` that autograd can differentiate
  (through the views), and the merge runs in plain PyTorch. Used by ``manual``, by ``flash_attn_*``
  (whose public API differentiates ``out`` only) and for dropout. Where the kernel's ``lse``
  carries no gradient, :func:`lse_with_grad` gives it its exact first-order gradient from one extra
  kernel call with the keys as values: ``d lse_p / d q_p = scale * sum_x P(p, x) k_x``.

Both work under ``torch.func`` (``grad``, ``vjp``, ``jacrev``, ``vmap``). ``torch.jit.trace``
would bake the sequence length into the graph, and ``torch.export`` with a dynamic sequence
length cannot express the per-segment calls: both are refused with an error naming them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ..merge import merge as merge_branches
from ..op.autograd import first_order_only
from .accumulated import MergedAttention, TracedMergedAttention, kernel_backward, kernel_values
from .base import BRANCH_DROPOUT, Backend, lse_dtype
from .strided import Call, batches, last_dim_contiguous, plan_branches, view, write

__all__ = ["StridedBackend", "kernel_backward", "lse_with_grad", "merge_branches"]


class _NonFinite:
    """Non-finite values reach exactly the rows that read them (SPEC sections 2-3), which dense
    kernels do not do on their own.

    * Causal: a masked key's weight is 0, but 0 * inf and 0 * NaN are NaN, so a non-finite value
      would reach the earlier rows of its sub-sequence. Where v has non-finite entries, the kernel
      gets v with them replaced by 0 (:func:`.accumulated.kernel_values`, which the merged backward
      applies too), and each row then adds the non-finite entries of the keys it reads, a prefix
      sum along the sub-sequence: inf or NaN where there are any.
    * ``poison_scores`` (kernels that turn a NaN score into weight 0, as PyTorch's fused CPU kernel
      does): a row whose query, or one of whose keys, is non-finite gets NaN in out and lse.
    """

    def __init__(self, q, k, v, is_causal: bool, poison_scores: bool):
        self.is_causal = is_causal
        self.v_kernel: torch.Tensor = kernel_values(v, is_causal)
        self.v_bad: torch.Tensor | None = None
        if self.v_kernel is not v:
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

    def apply(
        self, call: Call, og: torch.Tensor, lg: torch.Tensor, sl: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's out (Bb, m, h, D) and lse (Bb, h, m) of ``call`` on the batch slice ``sl``,
        corrected."""
        h = og.shape[2]
        if self.v_bad is not None:
            og = og + self._reads(self._heads(view(self.v_bad[sl], call, call.kv), h)).to(og.dtype)
        if self.zq is not None:
            assert self.zk is not None  # set together with zq
            z = view(self.zq[sl], call, call.q) + self._reads(
                self._heads(view(self.zk[sl], call, call.kv), h)
            )
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


def _autograd_attention(
    backend: StridedBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: tuple[tuple[Call, ...], ...],
    is_causal: bool,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, N, Hq, D = q.shape
    acc = lse_dtype(q.dtype)
    out_dtype = q.dtype
    kw: dict[str, Any] = {}
    if backend.computes_in_accumulation_dtype:
        # float16/bfloat16: one cast up front, so that the gradients of every view and branch add
        # up in float32 and are rounded to q's dtype once, by the backward of this cast. A wider
        # compute dtype than that (float64 for float32 inputs) is the kernel's own affair: each
        # call casts its views, and the branches' results and their merge stay in it.
        q, k, v = (t.to(acc) for t in (q, k, v))
        acc = backend.compute_dtype(out_dtype, q.device)
        kw["compute_dtype"] = acc
    nonfinite = _NonFinite(q, k, v, is_causal, backend.hides_nonfinite_scores)
    outs, lses = [], []
    for calls in plan:
        # Built from q so that it is batched like q under torch.func.vmap.
        out_b = q.new_zeros((B, N, Hq, D), dtype=acc)
        lse_b = q.new_full((B, N, Hq, 1), -math.inf, dtype=acc)
        for call in calls:
            for sl in batches(call, B, N):
                qv, kv = view(q[sl], call, call.q), view(k[sl], call, call.kv)
                vv = view(nonfinite.v_kernel[sl], call, call.kv)
                og, lg = backend.attn_autograd(
                    qv, kv, vv, is_causal=is_causal, scale=scale, dropout_p=dropout_p, **kw
                )
                og, lg = nonfinite.apply(call, og, lg[..., : call.m], sl)
                out_b = write(out_b, sl, call, call.q, og)
                lse_b = write(lse_b, sl, call, call.q, lg.transpose(1, 2).unsqueeze(-1))
        outs.append(out_b)
        lses.append(lse_b[..., 0].transpose(1, 2))
    out, lse = merge_branches(outs, lses)
    return out.to(out_dtype), lse.to(lse_dtype(out_dtype))


def _refuse_untraceable(name: str, N: Any) -> None:
    """torch.jit.trace and torch.export with a dynamic sequence length: refused by name."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"dilated_attention: the {name!r} backend cannot be traced with torch.jit.trace: its kernel "
            "calls depend on the sequence length, which a traced graph would fix to the example's. "
            "Use torch.compile or torch.export (with a static sequence length), or backend='native'."
        )
    lengths = N if isinstance(N, tuple) else (N,)
    # torch.export's default (non-strict) tracing runs this code as Python; under torch.compile
    # (and strict export) it is not checked here: some PyTorch versions (2.11) report
    # is_exporting() as True there too.
    exporting = torch.compiler.is_exporting() and not torch.compiler.is_dynamo_compiling()
    if exporting and not all(is_concrete_int(n) for n in lengths):
        raise RuntimeError(
            f"dilated_attention: the {name!r} backend cannot be exported by torch.export with a dynamic "
            f"sequence length (got {N}): its kernel calls depend on the length. Export with a static "
            "sequence length, or use backend='native'."
        )


class StridedBackend(Backend):
    """A backend that runs a dense attention kernel on the dilated sub-sequences, strided views of q, k and v.

    Subclasses provide, on tensors q (Bb, m, h, D), k and v (Bb, m, hk, D) with ``h % hk == 0``
    (query head ``j`` reads key/value head ``j // (h // hk)``; ``hk == h`` unless
    :meth:`native_gqa` is true), each with its last dimension contiguous (the driver copies an
    input whose head dim is not, once, and hands out views of it; other strides are arbitrary, and
    a head read by several query heads of a call may be a stride-0 head):

    * :meth:`attn_forward` and :meth:`attn_backward` (the merged path), and/or
    * :meth:`attn_autograd` (the autograd path).
    """

    drops_merged_weights = False  # each kernel call drops its own weights (_refuse_branch_dropout)

    #: Whether :meth:`attn_autograd` computes in a wider dtype anyway (:meth:`compute_dtype`): the
    #: driver then casts float16/bfloat16 q, k and v to float32 once, not every view,
    #: keeps the branches' results in the compute dtype and passes it as ``compute_dtype=``.
    computes_in_accumulation_dtype = False

    def compute_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The dtype the autograd path computes in for inputs in ``dtype`` where
        :attr:`computes_in_accumulation_dtype`: the accumulation dtype (float32 for float16 and
        bfloat16, else the inputs' own)."""
        return lse_dtype(dtype)

    #: Whether the kernel turns a NaN score into weight 0 (the driver then makes such rows NaN).
    hides_nonfinite_scores = False

    def native_gqa(self, device: torch.device) -> bool:
        """Whether the kernel takes fewer key/value heads than query heads."""
        return False

    def merged_backward(self, device: torch.device, dropout_p: float) -> bool:
        """Whether to use the merged path (kernel backward fed the merged out/lse)."""
        return False

    def row_dots(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lse: torch.Tensor,
        *,
        is_causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sum_x P(p, x) (dout_p . v_x), sum_x P(p, x))`` over the call's keys, each (Bb, m, h)
        in lse's dtype, for a backend whose backward takes ``delta`` and ``norm`` (the merged path
        sums them over every call, see ``accumulated._merged_rows``); None: it does not."""
        return None

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
        delta: torch.Tensor | None = None,
        norm: torch.Tensor | None = None,
        into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kernel backward with the given ``out`` and ``lse`` (shaped as attn_forward's); where
        :meth:`row_dots` is implemented, ``delta`` (Bb, m, h) in place of ``rowsum(dout * out)``,
        the probabilities times ``norm`` (Bb, m, h), and the gradients added into ``into`` (views
        of dq, dk, dv in lse's dtype, returned) where given."""
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
        self, q, k, v, packed, segment_lengths, dilation_rates, *, is_causal, softmax_scale, dropout_p=0.0
    ):
        # The packed rows as one (1, T, H, D) batch whose index patterns restart at every sequence.
        out, lse = self._run(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            tuple(packed.lengths),
            segment_lengths,
            dilation_rates,
            is_causal,
            softmax_scale,
            dropout_p,
        )
        return out.squeeze(0), lse.squeeze(0)

    def _run(self, q, k, v, N, segment_lengths, dilation_rates, is_causal, softmax_scale, dropout_p):
        _refuse_untraceable(self.name, N)
        _refuse_branch_dropout(self.name, segment_lengths, dilation_rates, dropout_p)
        q, k, v = _last_dims_contiguous(q, k, v)
        n = tuple(int(x) for x in N) if isinstance(N, tuple) else int(N)
        # The C++ plan; under torch.compile a constant of the graph (strided.plan_branches)
        plan = plan_branches(
            n,
            int(q.shape[2]),
            int(k.shape[2]),
            tuple(segment_lengths),
            tuple(dilation_rates),
            self.native_gqa(q.device),
        )
        if self.merged_backward(q.device, dropout_p):
            if not _foldable(q) or not _foldable(k) or not _foldable(v):
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            nonfinite = functools.partial(
                _NonFinite, is_causal=bool(is_causal), poison_scores=self.hides_nonfinite_scores
            )
            merged: type[TracedMergedAttention] = MergedAttention
            if torch.compiler.is_compiling():
                # Dynamo does not trace an autograd.Function that defines jvp (forward mode's
                # refusal), nor one given a tensor twice (self-attention's q = k = v)
                merged = TracedMergedAttention
                k = k.view_as(k) if k is q else k
                v = v.view_as(v) if v is q or v is k else v
            out, lse, _, _ = merged.apply(
                q, k, v, self, plan, bool(is_causal), float(softmax_scale), nonfinite
            )
            return out, lse
        return _autograd_attention(
            self, q, k, v, plan, bool(is_causal), float(softmax_scale), float(dropout_p)
        )


def _refuse_branch_dropout(name: str, segment_lengths: Any, dilation_rates: Any, dropout_p: float) -> None:
    """Attention dropout drops entries of the *merged* weights (SPEC section 3): a key that two
    branches find is kept or dropped as one entry. The gather-based kernels drop each call's own
    weights, so with several branches such a key would be dropped by each branch on its own (half
    kept). Every multi-branch geometry has such keys (position 0 is read by head 0 through every
    branch), so dropout with more than one branch is refused, naming ``native``, whose kernels drop
    the merged weights."""
    if dropout_p > 0 and len(segment_lengths) > 1:
        raise ValueError(
            f"dilated_attention: the {name!r} backend cannot apply attention dropout (dropout_p="
            f"{dropout_p}) to several branches (segment_lengths={list(segment_lengths)}, dilation_rates="
            f"{list(dilation_rates)}): {BRANCH_DROPOUT}. Use backend='native', or dropout_p=0, or one "
            "branch."
        )


def _last_dims_contiguous(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v with their last dimension contiguous (:func:`.strided.last_dim_contiguous`), as
    every kernel reads it; a tensor passed twice (self-attention) is copied once."""
    qc = last_dim_contiguous(q)
    kc = qc if k is q else last_dim_contiguous(k)
    vc = qc if v is q else kc if v is k else last_dim_contiguous(v)
    return qc, kc, vc


def _foldable(x: torch.Tensor) -> bool:
    """Whether x's batch and sequence dims fold into one (the segments are then views)."""
    return x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1)
