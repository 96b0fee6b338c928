"""The modules of sequence parallelism: :class:`RingDilatedAttention` and its multi-head wrapper.

``RingDilatedAttention.forward`` reads top to bottom: validate, resolve the group, check once
that the ranks agree (:mod:`.consistency`), take the plan of this rank (:mod:`.geometry`), run the
local runs on the module's backend, run the spanning pieces (:mod:`.node` with
:mod:`.mode_all_gather` or :mod:`.mode_ring`), and merge everything by log-sum-exp
(:mod:`dilated_attention.merge`).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _validation as V
from ..backends import BackendSelector, check_backend_name
from ..flops import accumulation_dtype
from ..functional import _attention
from ..merge import merge
from ..modules import MultiheadDilatedAttention
from . import mode_all_gather, mode_ring
from .consistency import ConsistencyCheck, fingerprint
from .geometry import LAYOUTS, Plan, make_layout
from .node import SpanAttention, SpanJob
from .pieces import PieceAttention
from .transport import Comm, resolve_group

__all__ = [
    "COMM_MODES",
    "RingDilatedAttention",
    "RingDilatedAttentionV2Collective",
    "RingMultiheadDilatedAttention",
    "StandardizedRingConfig",
    "gather_sequence",
    "shard_sequence",
]

logger = logging.getLogger(__name__)

COMM_MODES = ("all_gather", "ring")
_MODES = {"all_gather": mode_all_gather, "ring": mode_ring}


def shard_sequence(
    x: torch.Tensor, process_group: dist.ProcessGroup | None = None, dim: int = 1, layout: str = "contiguous"
) -> torch.Tensor:
    """This rank's positions of ``x`` along ``dim`` (the sequence dimension of (B, N, H, D)).

    ``layout="contiguous"``: the chunk ``[rank*N/P, (rank+1)*N/P)``. ``layout="zigzag"``: chunks
    ``rank`` and ``2P-1-rank`` of ``2P`` (see :mod:`dilated_attention.ring.geometry`), concatenated.
    Raises ValueError when ``N`` is not divisible by the number of ranks (by ``2P`` for zigzag).
    """
    _, P, rank = resolve_group(process_group, who="shard_sequence")
    N = x.shape[dim]
    parts = P if layout == "contiguous" else 2 * P
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if N % parts != 0:
        raise ValueError(
            f"the sequence length N = {N} must be divisible by {parts} (P = {P} ranks, layout={layout!r}); "
            f"pad the sequence to a multiple of {parts}"
        )
    L = make_layout(layout, P, N // P)
    return torch.cat([x.narrow(dim, c * L.chunk, L.chunk) for c in L.chunks_of(rank)], dim=dim)


def gather_sequence(
    x: torch.Tensor, process_group: dist.ProcessGroup | None = None, dim: int = 1, layout: str = "contiguous"
) -> torch.Tensor:
    """Every rank's positions of ``x`` along ``dim`` in sequence order (the inverse of
    :func:`shard_sequence`). Not differentiable; for checks and inference."""
    group, P, _ = resolve_group(process_group, who="gather_sequence")
    if P == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(parts, x.contiguous(), group=group)
    L = make_layout(layout, P, x.shape[dim])
    chunks = {}
    for rank, part in enumerate(parts):
        for i, c in enumerate(L.chunks_of(rank)):
            chunks[c] = part.narrow(dim, i * L.chunk, L.chunk)
    return torch.cat([chunks[c] for c in range(L.num_chunks)], dim=dim)


class RingDilatedAttention(nn.Module):
    """Dilated attention with the sequence split across the ranks of a process group.

    Each rank calls ``forward`` with its positions ``(B, N/P, H, D)`` of q, k and v (use
    :func:`shard_sequence`) and gets the same positions of the output; together they equal
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
        attention_backend: backend of the local runs and of the spanning pieces (see
            :mod:`dilated_attention.backends`; pieces run on ``native`` where it has a piece kernel,
            otherwise on this backend when it has a kernel backward, otherwise on ``sdpa``).
        check_consistency: compare a fingerprint of the configuration and shapes across ranks the
            first time each configuration and shape is seen (one small all-gather), so that a
            mismatch raises on every rank instead of hanging. ``False`` is unsafe: ranks called
            with different configurations may then abort inside the communication library (gloo:
            SIGABRT) or return wrong results.
        ring_size: the number of ranks expected; a group of another size (larger than one) is an
            error, and a ``ring_size`` above one without a process group warns. None accepts any.
        layout: ``"contiguous"`` (rank ``j`` holds positions ``[j*N/P, (j+1)*N/P)``, SPEC section
            5) or ``"zigzag"`` (rank ``j`` holds chunks ``j`` and ``2P-1-j`` of ``2P``, which
            balances causal work; shard with ``shard_sequence(x, layout="zigzag")``).
    """

    attention_backend: str
    check_consistency: bool
    ring_size: int | None
    layout: str
    _selector: BackendSelector
    _check: ConsistencyCheck

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
        layout: str = "contiguous",
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
            if isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
                pass  # a process outside the group: forward says so, in its own words
            else:
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
        check_backend_name(attention_backend)
        self.attention_backend = attention_backend
        self.check_consistency = V.check_bool(check_consistency, "check_consistency")
        if ring_size is not None and (
            isinstance(ring_size, bool) or not isinstance(ring_size, numbers.Integral) or ring_size < 1
        ):
            raise ValueError(f"ring_size must be an int >= 1 or None, got {ring_size!r}")
        self.ring_size = None if ring_size is None else int(ring_size)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self._plans: dict[tuple, Plan] = {}
        self._selector = BackendSelector(type(self).__name__)
        self._pieces: dict[tuple, PieceAttention] = {}
        self._check = ConsistencyCheck()

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, "
            f"comm={self.comm!r}, layout={self.layout!r}, attention_backend={self.attention_backend!r}"
        )

    # -- helpers -------------------------------------------------------------------------
    def _plan(self, rank: int, P: int, local_len: int, Hq: int, Hkv: int, is_causal: bool) -> Plan:
        key = (rank, P, local_len, Hq, Hkv, is_causal)
        plan = self._plans.get(key)
        if plan is None:
            layout = make_layout(self.layout, P, local_len)
            plan = Plan(layout, rank, self.segment_lengths, self.dilation_rates, Hq, Hkv, is_causal)
            logger.debug(
                "ring plan for rank %d of %d (%s, %d positions): local runs %s, %d spanning pieces, steps %s",
                rank,
                P,
                self.layout,
                local_len,
                [(lo, hi, s, r) for lo, hi, s, r in plan.local_runs],
                len(plan.pieces),
                plan.steps,
            )
            if self.use_pattern_cache:
                self._plans[key] = plan
        return plan

    def _piece_attention(self, q: torch.Tensor, k: torch.Tensor) -> PieceAttention:
        backend = self._selector.select(self.attention_backend, q, k)
        key = (backend.name, q.device)
        if key not in self._pieces:
            self._pieces[key] = PieceAttention(backend, q.device)
        return self._pieces[key]

    def _local(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs, rates, is_causal: bool, scale: float
    ):
        return _attention(
            q,
            k,
            v,
            segs,
            rates,
            is_causal=is_causal,
            softmax_scale=scale,
            return_lse=True,
            backend=self.attention_backend,
            selector=self._selector,
        )

    # -- forward -------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of this rank's positions.

        Args:
            q: (B, N/P, Hq, D), this rank's queries (see :func:`shard_sequence` for which positions).
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
        group, P, rank = resolve_group(self.process_group, self.ring_size)
        if self.ring_size is not None and P > 1 and P != self.ring_size:
            raise ValueError(f"ring_size={self.ring_size} but the process group has {P} ranks")
        B, local_len, Hq, _ = q.shape
        if P == 1:
            out, lse = self._local(q, k, v, self.segment_lengths, self.dilation_rates, is_causal, scale)
            return (out, lse) if return_lse else out
        comm = Comm(group, rank, P, q.device)
        if self.check_consistency:
            fields = fingerprint(
                q,
                k,
                self.segment_lengths,
                self.dilation_rates,
                is_causal,
                scale,
                COMM_MODES.index(self.comm),
                LAYOUTS.index(self.layout),
            )
            self._check(comm, fields, {"comm": COMM_MODES, "layout": LAYOUTS})
        if B == 0 or local_len == 0:
            out, lse = self._local(q, k, v, self.segment_lengths, self.dilation_rates, is_causal, scale)
            return (out, lse) if return_lse else out
        plan = self._plan(rank, P, local_len, Hq, k.shape[2], is_causal)
        # On the fused op the local runs join the pieces' autograd node, which merges them without
        # a differentiable merge (node.py); on other backends they are calls of the backend.
        fused = self._selector.select(self.attention_backend, q, k).name == "native"
        outs, lses = [], []
        for lo, hi, segs, rates in [] if fused else plan.local_runs:
            o, lse = self._local(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], segs, rates, is_causal, scale)
            if (lo, hi) != (0, local_len):
                o = F.pad(o, (0, 0, 0, 0, lo, local_len - hi))  # zeros outside the run
                lse = F.pad(lse, (lo, local_len - hi), value=float("-inf"))
            outs.append(o)
            lses.append(lse)
        if plan.any_span or (fused and plan.local_runs):
            local_runs = plan.local_runs if fused else []
            job = SpanJob(plan, comm, self._piece_attention(q, k), self.comm, scale, is_causal, local_runs)
            o, lse = SpanAttention.apply(q, k, v, job, _MODES[self.comm])
            outs.append(o)
            lses.append(lse)
        acc = accumulation_dtype(q.dtype)
        out, lse = merge(outs, [x.to(acc) for x in lses])
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
        assert self.embed_dim is not None and self.num_heads is not None  # set by __post_init__
        return self.embed_dim // self.num_heads


class RingMultiheadDilatedAttention(MultiheadDilatedAttention):
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

    # The ring module takes the place of the base class's DilatedAttention (same attributes and
    # forward(q, k, v, is_causal); no key_padding_mask, which the base's forward checks for).
    attention: RingDilatedAttention  # type: ignore[assignment]

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
        layout: str = "contiguous",
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
            layout=layout,
        )

    @classmethod
    def from_config(
        cls, config: StandardizedRingConfig, process_group: dist.ProcessGroup | None = None, **kwargs: Any
    ) -> RingMultiheadDilatedAttention:
        """Build the module of a :class:`StandardizedRingConfig` (``kwargs`` add or override arguments)."""
        if not isinstance(config, StandardizedRingConfig):
            raise TypeError(f"config must be a StandardizedRingConfig, got {type(config).__name__}")
        args: dict[str, Any] = {
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
