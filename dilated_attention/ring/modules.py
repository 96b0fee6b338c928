"""The modules of sequence parallelism: :class:`RingDilatedAttention` and its multi-head wrapper.

``RingDilatedAttention.forward`` reads top to bottom: validate, resolve the group, check that the
ranks agree and are in step (:mod:`.consistency`), take the plan of this rank (:mod:`.geometry`),
run the local runs on the module's backend, run the spanning pieces (:mod:`.node` with
:mod:`.mode_all_gather` or :mod:`.mode_ring`), and merge everything by log-sum-exp
(:mod:`dilated_attention.merge`).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _validation as V
from .._validation import accumulation_dtype
from ..backends import BackendSelector, check_backend_name
from ..functional import _attention
from ..merge import merge
from ..modules._script import NotScriptable
from . import mode_all_gather, mode_ring
from .consistency import CallCheck, CallLedger, fingerprint
from .geometry import LAYOUTS, Plan, make_layout
from .groups import GroupCopies, GroupLike, NeedsGroup, as_process_group, resolve_group
from .node import SpanAttention, SpanJob
from .pieces import PieceAttention
from .transport import Comm

__all__ = ["COMM_MODES", "RingDilatedAttention"]

logger = logging.getLogger(__name__)

COMM_MODES = ("all_gather", "ring")
_MODES = {"all_gather": mode_all_gather, "ring": mode_ring}
# How the consistency check names the values of its coded fields.
_FIELD_NAMES: dict[str, tuple[str, ...]] = {
    "comm": COMM_MODES,
    "layout": LAYOUTS,
    "is_causal": ("False", "True"),
    "runs backward (grad enabled, inputs require grad)": ("False", "True"),
}
# The end of the error for a nested q, k or v: the ring takes neither a padding mask nor packed rows.
_RAGGED_HINT = (
    "RingDilatedAttention takes no padding mask and no packed sequences: give every rank its "
    "(B, N/P, H, D) shard of sequences of one length N"
)


class RingDilatedAttention(NotScriptable, GroupCopies, nn.Module):
    """Dilated attention with the sequence split across the ranks of a process group.

    Each rank calls ``forward`` with its positions ``(B, N/P, H, D)`` of q, k and v (use
    :func:`shard_sequence`) and gets the same positions of the output; together they equal
    :func:`dilated_attention.dilated_attention` on the whole sequence, forward and backward.
    Without an initialised process group, or with a group of one, it runs the local op.

    Args:
        segment_lengths, dilation_rates: the branches (SPEC sections 2-3).
        softmax_scale: multiplies the scores; ``1/sqrt(D)`` by default.
        attention_dropout: must be 0.0 (attention dropout is not supported across ranks).
        process_group: the ranks that share the sequence: a ``ProcessGroup``, a ``DeviceMesh`` (1-D,
            or with ``mesh_dim``), or None for the default group.
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
        check_consistency: compare a fingerprint of the configuration, the shapes and the call
            (the module's number and its calls so far) across ranks before every exchange (one
            small all-gather and one host synchronisation per forward, and per backward that
            exchanges), so that a mismatch, or ranks out of step (a layer skipped on one rank
            only, backwards run in different orders), raises the same ``ValueError`` on every
            rank instead of hanging or returning wrong values. ``"once"`` compares each
            configuration and shape the first time this rank sees it and nothing after: cheaper,
            but ranks that fall out of step are not caught. ``False`` compares only on the first
            call and is unsafe: ranks called with different configurations may then abort inside
            the communication library (gloo: SIGABRT) or return wrong results. Every rank must
            use the same mode; different modes raise on the first call.
        ring_size: the number of ranks expected; a group of another size (larger than one) is an
            error, and a ``ring_size`` above one without a process group warns. None accepts any.
            Under a launcher (``WORLD_SIZE`` above 1) without a process group, forward raises
            (a missing ``torch.distributed.init_process_group(...)``) unless ``ring_size=1``: a
            local run on each process, asked for explicitly.
        layout: ``"contiguous"`` (rank ``j`` holds positions ``[j*N/P, (j+1)*N/P)``, SPEC section
            5) or ``"zigzag"`` (rank ``j`` holds chunks ``j`` and ``2P-1-j`` of ``2P``, which
            balances causal work; shard with ``shard_sequence(x, layout="zigzag")``).
        mesh_dim: with a ``DeviceMesh`` of several dimensions as ``process_group``, the name (or
            index) of the dimension that splits the sequence, e.g. ``"cp"``.

    Every rank must make the same ring calls in the same order, and build its ring modules in the
    same order for a process group: the consistency check numbers modules and calls per
    communicator (see :mod:`.consistency`; :func:`call_key` tags the calls of a training step).
    ``copy.copy`` and ``copy.deepcopy`` share the process group with the copy; ``torch.save`` keeps
    the configuration, not the group (see :meth:`set_process_group`).
    """

    attention_backend: str
    ring_size: int | None
    layout: str
    _selector: BackendSelector
    _ledger: CallLedger
    _per_group = ("_ledger", "_entered")  # renewed by copies, loads and set_process_group
    _caches = ("_plans", "_pieces")  # rebuilt on use

    def __init__(
        self,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        softmax_scale: float | None = None,
        attention_dropout: float = 0.0,
        process_group: GroupLike = None,
        comm: str = "all_gather",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        use_pattern_cache: bool = True,
        enable_memory_pool: bool = False,
        memory_pool_threshold_mb: float = 16.0,
        attention_backend: str = "auto",
        check_consistency: bool | str = True,
        ring_size: int | None = None,
        layout: str = "contiguous",
        *,
        mesh_dim: str | int | None = None,
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
        self.mesh_dim = mesh_dim
        self.process_group = as_process_group(process_group, mesh_dim, who=type(self).__name__)
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
        self.check_consistency = check_consistency
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
        self._reset_per_group_state()

    @property
    def check_consistency(self) -> bool | str:
        """``True``, ``"once"`` or ``False``: see the class docstring. Every rank must use the same."""
        return self._check_consistency

    @check_consistency.setter
    def check_consistency(self, value: bool | str) -> None:
        if not (isinstance(value, bool) or (isinstance(value, str) and value == "once")):
            raise ValueError(f"check_consistency must be True, False or 'once', got {value!r}")
        self._check_consistency = value

    def set_process_group(self, process_group: GroupLike, mesh_dim: str | int | None = None) -> None:
        """Use ``process_group`` (a ``ProcessGroup``, a ``DeviceMesh`` with ``mesh_dim`` where it has
        several dimensions, or None for the default group) from the next call on. A module loaded
        with ``torch.load`` that was saved with an explicit process group needs this before its
        first forward. Every rank of the group must call it alike: the module is then numbered for
        the consistency check as a module built at that moment."""
        self.process_group = as_process_group(process_group, mesh_dim, who=type(self).__name__)
        self.mesh_dim = mesh_dim
        self._reset_per_group_state()

    def _reset_per_group_state(self) -> None:
        """A new number on the group's communicator, no calls, nothing checked: what a module built
        (copied, loaded) now has."""
        self._ledger = CallLedger(self.process_group, type(self).__name__)
        self._entered = 0  # forward calls begun (RingMultiheadDilatedAttention's refusals read it)

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _attention(
            q,
            k,
            v,
            segs,
            rates,
            is_causal=is_causal,
            softmax_scale=scale,
            backend=self.attention_backend,
            selector=self._selector,
        )

    @torch.compiler.disable
    def _check_call(
        self, comm: Comm, q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale: float, runs_backward: bool
    ) -> CallCheck | None:
        """Number this call and compare its fingerprint across the ranks (as ``check_consistency``
        says); returns what the backward compares again (with ``check_consistency=True``). Runs
        eagerly under ``torch.compile``: the call counters change on every call, and the check reads
        its all-gather on the host."""
        mode = self.check_consistency
        config = fingerprint(
            q,
            k,
            self.segment_lengths,
            self.dilation_rates,
            is_causal,
            scale,
            COMM_MODES.index(self.comm),
            LAYOUTS.index(self.layout),
            self.ring_size,
            runs_backward,
            mode,
        )
        return self._ledger.check(comm, config, _FIELD_NAMES, mode)

    @torch.compiler.disable
    def _refuse(self, device: torch.device | None) -> None:
        """This rank refused its inputs to a call: on a group of several ranks, count the call and
        tell the peers where they compare it (``CallLedger.refuse``), so that every rank raises.
        The caller raises its own error."""
        if isinstance(self.process_group, NeedsGroup):
            return
        try:
            group, P, rank = resolve_group(self.process_group, self.ring_size)
        except RuntimeError:
            return
        if P > 1:
            if (device is None or device.type != "cuda") and "nccl" in str(dist.get_backend(group)):
                device = torch.device("cuda", torch.cuda.current_device())  # NCCL moves CUDA tensors only
            self._ledger.refuse(Comm(group, rank, P, device or torch.device("cpu")), self.check_consistency)

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
        self._entered += 1
        try:
            V.check_qkv(q, k, v, ragged_hint=_RAGGED_HINT)
            is_causal = V.check_bool(is_causal, "is_causal")
            return_lse = V.check_bool(return_lse, "return_lse")
            scale = V.check_scale_for_dtype(V.resolve_scale(self.softmax_scale, q.shape[-1]), q.dtype)
        except (TypeError, ValueError):
            self._refuse(q.device if isinstance(q, torch.Tensor) else None)
            raise
        if isinstance(self.process_group, NeedsGroup):
            raise self.process_group.error(type(self).__name__)
        group, P, rank = resolve_group(self.process_group, self.ring_size)
        B, local_len, Hq, _ = q.shape
        if P == 1:
            out, lse = self._local(q, k, v, self.segment_lengths, self.dilation_rates, is_causal, scale)
            return (out, lse) if return_lse else out
        comm = Comm(group, rank, P, q.device)
        runs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        call_check = self._check_call(comm, q, k, is_causal, scale, runs_backward)
        if self.ring_size is not None and P != self.ring_size:  # after the check: every rank raises
            raise ValueError(f"ring_size={self.ring_size} but the process group has {P} ranks")
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
        # The node runs the exchange (which every rank joins whenever any two ranks exchange, see
        # Plan.joins_exchange), the local runs on the fused op, and gives a rank that holds no
        # position any head reads its out 0 and lse -inf.
        if fused or plan.joins_exchange or not outs:
            local_runs = plan.local_runs if fused else []
            job = SpanJob(
                plan, comm, self._piece_attention(q, k), self.comm, scale, is_causal, local_runs, call_check
            )
            o, lse = SpanAttention.apply(q, k, v, job, _MODES[self.comm])
            outs.append(o)
            lses.append(lse)
        acc = accumulation_dtype(q.dtype)
        out, lse = merge(outs, [x.to(acc) for x in lses])
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out
