"""The check that every rank of the group was called with the same configuration and shapes.

Ranks that disagree (different branches, chunk lengths, dtypes, ...) would otherwise exchange
messages of different sizes, which hangs, aborts inside the communication library, or returns
wrong values without an error. Before the exchange, the ranks all-gather a fingerprint of a few
int64 and, when they differ, all raise the same ``ValueError`` naming the values per rank (global
rank numbers).

By default the check runs on every call: one small all-gather and one host synchronisation per
forward. Ranks that fall out of step between two configurations they have all used before (one
rank in training mode, another in evaluation; one at a new length) are caught as the first time.
``check_consistency="once"`` checks each configuration and shape once per rank and nothing after
(:class:`ConsistencyCheck` remembers them); it cannot catch ranks that meet configurations they
all checked before in a different order, nor a rank that meets a shape for the first time while
the others call with one they already checked: their exchange meets its check and fails with the
library's error, after the group's timeout, or with wrong values. ``check_consistency=False``
skips the check altogether and is unsafe: ranks called with different configurations may then
abort inside the library (gloo raises SIGABRT) or return wrong results.
"""

from __future__ import annotations

import struct

import torch

from .. import _validation as V
from .transport import Comm

__all__ = ["ConsistencyCheck"]

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_MAGIC = 0x44_41_52_49  # "DARI"


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(x)))[0]


def fingerprint(
    q: torch.Tensor,
    k: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    scale: float,
    comm_mode: int,
    layout: int,
    ring_size: int | None = None,
    runs_backward: bool = False,
) -> dict[str, int]:
    """The fields the ranks must agree on, as int64. ``runs_backward``: whether this call's
    outputs will have a backward (grad enabled and an input that requires grad), which exchanges
    again; ``ring_size``: the module's, 0 for None."""
    B, chunk, Hq, D = q.shape
    fields = {
        "magic": _MAGIC,
        "ring_size": 0 if ring_size is None else ring_size,
        "runs backward (grad enabled, inputs require grad)": int(runs_backward),
        "batch size B": B,
        "chunk length N/P": chunk,
        "query heads": Hq,
        "key/value heads": k.shape[2],
        "head dim D": D,
        "dtype": _DTYPE_CODES[q.dtype],
        "is_causal": int(is_causal),
        "comm": comm_mode,
        "layout": layout,
        "number of branches": len(segment_lengths),
        "softmax_scale": _float_bits(scale),
    }
    for i in range(V.MAX_BRANCHES):
        fields[f"segment_lengths[{i}]"] = segment_lengths[i] if i < len(segment_lengths) else 0
        fields[f"dilation_rates[{i}]"] = dilation_rates[i] if i < len(dilation_rates) else 0
    return fields


def _describe(name: str, value: int, names: dict[str, tuple[str, ...]]) -> str:
    if name == "dtype":
        inv = {c: str(t).replace("torch.", "") for t, c in _DTYPE_CODES.items()}
        return inv.get(value, str(value))
    if name == "softmax_scale":
        return repr(_bits_float(value))
    if name == "ring_size" and value == 0:
        return "None"
    if name in names and 0 <= value < len(names[name]):
        return names[name][value]
    return str(value)


class ConsistencyCheck:
    """Compares this rank's fingerprint with its group's: on every call, or (``once``) once per
    fingerprint and group, remembering those it has checked."""

    def __init__(self, once: bool = False) -> None:
        self.once = once
        self._checked: set[tuple] = set()

    def __call__(self, comm: Comm, fields: dict[str, int], names: dict[str, tuple[str, ...]]) -> None:
        """Raise ``ValueError`` on every rank when the ranks' fingerprints differ."""
        # The default group is None (torch.compile in PyTorch 2.11 cannot trace id(None)).
        key = (None if comm.group is None else id(comm.group), comm.P, tuple(fields.values()))
        if self.once and key in self._checked:
            return
        mine = torch.tensor(list(fields.values()), dtype=torch.int64)
        table = torch.stack(comm.all_gather(mine, "check")).cpu().tolist()
        if all(row == table[0] for row in table):
            if self.once:
                self._checked.add(key)
            return
        if any(row[0] != _MAGIC for row in table):
            raise ValueError(
                "RingDilatedAttention: another collective ran on the process group at the same time as "
                "the consistency check; every rank must call forward together"
            )
        ranks = [comm.global_rank(r) for r in range(comm.P)]
        diffs = []
        for col, name in enumerate(fields):
            values = [row[col] for row in table]
            if len(set(values)) > 1:
                shown = ", ".join(
                    f"rank {g}: {_describe(name, x, names)}" for g, x in zip(ranks, values, strict=True)
                )
                diffs.append(f"{name}: {shown}")
        hint = ""
        if any(d.startswith("chunk length") for d in diffs):
            hint = (
                " (every rank must hold N / P positions: N must be divisible by P; split the sequence "
                "with dilated_attention.ring.shard_sequence)"
            )
        raise ValueError(
            "RingDilatedAttention: the ranks of the group were called with different configurations or "
            f"shapes{hint}: " + "; ".join(diffs)
        )
