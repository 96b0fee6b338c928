"""The check that every rank of the group was called with the same configuration and shapes,
and that the ranks are in step: the calls they pair are the same call of the same module.

Ranks that disagree (different branches, chunk lengths, dtypes, ...) would otherwise exchange
messages of different sizes, which hangs, aborts inside the communication library, or returns
wrong values without an error. Ranks that agree on the configuration can still pair different
calls: the exchanges are matched by the order in which the ranks make them, so a rank that skips
a layer its peers run (LayerDrop drawn per rank), or runs the backwards of two graphs in another
order, would exchange the keys of one call with those of another and return wrong values. Before
the exchange, the ranks all-gather a fingerprint of a few int64 (the configuration, the shapes,
the ``check_consistency`` mode, and which call this is: the module's number, its forward calls so
far, forward or backward) and, when they differ, all raise the same ``ValueError`` naming the
values per rank (global rank numbers).

By default (``check_consistency=True``) the check runs on every forward and on every backward
that exchanges: one small all-gather and one host synchronisation each. ``"once"`` checks each
configuration and shape once per rank and nothing after (:class:`ConsistencyCheck` remembers
them); it cannot catch ranks that meet configurations they all checked before in a different
order, nor a rank that meets a shape for the first time while the others call with one they
already checked, nor ranks out of step: their exchange meets its check and fails with the
library's error, after the group's timeout, or with wrong values. ``check_consistency=False``
skips the check and is unsafe: ranks called with different configurations may then abort inside
the library (gloo raises SIGABRT) or return wrong results. Whatever the mode, a module's first
call on a group, and its first call after its mode changed, sends the fingerprint, so that ranks
whose modes differ are told which setting differs at once instead of waiting for the timeout.
"""

from __future__ import annotations

import struct

import torch

from .. import _validation as V
from .transport import Comm

__all__ = ["CHECK_MODES", "PHASES", "CallCheck", "ConsistencyCheck", "fingerprint"]

CHECK_MODES: tuple[bool | str, ...] = (False, True, "once")
PHASES = ("forward", "backward")
# The fields that change from call to call (not part of what "once" remembers).
_PER_CALL = ("module", "call of the module", "phase")
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
    mode: bool | str = True,
    module: int = 0,
    call: int = 0,
) -> dict[str, int]:
    """The fields the ranks must agree on, as int64. ``runs_backward``: whether this call's
    outputs will have a backward (grad enabled and an input that requires grad), which exchanges
    again; ``ring_size``: the module's, 0 for None; ``mode``: the module's ``check_consistency``;
    ``module`` and ``call``: which call this is (the module's number in the order this process
    built its ring modules for the group, and its forward calls before this one). The phase is
    ``forward``; :class:`CallCheck` sends the same fields as ``backward``."""
    B, chunk, Hq, D = q.shape
    fields = {
        "magic": _MAGIC,
        "check_consistency": CHECK_MODES.index(mode),
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
    fields["module"] = module
    fields["call of the module"] = call
    fields["phase"] = 0
    return fields


def _describe(name: str, value: int, names: dict[str, tuple[str, ...]]) -> str:
    if name == "dtype":
        inv = {c: str(t).replace("torch.", "") for t, c in _DTYPE_CODES.items()}
        return inv.get(value, str(value))
    if name == "softmax_scale":
        return repr(_bits_float(value))
    if name == "ring_size" and value == 0:
        return "None"
    if name == "check_consistency" and 0 <= value < len(CHECK_MODES):
        return repr(CHECK_MODES[value])
    if name == "phase" and 0 <= value < len(PHASES):
        return PHASES[value]
    if name in names and 0 <= value < len(names[name]):
        return names[name][value]
    return str(value)


_OUT_OF_STEP = (
    " (each rank pairs its exchanges with its peers' by the order of the calls, "
    "so every rank must call the same ring modules in the same order, forward and backward. "
    "module: the order in which this process built the module for this process group, so every "
    "rank must build its ring modules in the same order; call of the module: its forward calls "
    "before this one. Skip the same layers on every rank (draw LayerDrop with the same seed "
    "everywhere), and run the backwards of several graphs in the same order on every rank)"
)


class ConsistencyCheck:
    """Compares this rank's fingerprint with its group's: on every call (mode True), or once per
    fingerprint and group (``"once"``), remembering those it has checked; in every mode on the
    first call on a group and on the first call after the mode changed."""

    def __init__(self) -> None:
        self._checked: set[tuple] = set()
        self._agreed: tuple | None = None  # (group, P, mode) of the last fingerprint sent

    def __call__(
        self, comm: Comm, fields: dict[str, int], names: dict[str, tuple[str, ...]], mode: bool | str
    ) -> None:
        """Raise ``ValueError`` on every rank when the ranks' fingerprints (or their modes) differ."""
        group = (id(comm.group), comm.P)
        key = (group, tuple(v for name, v in fields.items() if name not in _PER_CALL))
        agreed = self._agreed == (*group, mode)
        if agreed and (mode is False or (mode == "once" and key in self._checked)):
            return
        compare(comm, fields, names)
        self._agreed = (*group, mode)
        if mode == "once":
            self._checked.add(key)


class CallCheck:
    """The fingerprint of one forward call, compared again before its backward's exchange, so that
    ranks running the backwards of several calls in different orders raise instead of pairing
    one call's gradients with another's."""

    def __init__(self, fields: dict[str, int], names: dict[str, tuple[str, ...]]) -> None:
        self.fields, self.names = dict(fields), names

    def backward(self, comm: Comm) -> None:
        """Raise ``ValueError`` on every rank when the ranks are in the backwards of different calls."""
        compare(comm, {**self.fields, "phase": PHASES.index("backward")}, self.names)


def compare(comm: Comm, fields: dict[str, int], names: dict[str, tuple[str, ...]]) -> None:
    """All-gather ``fields`` over the group; raise the same ``ValueError`` on every rank, naming
    the values that differ per global rank, when any rank's differ."""
    mine = torch.tensor(list(fields.values()), dtype=torch.int64)
    table = torch.stack(comm.all_gather(mine, "check")).cpu().tolist()
    if all(row == table[0] for row in table):
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
    what = "were called with different configurations or shapes"
    hint = ""
    if any(d.startswith("chunk length") for d in diffs):
        hint = (
            " (every rank must hold N / P positions: N must be divisible by P; split the sequence "
            "with dilated_attention.ring.shard_sequence)"
        )
    elif any(d.startswith("check_consistency") for d in diffs):
        what = "use different settings"
        hint = " (give every rank the same check_consistency)"
    elif all(d.split(":")[0] in _PER_CALL for d in diffs):
        what = "are out of step"
        hint = _OUT_OF_STEP
    raise ValueError(f"RingDilatedAttention: the ranks of the group {what}: " + "; ".join(diffs) + hint)
