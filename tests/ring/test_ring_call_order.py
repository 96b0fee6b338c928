"""Ranks out of step between calls of one configuration, ranks with different check modes, and
copies of the module (``copy.deepcopy``, ``torch.save`` / ``torch.load``).

Multi-process parts run on ``ring_cluster.Cluster`` (gloo). Every scenario that could hang runs on
a new group with a short timeout, so that a missed check fails the test within seconds; a check
that caught the misuse is told by its ValueError's message (a missed one times out with a
RuntimeError of the group, or returns), never by the time it took.
"""

from __future__ import annotations

import copy
import datetime
import io
import os
import re

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention
from ring_cluster import Cluster, inputs

from dilated_attention.ring import (
    RingDilatedAttention,
    RingMultiheadDilatedAttention,
    comm_stats,
    reset_comm_stats,
    shard_sequence,
)

TIMEOUT_S = 5.0  # the groups of the out-of-step scenarios: a missed check fails after this


@pytest.fixture(scope="module")
def cluster2():
    cluster = Cluster(2)
    yield cluster
    cluster.close()


def _group() -> dist.ProcessGroup:
    return dist.new_group(ranks=[0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _layer_inputs(layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This layer's whole q, k, v: the same on every rank, different for every layer."""
    q, k, v, _, _ = inputs(1, 16, 2, 2, 4, seed=layer)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Ranks out of step: which call is paired with which
# ---------------------------------------------------------------------------------------------


def layer_drop(rank: int, P: int, comm: str, skip_alike: bool) -> dict:
    """Three layers of one configuration; every rank skips one. ``skip_alike``: both skip layer 1
    (in step); otherwise rank 0 skips layer 1 and rank 1 skips layer 2. Returns the error message
    per call, or the call's largest deviation from the reference."""
    group = _group()
    layers = [RingDilatedAttention([16], [1], comm=comm, process_group=group) for _ in range(3)]
    skip = 1 if skip_alike or rank == 0 else 2
    got: dict = {}
    for i, layer in enumerate(layers):
        if i == skip:
            continue
        q, k, v = _layer_inputs(i)
        try:
            out = layer(*(shard_sequence(t, group) for t in (q, k, v)))
        except ValueError as err:
            got[i] = str(err)
            continue
        ref, _ = reference_attention(q, k, v, [16], [1])
        got[i] = (out - shard_sequence(ref, group)).abs().max().item()
    return got


@pytest.mark.parametrize("comm", ["all_gather", "ring"])
def test_layers_skipped_differently_raise_on_every_rank(cluster2, comm):
    """Rank 0 skips layer 1, rank 1 skips layer 2: their second calls have the same configuration
    and shapes but are different layers. Paired by call order only, they returned wrong outputs."""
    for rank, got in enumerate(cluster2.run(layer_drop, comm, False, deadline=60.0)):
        assert got[0] < 1e-12
        second = got[2 if rank == 0 else 1]
        assert isinstance(second, str), f"rank {rank} returned normally (deviation {second})"
        assert "out of step" in second, second
        # the modules are numbered in the order each process built them (for this group's ranks)
        numbers = re.search(r"module: rank 0: (\d+), rank 1: (\d+)", second)
        assert numbers and int(numbers[1]) == int(numbers[2]) + 1, second


def test_layers_skipped_alike_run(cluster2):
    for got in cluster2.run(layer_drop, "all_gather", True, deadline=60.0):
        assert got[0] < 1e-12 and got[2] < 1e-12, got


def backward_order(rank: int, P: int, comm: str, alike: bool) -> dict:
    """Two graphs through one module; rank 0 runs their backwards A then B, rank 1 B then A (or
    both A then B with ``alike``). Returns the errors raised, or the gradients' largest deviation."""
    group = _group()
    module = RingDilatedAttention([16], [1], comm=comm, process_group=group)
    graphs = []
    for name in ("A", "B"):
        q, k, v = _layer_inputs(ord(name))
        mine = [shard_sequence(t, group).requires_grad_() for t in (q, k, v)]
        out = module(*mine)
        graphs.append((name, out.square().sum(), mine, (q, k, v)))
    if rank == 1 and not alike:
        graphs.reverse()
    got: dict = {}
    for name, loss, mine, whole in graphs:
        try:
            loss.backward()
        except ValueError as err:
            got[name] = str(err)
            continue
        leaves = [t.clone().requires_grad_() for t in whole]
        ref, _ = reference_attention(*leaves, [16], [1])
        ref.square().sum().backward()  # every rank's loss: the ring's gradients are those of the sum
        got[name] = max(
            (m.grad - shard_sequence(w.grad, group)).abs().max().item()
            for m, w in zip(mine, leaves, strict=True)
        )
    return got


@pytest.mark.parametrize("comm", ["all_gather", "ring"])
def test_backwards_in_different_orders_raise_on_every_rank(cluster2, comm):
    """Paired by call order only, every gradient was wrong and no rank was told."""
    for rank, got in enumerate(cluster2.run(backward_order, comm, False, deadline=60.0)):
        first = got["A" if rank == 0 else "B"]
        assert isinstance(first, str), f"rank {rank}: the backward returned (deviation {first})"
        assert "out of step" in first and "backward" in first, first
        assert "call of the module: rank 0: 0, rank 1: 1" in first, first


def test_backwards_in_the_same_order_run(cluster2):
    for got in cluster2.run(backward_order, "ring", True, deadline=60.0):
        assert got["A"] < 1e-10 and got["B"] < 1e-10, got


def check_calls(rank: int, P: int, mode: bool | str) -> list[int]:
    """The consistency check's all-gathers over three steps of forward and backward."""
    group = _group()
    module = RingDilatedAttention([16], [1], process_group=group, check_consistency=mode)
    q, k, v = _layer_inputs(0)
    calls = []
    for _ in range(3):
        reset_comm_stats()
        mine = [shard_sequence(t, group).requires_grad_() for t in (q, k, v)]
        module(*mine).sum().backward()
        calls.append(int(comm_stats().get("check", {}).get("calls", 0)))
    return calls


def test_the_backward_check_costs_one_all_gather(cluster2):
    """The documented cost: with check_consistency=True, one all-gather in the forward and one in
    the backward; "once" and False only on the first call, and never in the backward."""
    for mode, expected in ((True, [2, 2, 2]), ("once", [1, 0, 0]), (False, [1, 0, 0])):
        for calls in cluster2.run(check_calls, mode, deadline=60.0):
            assert calls == expected, (mode, calls)


def checkpointed(rank: int, P: int) -> float:
    """Activation checkpointing runs each forward again inside the backward, on every rank alike."""
    from torch.utils.checkpoint import checkpoint

    group = _group()
    layers = [RingDilatedAttention([16], [1], process_group=group) for _ in range(2)]
    q, k, v = _layer_inputs(0)
    mine = [shard_sequence(t, group).requires_grad_() for t in (q, k, v)]
    x = mine[0]
    for layer in layers:
        x = checkpoint(layer, x, mine[1], mine[2], use_reentrant=False)
    x.square().sum().backward()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = leaves[0]
    for _ in layers:
        y, _ = reference_attention(y, leaves[1], leaves[2], [16], [1])
    y.square().sum().backward()
    return max(
        (m.grad - shard_sequence(w.grad, group)).abs().max().item() for m, w in zip(mine, leaves, strict=True)
    )


def test_activation_checkpointing_stays_in_step(cluster2):
    for err in cluster2.run(checkpointed, deadline=60.0):
        assert err < 1e-10


# ---------------------------------------------------------------------------------------------
# Ranks with different check_consistency modes
# ---------------------------------------------------------------------------------------------


def modes(rank: int, P: int, mine: bool | str, theirs: bool | str, switch: bool) -> str:
    """Rank 0 checks with ``mine``, rank 1 with ``theirs``: from the start, or (``switch``) after a
    first call in which both used ``mine``. Returns the message of the ValueError raised."""
    group = _group()
    module = RingDilatedAttention([16], [1], process_group=group, check_consistency=mine)
    x = _layer_inputs(0)
    chunks = [shard_sequence(t, group) for t in x]
    if switch:
        module(*chunks)
    if rank == 1:
        module.check_consistency = theirs
    try:
        module(*chunks)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"rank {rank}: no ValueError")


@pytest.mark.parametrize(
    "mine,theirs,switch",
    [
        (True, False, False),
        (True, "once", False),
        (False, "once", False),
        (True, False, True),
        (True, "once", True),
    ],
)
def test_different_check_modes_are_named_at_once(cluster2, mine, theirs, switch):
    """From the first call; or when some ranks change the setting while the others check every
    call (from "once" or False on every rank, a change on some ranks only is not seen: the ranks
    that did not change send nothing to compare)."""
    for msg in cluster2.run(modes, mine, theirs, switch, deadline=60.0):
        assert f"check_consistency: rank 0: {mine!r}, rank 1: {theirs!r}" in msg, msg


def test_check_consistency_is_validated_when_set():
    module = RingDilatedAttention([4], [1])
    with pytest.raises(ValueError, match="check_consistency must be True, False or 'once', got 'always'"):
        module.check_consistency = "always"
    module.check_consistency = "once"
    assert module.check_consistency == "once"


# ---------------------------------------------------------------------------------------------
# deepcopy, torch.save and torch.load
# ---------------------------------------------------------------------------------------------


def copies(rank: int, P: int, store: str) -> dict:
    """deepcopy keeps the group; torch.save writes the configuration, and a module loaded in
    another process (each rank loads the other's file) takes the default group, or, saved with
    an explicit group, says that it needs one until given one."""
    group = _group()
    q, k, v = _layer_inputs(0)
    ref, _ = reference_attention(q, k, v, [16], [1])
    got: dict = {}

    def error(module: torch.nn.Module, g: dist.ProcessGroup | None) -> float:
        x = [shard_sequence(t, g) for t in (q, k, v)]
        out = module(*x)
        if isinstance(out, tuple):
            out = out[0]
        return (out - shard_sequence(ref, g)).abs().max().item()

    explicit = RingDilatedAttention([16], [1], comm="ring", process_group=group)
    explicit(*(shard_sequence(t, group) for t in (q, k, v)))  # caches filled, calls counted
    twin = copy.deepcopy(explicit)
    got["deepcopy keeps the group"] = twin.process_group is group
    got["deepcopy error"] = error(twin, group)
    got["original after copy error"] = error(explicit, group)
    mha = RingMultiheadDilatedAttention(8, 2, [16], [1], process_group=group, dtype=torch.float64)
    got["multihead deepcopy group"] = copy.deepcopy(mha).attention.process_group is group

    default = RingDilatedAttention([16], [1], layout="zigzag")
    for name, module in (("default", default), ("explicit", explicit), ("multihead", mha)):
        with open(os.path.join(store, f"{name}-{rank}.pt"), "wb") as f:
            torch.save(module, f)
    buf = io.BytesIO()
    torch.save(default, buf)
    buf.seek(0)
    got["same process load error"] = error(torch.load(buf, weights_only=False), None)
    dist.barrier(group)
    other = 1 - rank

    def load(name: str) -> torch.nn.Module:
        with open(os.path.join(store, f"{name}-{other}.pt"), "rb") as f:
            return torch.load(f, weights_only=False)

    loaded = load("default")
    got["loaded layout"] = loaded.layout
    got["loaded default error"] = error(loaded, None)
    loaded = load("explicit")
    try:
        error(loaded, group)
        got["loaded explicit"] = "no error"
    except RuntimeError as err:
        got["loaded explicit"] = str(err)
    loaded.set_process_group(group)
    got["loaded explicit after set error"] = error(loaded, group)
    loaded_mha = load("multihead")
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    try:
        loaded_mha(x)
        got["loaded multihead"] = "no error"
    except RuntimeError as err:
        got["loaded multihead"] = str(err)
    loaded_mha.set_process_group(group)
    y, _ = loaded_mha(x)
    got["loaded multihead runs"] = tuple(y.shape)
    return got


def test_deepcopy_and_save_load(cluster2, tmp_path):
    for got in cluster2.run(copies, str(tmp_path), deadline=60.0):
        assert got["deepcopy keeps the group"] and got["multihead deepcopy group"], got
        for key in (
            "deepcopy error",
            "original after copy error",
            "same process load error",
            "loaded default error",
            "loaded explicit after set error",
        ):
            assert got[key] < 1e-12, (key, got)
        assert got["loaded layout"] == "zigzag"
        for key in ("loaded explicit", "loaded multihead"):
            msg = got[key]
            assert "was saved with an explicit process_group (global ranks [0, 1])" in msg, msg
            assert "set_process_group(" in msg, msg
        assert got["loaded multihead runs"] == (1, 8, 8)


def test_pickle_without_a_process_group():
    """Without torch.distributed: deepcopy and save/load of a module built for the default group,
    and the multi-head module, run as the original."""
    q, k, v, _, _ = inputs(1, 16, 2, 2, 4)
    module = RingDilatedAttention([8, 16], [1, 2])
    expected = module(q, k, v, is_causal=True)
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    for other in (copy.deepcopy(module), torch.load(buf, weights_only=False)):
        assert other.process_group is None
        torch.testing.assert_close(other(q, k, v, is_causal=True), expected, rtol=0, atol=0)
