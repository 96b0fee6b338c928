"""The kernel launches of the sdpa backend's C++ driver on CUDA (``csrc/views/views.cpp``:
``views_fwd`` and ``views_bwd``), counted from its plan.

The driver runs every kernel call of the plan (:func:`.strided.plan_branches`, grouped-query
heads kept, their key/value heads repeated on CUDA) once per batch run, except that the calls whose phases and
heads step evenly (the phases of a branch) run as one kernel call, their index as its batch dim:
:func:`driver_calls` asks the extension for the calls the driver makes (``views/plan.h``
``driver_calls``). Where the batch entries or segments are several too, the run's rows are first
gathered into one contiguous batch (one launch for q, k and v). A branch whose grouped-query heads
take fewer calls with every query head its own key/value head runs on k and v repeated to Hq heads
(the plan of ``Hkv = Hq``), repeated once a direction for every such branch and their gradients
summed per key/value head once (``views/plan.h`` ``Plan::repeated``). What it launches per kernel call
and once per direction is what the functions below add up, branch by branch, from the same
conditions as the driver's code (a call of one row and one key runs in closed form; a stride-0
key/value head is copied to every head; a branch's runs merge in one launch; the gradient adds of
a branch's runs share launches, those before a run whose key/value rows an earlier run's adds also
reach going first). An attention operator call (cuDNN, flash or efficient attention, forward or
backward) counts as one launch: the kernels inside it (cuDNN's backward runs several) are the
operator's.

:func:`views_launches` says how far a geometry is from a launch count that does not grow with the
dilation rates ("at most 4 per branch plus a constant" a direction;
``tests/backends/test_views_launches.py`` prints the counts of the example GPT's geometry).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..op import library
from .strided import Call, plan_branches

__all__ = ["BranchLaunches", "Launches", "driver_calls", "views_launches"]

# Launches of the closed form of a call of one row and one key (views.cpp cuda_forward /
# cuda_backward, half-precision inputs): the float32 casts and elementwise ops it runs.
_CLOSED_FORWARD = 6  # q, k to float32; q * k; sum; * scale; the lse made contiguous
_CLOSED_BACKWARD = 21  # q, k, v, dout, out to float32 and the 16 products, sums and exps of P, dS
# The dlse term of a backward call: a second operator call on a unit out and -dlse dout (zeros,
# fills, a negation and copy, the float32 sums of dq and dk); cuDNN takes dout and out contiguous
# (the efficient kernel's are contiguous as made).
_DLSE = {"cudnn": 13, "flash": 11, "efficient": 11}


@dataclass(frozen=True)
class BranchLaunches:
    """One branch: its kernel calls (times batch runs), and the launches of its forward and
    backward (operator calls included)."""

    calls: int
    forward: int
    backward: int


@dataclass(frozen=True)
class Launches:
    """The launches of one ``views_fwd`` and one ``views_bwd``: per branch, and the ones that do
    not depend on the branches (allocations filled on the device, the non-finite flags, the casts
    of the results)."""

    branches: tuple[BranchLaunches, ...]
    forward_constant: int
    backward_constant: int

    @property
    def forward(self) -> int:
        return self.forward_constant + sum(b.forward for b in self.branches)

    @property
    def backward(self) -> int:
        return self.backward_constant + sum(b.backward for b in self.branches)

    @property
    def calls(self) -> int:
        return sum(b.calls for b in self.branches)

    def most_per_branch(self) -> int:
        """The most launches of one branch in either direction."""
        return max((max(b.forward, b.backward) for b in self.branches), default=0)


def driver_calls(
    B: int, N: int, Hq: int, Hkv: int, segment_lengths: list[int], dilation_rates: list[int]
) -> list[list[tuple[Call, int, bool, bool, bool]]]:
    """Per branch, the kernel calls the C++ driver makes on CUDA for q (B, N, Hq, D):
    ``(first plan call, count of plan calls, gathered, repeated, adds first)``,
    one per call and batch entry where the call does not fold; gathered where the run's calls
    and its batch entries or segments are both several (views.cpp ``operands``); repeated where
    the branch reads k and v repeated to Hq heads (its calls those of the plan of ``Hkv = Hq``);
    adds first where the gradient adds pending before the run go first, its key/value rows meeting
    theirs (grouped-query heads). The driver's own grouping (``views/plan.h`` ``driver_calls``,
    bound as ``_C.driver_calls``)."""
    args = ((N,), Hq, Hkv, tuple(segment_lengths), tuple(dilation_rates), True)
    made = library._require_extension().driver_calls(*args, B)
    plans = {False: plan_branches(*args)}
    if any(run[4] for runs in made for run in runs):
        plans[True] = plan_branches((N,), Hq, Hq, *args[3:])
    return [
        [
            (plans[bool(rep)][br][i], count, bool(gathered), bool(rep), bool(first))
            for i, _, count, gathered, rep, first in runs
        ]
        for br, runs in enumerate(made)
    ]


def _moves(pairs: int) -> int:
    """Launches of row moves of one kind (views.cpp Moves): the rows kernel takes ``_C.row_pairs``
    tensors a launch."""
    return -(-pairs // library._require_extension().row_pairs)


def _operands(c: Call, gathered: bool) -> int:
    """Tensors moved to give the kernel q, k and v: those of a gathered run, and k and v where
    their heads are repeated to q's (grouped-query heads)."""
    return int(gathered) + 2 * int(gathered or c.kv.n != c.q.n)


