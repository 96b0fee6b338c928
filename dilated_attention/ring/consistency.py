"""The check that every rank of the group was called with the same configuration and shapes,
and that the ranks are in step: the calls they pair are the same call of the same module.

Ranks that disagree (different branches, chunk lengths, dtypes, ...) would otherwise exchange
messages of different sizes, which hangs, aborts inside the communication library, or returns
wrong values without an error. Ranks that agree on the configuration can still pair different
calls: the exchanges are matched by the order in which the ranks make them on a communicator, so
a rank that skips a layer its peers run (LayerDrop drawn per rank), runs the backwards of two
graphs in another order, or calls two modules in another order, would exchange the keys of one
call with those of another and return wrong values. Before the exchange, the ranks all-gather a
fingerprint of a few int64 (the configuration, the shapes, the ``check_consistency`` mode, and
which call this is: the module's number, its forward calls so far, the calls so far on the
communicator, the caller's :func:`call_key`, forward or backward) and, when they differ, all
raise the same ``ValueError`` naming the values per rank (global rank numbers).

Calls are counted per communicator, whatever object names it (``process_group=None``,
``dist.group.WORLD`` and a 1-D ``DeviceMesh`` over the world are one communicator:
:func:`~.groups.communicator_key`). A call that one rank refuses (its own input checks raise)
still takes its place in the sequence: the refusing rank joins the comparison with a refusal, so
every rank raises and the next call pairs with the next call (:meth:`CallLedger.refuse`).

By default (``check_consistency=True``) the check runs on every forward and on every backward
that exchanges: one small all-gather and one host synchronisation each. ``"once"`` checks each
configuration and shape once per rank and nothing after (:class:`CallLedger` remembers them); it
cannot catch ranks out of step, nor a call refused on some ranks only. ``check_consistency=False``
skips the check and is unsafe. Whatever the mode, a module's first call on a group, and its first
call after its mode changed, sends the fingerprint, so that ranks whose modes differ are told which
setting differs at once instead of waiting for the timeout.

What no fingerprint can see: ranks that skip the same number of calls in a row (a whole training
step skipped on one rank) make sequences that differ only by a shift. Tag the calls with the step
(``with call_key(step):``) and the first mismatched call raises. ``DILATED_ATTENTION_RING_DEBUG=1``
(on every rank) checks every call whatever the modules' modes, logs each call, and on a mismatch
names each rank's previous calls and where each module was built.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import logging
import os
import struct
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import _validation as V
from .groups import communicator_key
from .transport import Comm

__all__ = [
    "CHECK_MODES",
    "DEBUG_ENV",
    "PHASES",
    "CallCheck",
    "CallLedger",
    "call_key",
    "compare",
    "debug_mode",
    "fingerprint",
]

logger = logging.getLogger(__name__)

CHECK_MODES: tuple[bool | str, ...] = (False, True, "once")
PHASES = ("forward", "backward")
DEBUG_ENV = "DILATED_ATTENTION_RING_DEBUG"
# The fields that change from call to call (not part of what "once" remembers).
_PER_CALL = ("module", "call of the module", "call on the process group", "call_key", "phase")
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_MAGIC = 0x44_41_52_49  # "DARI"
_NO_KEY = -(2**63)  # call_key outside any `with call_key(...)`
_HISTORY = 8  # calls per communicator that the debug mode names on a mismatch

_KEY: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "dilated_attention_ring_call_key", default=None
)
# Per communicator: the numbers of the ring modules this process built for it, in order, and the
# number of its calls so far. Ranks that build and call alike give the same values.
_NUMBERS: dict[Any, itertools.count] = {}
_SEQUENCE: dict[Any, int] = {}
# Per communicator, this process's last calls (debug mode).
_RECENT: dict[Any, collections.deque] = {}


@contextlib.contextmanager
def call_key(key: int) -> Iterator[None]:
    """Tag the ring calls made inside the block (forward, and the backward of those calls) with
    ``key``, an int that every rank gives alike for the same call, such as the training step::

        for step, batch in enumerate(loader):
            with dilated_attention.ring.call_key(step):
                loss = model(batch)
            loss.backward()

    Ranks whose paired calls carry different keys raise ``ValueError`` naming the keys per rank
    (with ``check_consistency=True``, the default): a step skipped on one rank is otherwise
    invisible to the check, which sees the same sequence of calls shifted by one step."""
    if isinstance(key, bool) or not isinstance(key, int) or key == _NO_KEY or not -(2**63) < key < 2**63:
        raise TypeError(f"call_key takes an int of 64 bits (e.g. the training step), got {key!r}")
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


def debug_mode() -> bool:
    """Whether ``DILATED_ATTENTION_RING_DEBUG`` asks for the debug mode (``1``); ``0`` or unset: no."""
    value = os.environ.get(DEBUG_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{DEBUG_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(x)))[0]


def _fields(**given: int) -> dict[str, int]:
    """Every field of the fingerprint, in the order every rank sends them; 0 where not given."""
    names = [
        "magic",
        "refused (the rank's own checks refused its inputs)",
        "debug",
        "check_consistency",
        "ring_size",
        "runs backward (grad enabled, inputs require grad)",
        "batch size B",
        "chunk length N/P",
        "query heads",
        "key/value heads",
        "head dim D",
        "dtype",
        "is_causal",
        "comm",
        "layout",
        "number of branches",
        "softmax_scale",
        *(f"{kind}[{i}]" for i in range(V.MAX_BRANCHES) for kind in ("segment_lengths", "dilation_rates")),
        *_PER_CALL,
    ]
    unknown = set(given) - set(names)
    assert not unknown, unknown
    return {name: int(given.get(name, 0)) for name in names}


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
) -> dict[str, int]:
    """The configuration fields the ranks must agree on, as int64 (the per-call fields are 0 until
    :meth:`CallLedger.check` numbers the call). ``runs_backward``: whether this call's outputs will
    have a backward (grad enabled and an input that requires grad), which exchanges again;
    ``ring_size``: the module's, 0 for None; ``mode``: the module's ``check_consistency``."""
    B, chunk, Hq, D = q.shape
    fields = {
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
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
        fields[f"segment_lengths[{i}]"] = w
        fields[f"dilation_rates[{i}]"] = r
    return _fields(magic=_MAGIC, **fields)


def _describe(name: str, value: int, names: dict[str, tuple[str, ...]]) -> str:
    if name == "dtype":
        inv = {c: str(t).replace("torch.", "") for t, c in _DTYPE_CODES.items()}
        return inv.get(value, str(value))
    if name == "softmax_scale":
        return repr(_bits_float(value))
    if name == "ring_size" and value == 0:
        return "None"
    if name == "call_key" and value == _NO_KEY:
        return "none"
    if name == "check_consistency" and 0 <= value < len(CHECK_MODES):
        return repr(CHECK_MODES[value])
    if name == "phase" and 0 <= value < len(PHASES):
        return PHASES[value]
    if name in names and 0 <= value < len(names[name]):
        return names[name][value]
    return str(value)


_OUT_OF_STEP = (
    " (each rank pairs its exchanges with its peers' by the order of the calls on the process group, "
    "so every rank must call the same ring modules in the same order, forward and backward. "
    "module: the order in which this process built the module for this process group, so every "
    "rank must build its ring modules in the same order; call of the module: its forward calls "
    "before this one; call on the process group: the ring calls on this communicator before this one, "
    "whatever object names it (None, dist.group.WORLD, a DeviceMesh); call_key: the key of "
    "dilated_attention.ring.call_key. Skip the same layers and steps on every rank (draw LayerDrop "
    "with the same seed everywhere), and run the backwards of several graphs in the same order on "
    f"every rank; {DEBUG_ENV}=1 on every rank names each rank's previous calls)"
)


def _built_at() -> str:
    """``file:line`` of the first caller outside this package and torch: where a module was built."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/dilated_attention/" not in path and "/torch/" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class CallLedger:
    """One ring module's place in the sequence of calls on its communicator: its number (the order
    in which this process built its ring modules for the communicator), its calls so far, and what
    ``"once"`` has checked. A module gets a new ledger when built, copied, loaded or given another
    group."""

    def __init__(self, group: Any, who: str) -> None:
        self.key = communicator_key(group)
        self.number = next(_NUMBERS.setdefault(self.key, itertools.count()))
        self.calls = 0
        self.label = f"{who} #{self.number} built at {_built_at()}"
        self._checked: set[tuple] = set()
        self._agreed: tuple | None = None  # (P, mode) of the last fingerprint sent

    def _count(self, debug: bool, phase: str = "forward") -> dict[str, int]:
        """Number this forward call: the per-call fields of its fingerprint."""
        call, self.calls = self.calls, self.calls + 1
        seq = _SEQUENCE.get(self.key, 0)
        _SEQUENCE[self.key] = seq + 1
        key = _KEY.get()
        fields = {
            "module": self.number,
            "call of the module": call,
            "call on the process group": seq,
            "call_key": _NO_KEY if key is None else key,
        }
        if debug:
            what = f"call {seq}: {self.label}, call {call} of the module, {phase}" + (
                "" if key is None else f", call_key {key}"
            )
            _RECENT.setdefault(self.key, collections.deque(maxlen=_HISTORY)).append(what)
            logger.info("ring %s", what)
        return fields

    def _checks(self, mode: bool | str, P: int, debug: bool) -> bool:
        """Whether this call sends its fingerprint (peers of the same mode send theirs too)."""
        return debug or mode is True or self._agreed != (P, mode)

    def check(
        self, comm: Comm, config: dict[str, int], names: dict[str, tuple[str, ...]], mode: bool | str
    ) -> CallCheck | None:
        """Number this call and compare its fingerprint (``config`` from :func:`fingerprint`)
        across the ranks as ``mode`` says; raise ``ValueError`` on every rank when they differ.
        Returns what the backward compares again (mode True or the debug mode)."""
        debug = debug_mode()
        fields = {**config, **self._count(debug), "debug": int(debug)}
        once_key = tuple(v for name, v in fields.items() if name not in _PER_CALL)
        if self._checks(mode, comm.P, debug) or (mode == "once" and once_key not in self._checked):
            compare(comm, fields, names, self.key)
            self._agreed = (comm.P, mode)
            if mode == "once":
                self._checked.add(once_key)
        return CallCheck(fields, names, self.key) if (mode is True or debug) else None

    def refuse(self, comm: Comm, mode: bool | str) -> None:
        """This rank's checks refused its inputs to this call: count the call, and where the peers
        compare this call's fingerprint (mode True, the debug mode, or the module's first call),
        join them with a refusal, so that every rank raises and the ranks stay in step. Returns
        normally: the caller raises its own error."""
        debug = debug_mode()
        fields = _fields(magic=_MAGIC, **self._count(debug), debug=int(debug))
        fields["refused (the rank's own checks refused its inputs)"] = 1
        fields["check_consistency"] = CHECK_MODES.index(mode)
        if self._checks(mode, comm.P, debug):
            with contextlib.suppress(ValueError):
                compare(comm, fields, {}, self.key)
            self._agreed = (comm.P, mode)


