"""Moving bytes between the ranks of a group, and counting them.

:class:`Comm` wraps the two calls the exchange modes use, ``all_to_all_single`` and
``batch_isend_irecv``, with clear errors (a peer that does not answer surfaces after the group's
timeout as a ``RuntimeError`` that says what was being exchanged) and byte counting
(:func:`comm_stats`). Tensors travel as flat ``uint8``: one message per peer and step, whatever
the dtypes inside. NCCL moves CUDA tensors; gloo moves CPU tensors (CUDA data is staged through
the host).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = [
    "Comm",
    "Pending",
    "as_bytes",
    "comm_stats",
    "from_bytes",
    "reset_comm_stats",
]

_STATS: dict[str, dict[str, float]] = {}
_TIMING = [False]  # whether wait_s is measured (host timers): only when asked, see reset_comm_stats


def _count(phase: str, sent: int, received: int, seconds: float = 0.0) -> None:
    if torch.compiler.is_compiling():
        # Not in a compiled graph: Dynamo would guard on the counters' values and compile the
        # module again at every call (then fall back to eager once its cache is full).
        return
    entry = _STATS.setdefault(phase, {"sent": 0, "received": 0, "calls": 0, "wait_s": 0.0})
    entry["sent"] += int(sent)
    entry["received"] += int(received)
    entry["calls"] += 1
    entry["wait_s"] += seconds


def _now() -> float:
    """The host clock when timing was asked for, else 0 (no host call on the traced path)."""
    return time.perf_counter() if _TIMING[0] else 0.0


def comm_stats() -> dict[str, dict[str, float]]:
    """Bytes this process sent to and received from other ranks since the last reset.

    Keys: ``"check"`` (the configuration fingerprint), ``"forward"`` and ``"backward"`` (keys,
    values and their gradients of spanning segments); each maps to ``{"sent", "received",
    "calls", "wait_s"}``, where ``wait_s`` is the time this process spent in the calls and
    waiting for their completion (communication not hidden behind computation), measured only
    after ``reset_comm_stats(timing=True)`` (0 otherwise). Bytes a rank keeps for itself are not
    counted, nor the calls of code compiled by ``torch.compile`` (counting there would make every
    call recompile).
    """
    return {phase: dict(entry) for phase, entry in _STATS.items()}


def reset_comm_stats(timing: bool | None = None) -> None:
    """Set the counters of :func:`comm_stats` to zero. ``timing=True`` also measures ``wait_s``
    from then on (host timers around every call: for benchmarks, not under ``torch.compile``),
    ``timing=False`` stops it, None leaves it as it is (off at import)."""
    _STATS.clear()
    if timing is not None:
        _TIMING[0] = bool(timing)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return buf.view(dtype).to(device)


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
            "process group's timeout: a rank stopped or lost its connection, or did not call forward (and "
            "backward) together with the others."
        )

    def all_gather(self, t: torch.Tensor, phase: str) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape everywhere), by group rank."""
        t = t.to(self.device)
        rows = [torch.empty_like(t) for _ in range(self.P)]
        start = _now()
        try:
            dist.all_gather(rows, t, group=self.group)
        except RuntimeError as err:
            raise self.fail(f"the {phase} all_gather", err) from err
        nbytes = t.numel() * t.element_size() * (self.P - 1)
        _count(phase, nbytes, nbytes, _now() - start)
        return rows

    def all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], phase: str
    ) -> torch.Tensor:
        """Bytes ``send`` (uint8) cut by ``send_splits`` per destination; returns the bytes received."""
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        start = _now()
        try:
            dist.all_to_all_single(recv, send.to(self.device), recv_splits, send_splits, group=self.group)
        except RuntimeError as err:
            raise self.fail(f"the {phase} all-to-all exchange", err) from err
        _count(
            phase,
            sum(send_splits) - send_splits[self.rank],
            sum(recv_splits) - recv_splits[self.rank],
            _now() - start,
        )
        return recv

    def post(
        self, sends: dict[int, torch.Tensor], recv_sizes: dict[int, int], tag: int, phase: str
    ) -> Pending:
        """Start point-to-point transfers: ``sends`` {peer: uint8 bytes}, ``recv_sizes`` {peer: bytes}.
        Receives are posted before sends, each in peer order."""
        start = _now()
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
            _now() - start,
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
        start = _now()
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as err:
            raise self.comm.fail(f"the {self.phase} point-to-point exchange", err) from err
        self.works, self.staged = [], {}
        _STATS.setdefault(self.phase, {"sent": 0, "received": 0, "calls": 0, "wait_s": 0.0})
        _STATS[self.phase]["wait_s"] += _now() - start
        return self.recvs