def _forward(runs: list[tuple[Call, int, bool, bool, bool]]) -> int:
    """A branch's forward: its moves (gathers, repeated heads), per run the operator call, then the
    merge of its runs (``_C.merge_calls`` a launch)."""
    moves = _moves(sum(_operands(c, gathered) for c, _, gathered, *_ in runs))
    merges = -(-len(runs) // library._require_extension().merge_calls)
    return moves + sum(_CLOSED_FORWARD if c.m == 1 else 1 for c, *_ in runs) + merges


def _backward(runs: list[tuple[Call, int, bool, bool, bool]], has_dlse: bool, kind: str) -> int:
    """A branch's backward: the moves of every run's inputs (q, k, v as the forward moves them;
    cuDNN's contiguous dout and out; the statistics), then per run the operator call, and the adds
    of the gradients (dk and dv of grouped-query heads summed by the add), those of the runs
    together, the pending ones first before a run whose key/value rows meet theirs."""
    inputs = launches = adds = 0
    for c, _, gathered, _, adds_first in runs:
        inputs += (
            _operands(c, gathered)
            + 2 * int(kind != "flash" or gathered)  # cuDNN and efficient: dout, out contiguous
            + 1
            + int(has_dlse and gathered)
        )
        if c.m == 1:  # the closed form, in float32
            launches += _CLOSED_BACKWARD + int(has_dlse)
        else:
            launches += 1 + (_DLSE[kind] if has_dlse else 0)
        if adds_first:
            launches += _moves(adds)
            adds = 0
        adds += 3
    return _moves(inputs) + launches + _moves(adds)


def views_launches(
    B: int,
    N: int,
    Hq: int,
    Hkv: int,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    *,
    has_dlse: bool = False,
    kind: str = "cudnn",
) -> Launches:
    """The launches of ``views_fwd`` and ``views_bwd`` on CUDA for q (B, N, Hq, D) and k, v
    (B, N, Hkv, D), contiguous, half precision, a positive scale. kind: the attention operator,
    ``"cudnn"`` (sm_90+), ``"flash"`` or ``"efficient"`` (float32, and the half-precision calls
    neither of the others takes). Float32 inputs skip the casts counted here (the results' and
    the closed form's): the count is then an upper bound."""
    if kind not in _DLSE:
        raise ValueError(f"kind must be 'cudnn', 'flash' or 'efficient', got {kind!r}")
    branches, repeated = [], False
    for made_calls in driver_calls(B, N, Hq, Hkv, segment_lengths, dilation_rates):
        rep = any(r for _, _, _, r, _ in made_calls)
        repeated = repeated or rep
        branches.append(
            BranchLaunches(
                calls=len(made_calls),
                forward=_forward(made_calls),
                backward=_backward(made_calls, has_dlse, kind),
            )
        )
    # forward: the accumulators (zeros, a fill), the flags (zeros, the check), v with its
    # non-finite entries as 0 (causal), out cast to the inputs' dtype, lse made (B, Hq, N)
    forward_constant = 6 + int(is_causal)
    # backward: v with non-finite entries as 0 (causal), lse (and dlse) made (B, N, Hq), the three
    # float32 gradients zeroed and cast back
    backward_constant = 7 + int(is_causal) + int(has_dlse)
    if kind == "efficient":  # its lse rows padded to 32, the padding +inf: one fill for every call
        backward_constant += 1
    if repeated:  # k and v repeated (with the non-finite flags, one move); dk, dv zeroed and summed
        forward_constant += 1
        backward_constant += 3
    return Launches(tuple(branches), forward_constant, backward_constant)
