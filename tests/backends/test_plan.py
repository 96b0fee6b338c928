"""The plan of the kernel calls (csrc/views/plan.cpp, decoded by backends/strided.py) against SPEC
section 2, computed here in plain Python from the definition, and its cache.

For random geometries (one sequence or a packed batch, empty sequences included; Hq a multiple of
Hkv; one to three branches; with and without native grouped-query attention) the calls, read
through the same strided views the drivers take (``strided.view`` on tensors whose entries name
their position and head), must cover exactly the (position, query head) pairs each branch covers,
each once, every query reading key/value head ``h // (Hq // Hkv)`` at exactly the keys
``K(p, h)`` of its segment, in order (so that causal masking is the call's own)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from dilated_attention.backends import strided
from dilated_attention.op.library import _C

pytestmark = pytest.mark.skipif(_C is None, reason="the plan is in the compiled extension")


def _spec_branch(lengths, Hq, Hkv, w, r):
    """SPEC section 2 on each sequence (section 7): {(row, h): (kv head, keys in order)} of the
    (position, query head) pairs the branch (w, r) covers; rows are packed-batch rows."""
    G = Hq // Hkv
    want, start = {}, 0
    for n in lengths:
        for p in range(n):
            for h in range(Hq):
                if (p % w) % r == h % r:
                    keys = [start + x for x in range(n) if x // w == p // w and (x % w) % r == h % r]
                    want[(start + p, h)] = (h // G, keys)
        start += n
    return want


def _codes(T, H):
    """(1, T, H, 1) float64 whose entry at (row, head) is row * H + head (exact)."""
    return torch.arange(T * H, dtype=torch.float64).view(1, T, H, 1)


def _planned_branch(calls, T, Hq, Hkv):
    """What the calls read, through strided.view: {(row, h): [(kv head, keys in order)] per read}."""
    got: dict[tuple[int, int], list] = {}
    xq, xkv = _codes(T, Hq), _codes(T, Hkv)
    for call in calls:
        assert call.q.n == call.kv.n * call.g, call
        qv = strided.view(xq, call, call.q)[..., 0].long()  # (rows, m, nq)
        kv = strided.view(xkv, call, call.kv)[..., 0].long()  # (rows, m, nkv)
        assert qv.shape[:2] == kv.shape[:2] == (call.part.rows, call.m), call
        for b in range(qv.shape[0]):
            for t in range(call.q.n):
                ks = [int(c) for c in kv[b, :, t // call.g]]
                heads = {c % Hkv for c in ks}
                assert len(heads) == 1, (call, ks)  # one key/value head per query head
                for j in range(call.m):
                    row, h = divmod(int(qv[b, j, t]), Hq)
                    # the key at the query's own place in the sub-sequence is the query's row
                    assert ks[j] // Hkv == row, (call, j, t)
                    got.setdefault((row, h), []).append((ks[j] % Hkv, [c // Hkv for c in ks]))
    return got


def _random_geometry(rng):
    Hkv = rng.randint(1, 4)
    Hq = Hkv * rng.randint(1, 4)
    k = rng.randint(1, 3)
    segs = [rng.randint(1, 20) for _ in range(k)]
    rates = [rng.randint(1, w) for w in segs]
    if rng.random() < 0.5:
        lengths = [rng.randint(0, 30) for _ in range(rng.randint(1, 4))]
    else:
        lengths = [rng.randint(1, 45)]
    return lengths, Hq, Hkv, segs, rates, rng.random() < 0.5


@pytest.mark.parametrize("seed", range(8))
def test_calls_cover_what_each_branch_covers_once_with_its_keys(seed):
    rng = random.Random(seed)
    for _ in range(25):
        lengths, Hq, Hkv, segs, rates, native_gqa = geometry = _random_geometry(rng)
        N = tuple(lengths) if len(lengths) > 1 else lengths[0]
        plan = strided.plan_branches(N, Hq, Hkv, tuple(segs), tuple(rates), native_gqa)
        assert len(plan) == len(segs), geometry
        for calls, w, r in zip(plan, segs, rates, strict=True):
            want = _spec_branch(lengths, Hq, Hkv, w, r)
            got = _planned_branch(calls, sum(lengths), Hq, Hkv)
            assert got.keys() == want.keys(), (geometry, w, r, got.keys() ^ want.keys())
            for pair, reads in got.items():
                assert reads == [want[pair]], (geometry, w, r, pair)  # once, right head and keys
            if not native_gqa:  # a kernel without grouped-query attention gets one kv head a query head
                assert all(c.g == 1 for c in calls), (geometry, w, r)


def _cost(runs):
    """A branch's driver calls for one batch entry and how many of them gather their rows."""
    return (len(runs), sum(gathered for _, _, _, gathered, *_ in runs))


