"""The attention of one piece: the only place in the ring package that calls a kernel.

A piece is a rank's queries of one head phase in a spanning segment, already sparsified, against
one run of that segment's keys (its own, or received from other ranks): dense attention of
q (B, nq, nh, D) over k, v (B, nk, nkv, D), where query head ``i`` reads key/value head
``kv_select[i]``. With causal masking, key ``j`` is visible to query ``i`` when
``j <= i + offset``; keys past every query's reach are never computed.

* ``native`` where the extension has the op ``dilated_attention::piece_fwd/piece_bwd`` for the
  device (CPU; CUDA when built with its kernels): the fused kernel, which skips masked key tiles
  and, in the backward, takes the *merged* ``out`` and ``lse`` of the rows (so that gradients are
  exact through the merge, as in ring attention).
* Otherwise the module's backend, when it has a kernel backward that takes ``out`` and ``lse``
  (``sdpa``, ``xformers``), else ``sdpa``: the same two entry points that the gather-based
  backends use (:mod:`dilated_attention.backends.driver`). A masked piece there is cut into the
  keys every query sees (no mask) and a square block with the usual causal mask, which is the
  only shape the ring produces (the queries' own keys come last).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from .. import op
from ..backends import get_backend
from ..backends.base import Backend
from ..backends.driver import StridedBackend, kernel_backward
from ..backends.strided import last_dim_contiguous
from ..merge import merge
from .geometry import HeadSets

__all__ = ["PieceAttention"]

logger = logging.getLogger(__name__)


def _mask_needed(offset: int | None, nk: int) -> bool:
    return offset is not None and offset < nk - 1


class PieceAttention:
    """Runs pieces on ``native`` (where it can) or on a gather-based backend with a kernel backward."""

    def __init__(self, backend: Backend, device: torch.device) -> None:
        self.native = backend.name == "native" and op.has_piece_kernel(device.type)
        self.fallback: StridedBackend | None = None
        if not self.native:
            if isinstance(backend, StridedBackend) and backend.merged_backward(device, 0.0):
                self.fallback = backend
            else:
                self.fallback = cast(StridedBackend, get_backend("sdpa"))  # SdpaBackend
        self.name = "native" if self.native else self._kernel.name
        logger.info("ring pieces on %s (%s)", device, self.name)

    @property
    def _kernel(self) -> StridedBackend:
        """The gather-based backend; only used when not ``native``."""
        assert self.fallback is not None  # set whenever not native
        return self.fallback

    # -- key/value heads -------------------------------------------------------------------
    def _heads_kv(self, k: torch.Tensor, hs: HeadSets, device: torch.device) -> tuple[torch.Tensor, bool]:
        """k as the kernel reads it, and whether its heads were expanded to one per query head."""
        grouped = hs.grouped and (self.native or self._kernel.native_gqa(device))
        if grouped:
            return k, False
        return k.index_select(2, hs.kv_select), True

    @staticmethod
    def _fold(dk: torch.Tensor, hs: HeadSets, nkv: int) -> torch.Tensor:
        B, nk, _, D = dk.shape
        return dk.new_zeros((B, nk, nkv, D)).index_add_(2, hs.kv_select, dk)

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        hs: HeadSets,
        offset: int | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """out (B, nq, nh, D) in q's dtype, lse (B, nh, nq) in the accumulation dtype, and what
        :meth:`backward` needs besides the tensors."""
        ke, _ = self._heads_kv(k, hs, q.device)
        ve, _ = self._heads_kv(v, hs, q.device)
        nq, nk = q.shape[1], k.shape[1]
        causal = _mask_needed(offset, nk)
        if self.native:
            out, lse = op.piece_forward(
                q, ke, ve, causal, offset if causal and offset is not None else 0, scale
            )
            return out, lse, None
        parts = self._parts(nq, nk, causal, offset)
        # the kernels read the head dim as contiguous
        q, ke, ve = last_dim_contiguous(q), last_dim_contiguous(ke), last_dim_contiguous(ve)
        outs, lses, aux = [], [], []
        for lo, hi, part_causal in parts:
            o, lse, extra = self._kernel.attn_forward(
                q, ke[:, lo:hi], ve[:, lo:hi], is_causal=part_causal, scale=scale
            )
            aux.append((lse.shape[-1], extra))
            outs.append(o)
            lses.append(lse[..., :nq])
        out, lse = merge(outs, lses)  # one or two parts
        return out.to(q.dtype), lse, aux

    @staticmethod
    def _parts(nq: int, nk: int, causal: bool, offset: int | None) -> list[tuple[int, int, bool]]:
        """Key ranges and masks of the fallback's kernel calls."""
        if not causal:
            return [(0, nk, False)]
        if offset != nk - nq or nk < nq:
            raise NotImplementedError(
                f"a masked piece on a gather-based backend must end with the queries' own keys "
                f"(offset = nk - nq), got nq={nq}, nk={nk}, offset={offset}"
            )
        parts = [(0, nk - nq, False)] if nk > nq else []
        return [*parts, (nk - nq, nk, True)]

    # -- backward --------------------------------------------------------------------------
    def backward(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        hs: HeadSets,
        out: torch.Tensor,
        lse: torch.Tensor,
        offset: int | None,
        scale: float,
        aux: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq (B, nq, nh, D), dk and dv (B, nk, nkv, D) of one piece, given the merged ``out``
        (B, nq, nh, D) and ``lse`` (B, nh, nq) of its rows and their gradients ``dout``, ``dlse``."""
        ke, expanded = self._heads_kv(k, hs, q.device)
        ve, _ = self._heads_kv(v, hs, q.device)
        nq, nk = q.shape[1], k.shape[1]
        causal = _mask_needed(offset, nk)
        if self.native:
            dq, dk, dv = op.piece_backward(
                dout.to(q.dtype),
                q,
                ke,
                ve,
                out.to(q.dtype),
                lse,
                dlse,
                causal,
                offset if causal and offset is not None else 0,
                scale,
            )
        else:
            q, ke, ve = last_dim_contiguous(q), last_dim_contiguous(ke), last_dim_contiguous(ve)
            dout, out = last_dim_contiguous(dout), last_dim_contiguous(out)
            dq_acc: torch.Tensor | None = None
            dks, dvs = [], []
            for (lo, hi, part_causal), (lse_len, extra) in zip(
                self._parts(nq, nk, causal, offset), aux, strict=True
            ):
                lse_p = lse
                if lse_len != nq:  # the kernel pads its lse: hand it back in the same layout
                    lse_p = lse.new_zeros((*lse.shape[:-1], lse_len))
                    lse_p[..., :nq] = lse
                g = kernel_backward(
                    self._kernel,
                    dout,
                    dlse,
                    q,
                    ke[:, lo:hi],
                    ve[:, lo:hi],
                    out,
                    lse_p,
                    extra,
                    is_causal=part_causal,
                    scale=scale,
                )
                dq_acc = g[0] if dq_acc is None else dq_acc.to(lse.dtype) + g[0].to(lse.dtype)
                dks.append(g[1])
                dvs.append(g[2])
            assert dq_acc is not None  # there is at least one part
            dq = dq_acc
            dk, dv = torch.cat(dks, dim=1), torch.cat(dvs, dim=1)
        if expanded:
            dk, dv = self._fold(dk, hs, k.shape[2]), self._fold(dv, hs, v.shape[2])
        return dq, dk, dv
