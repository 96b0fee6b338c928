"""Ranks in step on one communicator: calls numbered per communicator whatever object names it,
calls refused on one rank only, steps skipped on some ranks (``call_key``), the debug mode, and
``copy.copy``.

Each scenario runs on 2 gloo processes whose default group has a short timeout, so that a missed
check fails the test in seconds. Every value is compared with the float64 reference.
"""

from __future__ import annotations

import copy
import os
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention
from ring_cluster import Cluster, inputs

from dilated_attention import MultiheadDilatedAttention
from dilated_attention.ring import (
    RingDilatedAttention,
    RingMultiheadDilatedAttention,
    call_key,
    shard_sequence,
)

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def cluster2():
    cluster = Cluster(2, timeout_s=TIMEOUT_S)
    yield cluster
    cluster.close()


def _whole(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, _, _ = inputs(1, 16, 2, 2, 4, seed=seed)
    return q, k, v


def _run(module: RingDilatedAttention, seed: int) -> float | str:
    """The module on this rank's chunk of input ``seed``: its largest deviation from the reference,
    or the message of the ValueError it raised."""
    q, k, v = _whole(seed)
    try:
        out = module(*(shard_sequence(t, module.process_group) for t in (q, k, v)))
    except ValueError as err:
        return str(err)
    ref, _ = reference_attention(q, k, v, [16], [1])
    return (out - shard_sequence(ref, module.process_group)).abs().max().item()


# ---------------------------------------------------------------------------------------------
# One communicator under several names
# ---------------------------------------------------------------------------------------------


def two_names(rank: int, P: int, other: str, alike: bool) -> list:
    """A module on process_group=None and one on the same communicator under another name; rank 0
    calls them A then B, rank 1 B then A (or both A then B with ``alike``)."""
    from torch.distributed.device_mesh import init_device_mesh

    a = RingDilatedAttention([16], [1])
    group = dist.group.WORLD if other == "WORLD" else init_device_mesh("cpu", (P,))
    b = RingDilatedAttention([16], [1], process_group=group)
    order = [(a, 1), (b, 2)]
    if rank == 1 and not alike:
        order.reverse()
    return [_run(m, seed) for m, seed in order]


@pytest.mark.parametrize("other", ["WORLD", "mesh"])
def test_one_communicator_under_two_names_is_numbered_once(cluster2, other):
    """Numbered per name, both modules were module 0 and their calls paired: errors 0.29 / 0.49.
    Each rank raises the consistency check's error, not the group's timeout (no wall-clock limit
    here: the message says which)."""
    for got in cluster2.run(two_names, other, False, deadline=60.0):
        for msg in got:
            assert isinstance(msg, str), f"returned normally (deviation {msg})"
            assert "out of step" in msg and "module: rank 0:" in msg, msg
    for got in cluster2.run(two_names, other, True, deadline=60.0):
        assert all(isinstance(x, float) and x < 1e-12 for x in got), got


# ---------------------------------------------------------------------------------------------
# A call refused on one rank only
# ---------------------------------------------------------------------------------------------


def refused_on_one_rank(rank: int, P: int, how: str, mode: bool | str) -> dict:
    """Rank 0's inputs are refused by its own checks; both ranks catch the error and go on with a
    call that every rank makes alike."""
    module = RingDilatedAttention([16], [1], check_consistency=mode)
    got: dict = {}
    q, k, v = (shard_sequence(t, None) for t in _whole(1))
    try:
        if rank == 0 and how == "dtype":
            module(q.float(), k, v)
        elif rank == 0 and how == "is_causal":
            module(q, k, v, is_causal="yes")
        else:
            module(q, k, v)
        got["refused"] = "no error"
    except (TypeError, ValueError) as err:
        got["refused"] = f"{type(err).__name__}: {err}"
    got["next"] = _run(module, 2)
    return got


@pytest.mark.parametrize("how", ["dtype", "is_causal"])
def test_a_call_refused_on_one_rank_is_refused_on_every_rank(cluster2, how):
    """Rank 1 paired its call with rank 0's next one: errors 0.29-3.5 and no error anywhere."""
    ranks = cluster2.run(refused_on_one_rank, how, True, deadline=60.0)
    assert "refused" not in ranks[0]["refused"].split(":")[1], ranks[0]  # rank 0 raises its own error
    assert re.search(r"rank\(s\) \[0\] refused their inputs", ranks[1]["refused"]), ranks[1]
    for got in ranks:
        assert isinstance(got["next"], float) and got["next"] < 1e-12, got


def multihead_refused(rank: int, P: int) -> dict:
    """The multi-head module's own checks (the embedding width) refuse rank 0's input."""
    torch.manual_seed(0)
    mha = RingMultiheadDilatedAttention(8, 2, [16], [1], dtype=torch.float64)
    x = torch.randn(1, 16, 8, dtype=torch.float64)
    got: dict = {}
    try:
        mha(shard_sequence(x[..., :6] if rank == 0 else x, None))
        got["refused"] = "no error"
    except ValueError as err:
        got["refused"] = str(err)
    whole = MultiheadDilatedAttention(8, 2, [16], [1], dtype=torch.float64)
    whole.load_state_dict(mha.state_dict())
    expected, _ = whole(x)
    out, _ = mha(shard_sequence(x, None))
    got["next"] = (out - shard_sequence(expected, None)).abs().max().item()
    return got


def test_a_multihead_call_refused_on_one_rank(cluster2):
    ranks = cluster2.run(multihead_refused, deadline=60.0)
    assert "refused their inputs" not in ranks[0]["refused"], ranks[0]
    assert "refused their inputs" in ranks[1]["refused"], ranks[1]
    for got in ranks:
        assert got["next"] < 1e-12, got


# ---------------------------------------------------------------------------------------------
# Steps skipped on some ranks: call_key and the debug mode
# ---------------------------------------------------------------------------------------------


def skipped_step(rank: int, P: int, keyed: bool, debug: bool) -> list:
    """Two layers built once; rank 1 skips step 0. With ``keyed`` each step runs under call_key."""
    env = {"DILATED_ATTENTION_RING_DEBUG": "1" if debug else "0"}
    got = []
    with mock.patch.dict(os.environ, env):
        layers = [RingDilatedAttention([16], [1]) for _ in range(2)]
        for step in range(1 if rank == 0 else 2):
            if rank == 1 and step == 0:
                continue
            with call_key(step) if keyed else mock.MagicMock():
                got.extend(_run(layer, 10 * step + i) for i, layer in enumerate(layers))
    return got


def test_a_step_skipped_on_one_rank_is_named_by_call_key(cluster2):
    for got in cluster2.run(skipped_step, True, False, deadline=60.0):
        assert all(isinstance(m, str) and "call_key: rank 0: 0, rank 1: 1" in m for m in got), got


def test_the_debug_mode_names_each_ranks_calls(cluster2):
    """Rank 1 skipping the first step: the debug mode's message says where each module was built
    and each rank's previous calls."""
    for got in cluster2.run(skipped_step, True, True, deadline=60.0):
        msg = got[0]
        assert "the last calls of each rank on this process group" in msg, msg
        assert re.search(r"RingDilatedAttention #\d+ built at test_ring_in_step.py:\d+", msg), msg
        assert "call_key 1" in msg and "call_key 0" in msg, msg


def test_call_key_and_debug_values_are_checked():
    with pytest.raises(TypeError, match=r"call_key takes an int of 64 bits.*got 'step'"):
        with call_key("step"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="got True"):
        with call_key(True):
            pass
    from dilated_attention.ring.consistency import debug_mode

    with mock.patch.dict(os.environ, {"DILATED_ATTENTION_RING_DEBUG": "yes"}):
        with pytest.raises(ValueError, match="DILATED_ATTENTION_RING_DEBUG must be 0 or 1, got 'yes'"):
            debug_mode()


# ---------------------------------------------------------------------------------------------
# copy.copy
# ---------------------------------------------------------------------------------------------


def shallow_copy(rank: int, P: int) -> dict:
    group = dist.new_group([0, 1])
    module = RingDilatedAttention([16], [1], process_group=group)
    twin = copy.copy(module)
    return {"group kept": twin.process_group is group, "error": _run(twin, 3), "original": _run(module, 4)}


def test_copy_copy_keeps_the_group(cluster2):
    """copy.copy went through __getstate__ and said the copy "was saved with an explicit process_group"."""
    for got in cluster2.run(shallow_copy, deadline=60.0):
        assert got["group kept"] and got["error"] < 1e-12 and got["original"] < 1e-12, got


def test_copy_copy_without_a_group():
    q, k, v = _whole(5)
    module = RingDilatedAttention([8, 16], [1, 2])
    torch.testing.assert_close(copy.copy(module)(q, k, v), module(q, k, v), rtol=0, atol=0)