@pytest.mark.parametrize("seed", range(4))
def test_a_branch_runs_on_repeated_kv_heads_where_that_takes_fewer_calls(seed):
    """The C++ driver's plan (repeat_kv, views/plan.h Plan::repeated): a branch of grouped-query
    heads runs on k and v repeated to Hq heads only with fewer key/value heads than query heads,
    then as the same branch of Hq key/value heads does, and never takes more driver calls (nor, as
    many, more gathered) than that branch; once some branch reads the repeated k and v, so does
    every branch that costs no more on them."""
    rng = random.Random(seed)
    for _ in range(40):
        lengths, Hq, Hkv, segs, rates, _ = geometry = _random_geometry(rng)
        N = max(1, lengths[0])
        args = (tuple(segs), tuple(rates), True, 1)
        gqa = _C.driver_calls((N,), Hq, Hkv, *args)
        mha = _C.driver_calls((N,), Hq, Hq, *args)
        for g, m in zip(gqa, mha, strict=True):
            assert not any(run[4] for run in m), geometry  # Hkv == Hq: nothing to repeat
            if g and g[0][4]:
                assert Hkv < Hq and all(run[4] for run in g), geometry
                assert [run[:4] for run in g] == [run[:4] for run in m], geometry
            assert _cost(g) <= _cost(m), geometry
        if any(g and g[0][4] for g in gqa):
            for g, m in zip(gqa, mha, strict=True):
                assert not g or g[0][4] or _cost(g) < _cost(m), geometry


@pytest.mark.parametrize("seed", range(4))
def test_gradient_adds_go_first_exactly_where_runs_share_key_value_rows(seed):
    """The CUDA driver adds a branch's gradients into dk and dv in batches of row moves, one launch
    adding a batch at once, so no two runs of a batch may reach the same key/value row; a run with
    adds_first (views/plan.h DriverCall::adds_first) has the pending batch run before its own. Read
    through strided.view (each key/value row named by its code, per batch entry), a run has it
    exactly where its rows meet those of the runs since the last run that has it: in the driver's
    plans, and in those without k and v repeated (native_gqa off too), where runs share them."""
    rng = random.Random(seed)
    flagged = 0
    for _ in range(40):
        lengths, Hq, Hkv, segs, rates, native_gqa = geometry = _random_geometry(rng)
        N, B, repeat_kv = max(1, lengths[0]), rng.randint(1, 3), rng.random() < 0.5
        made = _C.driver_calls((N,), Hq, Hkv, tuple(segs), tuple(rates), native_gqa, B, repeat_kv)
        for br, runs in enumerate(made):
            H = Hq if runs and runs[0][4] else Hkv  # the branch on k and v repeated to Hq heads
            calls = strided.plan_branches(N, Hq, H, tuple(segs), tuple(rates), native_gqa)[br]
            codes = _codes(N, H)
            pending: set[tuple[int, int]] = set()
            for i, b, count, _, _, first in runs:
                rows = set()
                for call in calls[i : i + count]:
                    kv = strided.view(codes, call, call.kv)[..., 0].long().flatten().tolist()
                    rows |= {(e, c) for c in kv for e in (range(B) if b < 0 else [b])}
                assert bool(first) == bool(rows & pending), (geometry, B, br, i)
                pending = rows if first else pending | rows
                flagged += bool(first)
    assert flagged > 0  # grouped-query heads that share key/value rows across runs occur


@pytest.mark.parametrize(
    "args,names",
    [
        (((-1,), 2, 1, (4,), (1,), False), "lengths[0] = -1"),
        (((8,), 3, 2, (4,), (1,), False), "Hq = 3, Hkv = 2"),
        (((8,), 2, 0, (4,), (1,), False), "Hkv = 0"),
        (((8,), 2, 1, (4, 8), (1,), False), "[4, 8] and [1]"),
        (((8,), 2, 1, (0,), (1,), False), "w = 0"),
        (((8,), 2, 1, (4,), (0,), False), "r = 0"),
        ((("8",), 2, 1, (4,), (1,), False), "lengths must be a sequence of ints, got ('8',)"),
        ((8, 2, 1, (4,), (1,), False), "lengths must be a sequence of ints, got 8"),
    ],
)
def test_plan_arguments_are_checked_by_name(args, names):
    with pytest.raises(ValueError, match=r"dilated_attention plan: .*" + re.escape(names)):
        _C.plan(*args)


def test_the_plan_cache_counts_and_clears():
    """get_pattern_cache() is the C++ cache: a geometry planned twice is one miss and one hit, a
    packed batch and its single sequence are two entries, clear() empties it and zeroes the counts."""
    from dilated_attention import get_pattern_cache

    cache = get_pattern_cache()
    cache.clear()
    assert cache.info() == (0, 0, 0, cache.info().max_entries) and len(cache) == 0
    first = strided.plan_branches(19, 4, 2, (8,), (2,), True)
    assert strided.plan_branches(19, 4, 2, (8,), (2,), True) == first
    assert cache.info()[:3] == (1, 1, 1)
    strided.plan_branches((19, 5), 4, 2, (8,), (2,), True)
    strided.plan_branches(19, 4, 2, (8,), (2,), False)
    info = cache.info()
    assert (info.hits, info.misses, info.entries) == (1, 3, 3) and len(cache) == 3
    assert info.max_entries >= 3
    cache.clear()
    assert cache.info()[:3] == (0, 0, 0)
