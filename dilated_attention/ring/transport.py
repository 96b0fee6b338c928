"""Moving bytes between the ranks of a group, and counting them.

:class:`Comm` wraps the two calls the exchange modes use, ``all_to_all_single`` and
``batch_isend_irecv``, with clear errors (a peer that does not answer surfaces after the group's
timeout as a ``RuntimeError`` that says what was being exchanged) and byte counting
(:func:`comm_stats`). Tensors travel as flat ``uint8``: one message per peer and step, whatever
the dtypes inside. NCCL moves CUDA tensors; gloo moves CPU tensors (CUDA data is staged through
the host).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import cast

import torch
import torch.distributed as dist

__all__ = [
    "Comm",
    "Pending",
    "as_bytes",
    "comm_stats",
    "from_bytes",
    "reset_comm_stats",
    "resolve_group",
]

_STATS: dict[str, dict[str, float]] = {}


def _count(phase: str, sent: int, received: int, seconds: float = 0.0) -> None:
    entry = _STATS.setdefault(phase, {"sent": 0, "received": 0, "calls": 0, "wait_s": 0.0})
    entry["sent"] += int(sent)
    entry["received"] += int(received)
    entry["calls"] += 1
    entry["wait_s"] += seconds


def comm_stats() -> dict[str, dict[str, float]]:
    """Bytes this process sent to and received from other ranks since the last reset.

    Keys: ``"check"`` (the configuration fingerprint), ``"forward"`` and ``"backward"`` (keys,
    values and their gradients of spanning segments); each maps to ``{"sent", "received",
    "calls", "wait_s"}``, where ``wait_s`` is the time this process spent in the calls and
    waiting for their completion (communication not hidden behind computation). Bytes a rank
    keeps for itself are not counted.
    """
    return {phase: dict(entry) for phase, entry in _STATS.items()}


def reset_comm_stats() -> None:
    """Set the counters of :func:`comm_stats` to zero."""
    _STATS.clear()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return buf.view(dtype).to(device)


def resolve_group(
    process_group: dist.ProcessGroup | int | None,
    ring_size: int | None = None,
    who: str = "RingDilatedAttention",
) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, size, rank)`` of this process; size 1 when torch.distributed is not initialised.

    Without a process group, a ``WORLD_SIZE`` above 1 in the environment (torchrun sets it) or a
    ``ring_size`` above 1 means the caller meant to split the sequence: that warns, since every
    process would then treat its chunk as the whole sequence. A process that is not a member of
    ``process_group`` (``dist.new_group`` returns ``GroupMember.NON_GROUP_MEMBER`` there) raises.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError(
                f"{who}: a process_group was given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first"
            )
        world = os.environ.get("WORLD_SIZE", "1")
        if (world.isdigit() and int(world) > 1) or (ring_size is not None and ring_size > 1):
            warnings.warn(
                f"{who}: ring_size={ring_size}, WORLD_SIZE={world}, but no process group is initialised: "
                "each process computes the tensor it was given as the whole sequence. Call "
                "torch.distributed.init_process_group first to split the sequence across the processes.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None, 1, 0
    if process_group is None:
        return None, dist.get_world_size(), dist.get_rank()
    if isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise RuntimeError(
            f"{who}: this process (global rank {dist.get_rank()}) is not a member of the process_group "
            "it was given (dist.new_group returned NON_GROUP_MEMBER here); call forward only on the "
            "group's members"
        )
    # The one int a group argument can be is NON_GROUP_MEMBER, refused above.
    group = cast(dist.ProcessGroup, process_group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError(
            f"{who}: this process (global rank {dist.get_rank()}) is not a member of the process_group given"
        )
    return group, dist.get_world_size(group), rank


class Comm:
    """Collective and point-to-point calls on one group, with byte counting and clear errors."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, P: int, device: torch.device) -> None:
        self.group, self.rank, self.P = group, rank, P
        self.backend = str(dist.get_backend(group))
        self.device = device if (device.type == "cuda" and "nccl" in self.backend) else torch.device("cpu")

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def fail(self, what: str, err: Exception) -> RuntimeError:
        return RuntimeError(
            f"RingDilatedAttention (rank {self.global_rank(self.rank)}, {self.rank} of {self.P} in its group, "
            f"{self.backend}): {what} failed: {err}. A peer that does not answer surfaces here after the "
            "process group's timeout: every rank of the group must call forward (and backward) with the same "
            "configuration."
        )

    def all_gather(self, t: torch.Tensor, phase: str) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape everywhere), by group rank."""
        t = t.to(self.device)
        rows = [torch.empty_like(t) for _ in range(self.P)]
        start = time.perf_counter()
        try:
            dist.all_gather(rows, t, group=self.group)
        except RuntimeError as err:
            raise self.fail(f"the {phase} all_gather", err) from err
        nbytes = t.numel() * t.element_size() * (self.P - 1)
        _count(phase, nbytes, nbytes, time.perf_counter() - start)
        return rows

    def all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], phase: str
    ) -> torch.Tensor:
        """Bytes ``send`` (uint8) cut by ``send_splits`` per destination; returns the bytes received."""
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        start = time.perf_counter()
        try:
            dist.all_to_all_single(recv, send.to(self.device), recv_splits, send_splits, group=self.group)
        except RuntimeError as err:
            raise self.fail(f"the {phase} all-to-all exchange", err) from err
        _count(
            phase,
            sum(send_splits) - send_splits[self.rank],
            sum(recv_splits) - recv_splits[self.rank],
            time.perf_counter() - start,
        )
        return recv

    def post(
        self, sends: dict[int, torch.Tensor], recv_sizes: dict[int, int], tag: int, phase: str
    ) -> Pending:
        """Start point-to-point transfers: ``sends`` {peer: uint8 bytes}, ``recv_sizes`` {peer: bytes}.
        Receives are posted before sends, each in peer order."""
        start = time.perf_counter()
        ops, recvs = [], {}
        for peer, nbytes in sorted(recv_sizes.items()):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            recvs[peer] = buf
            ops.append(dist.P2POp(dist.irecv, buf, self.global_rank(peer), self.group, tag))
        staged = {}
        for peer, data in sorted(sends.items()):
            staged[peer] = data.to(self.device)
            ops.append(dist.P2POp(dist.isend, staged[peer], self.global_rank(peer), self.group, tag))
        works = []
        if ops:
            try:
                works = dist.batch_isend_irecv(ops)
            except RuntimeError as err:
                raise self.fail(f"the {phase} point-to-point exchange", err) from err
        _count(
            phase,
            sum(int(t.numel()) for t in staged.values()),
            sum(recv_sizes.values()),
            time.perf_counter() - start,
        )
        return Pending(self, works, recvs, staged, phase)


class Pending:
    """Transfers in flight; :meth:`wait` returns the received bytes per peer."""

    def __init__(
        self,
        comm: Comm,
        works: list,
        recvs: dict[int, torch.Tensor],
        staged: dict[int, torch.Tensor],
        phase: str,
    ) -> None:
        self.comm, self.works, self.recvs, self.staged, self.phase = comm, works, recvs, staged, phase

    def wait(self) -> dict[int, torch.Tensor]:
        start = time.perf_counter()
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as err:
            raise self.comm.fail(f"the {self.phase} point-to-point exchange", err) from err
        self.works, self.staged = [], {}
        _STATS.setdefault(self.phase, {"sent": 0, "received": 0, "calls": 0, "wait_s": 0.0})
        _STATS[self.phase]["wait_s"] += time.perf_counter() - start
        return self.recvs