class CallCheck:
    """The fingerprint of one forward call, compared again before its backward's exchange, so that
    ranks running the backwards of several calls in different orders raise instead of pairing
    one call's gradients with another's."""

    def __init__(self, fields: dict[str, int], names: dict[str, tuple[str, ...]], key: Any = None) -> None:
        self.fields, self.names, self.key = dict(fields), names, key

    def backward(self, comm: Comm) -> None:
        """Raise ``ValueError`` on every rank when the ranks are in the backwards of different calls."""
        compare(comm, {**self.fields, "phase": PHASES.index("backward")}, self.names, self.key)


def _history(comm: Comm, key: Any) -> str:
    """Each rank's last calls on the communicator (debug mode, every rank in it): one more collective."""
    mine = list(_RECENT.get(key, ()))
    table: list[Any] = [None] * comm.P
    dist.all_gather_object(table, mine, group=comm.group)
    lines = [
        f"rank {comm.global_rank(r)}: " + (" | ".join(calls) if calls else "no calls")
        for r, calls in enumerate(table)
    ]
    return f". {DEBUG_ENV}: the last calls of each rank on this process group, oldest first: " + "; ".join(
        lines
    )


def compare(comm: Comm, fields: dict[str, int], names: dict[str, tuple[str, ...]], key: Any = None) -> None:
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
    column = list(fields)
    refused = [g for g, row in zip(ranks, table, strict=True) if row[1]]
    if refused:
        at = column.index("call on the process group")
        raise ValueError(
            f"RingDilatedAttention: rank(s) {refused} refused their inputs to this call (their own error "
            f"says why; call on the process group: {table[0][at]}), so every rank of the group raises "
            "and the ranks stay in step"
        )
    diffs = []
    for col, name in enumerate(column):
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
    elif any(d.startswith(("check_consistency", "debug")) for d in diffs):
        what = "use different settings"
        hint = f" (give every rank the same check_consistency, and the same {DEBUG_ENV})"
    elif all(d.split(":")[0] in _PER_CALL for d in diffs):
        what = "are out of step"
        hint = _OUT_OF_STEP
    if all(row[column.index("debug")] for row in table):
        hint += _history(comm, key)
    raise ValueError(f"RingDilatedAttention: the ranks of the group {what}: " + "; ".join(diffs) + hint)
