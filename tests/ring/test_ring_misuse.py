"""RingDilatedAttention misused, faulty peers, a group of one, no group, and the constructor.

Multi-process parts run on ``ring_cluster.Cluster`` (gloo, short deadlines).
"""

from __future__ import annotations

import copy
import datetime
import pickle
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from reference import reference_attention
from ring_cluster import Cluster, inputs, loss
from tolerance import assert_within_rule

from dilated_attention import DilatedAttentionWarning
from dilated_attention import dilated_attention as dattn
from dilated_attention.ring import (
    RingDilatedAttention,
    RingDilatedAttentionV2Collective,
    RingMultiheadDilatedAttention,
    SequenceSplitWarning,
    StandardizedRingConfig,
    comm_stats,
    gather_sequence,
    reset_comm_stats,
    shard_sequence,
)


@pytest.fixture(scope="module")
def cluster2():
    cluster = Cluster(2)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def cluster4():
    cluster = Cluster(4)
    yield cluster
    cluster.close()


def _reference(q, k, v, dout, dlse, segs, rates, causal, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*leaves, segs, rates, causal, dtype=dtype)
    grads = torch.autograd.grad(loss(out, lse, dout, dlse), leaves)
    return (out.detach(), lse.detach(), *grads)


# ---------------------------------------------------------------------------------------------
# Misuse and faults
# ---------------------------------------------------------------------------------------------


def misuse(rank: int, P: int) -> dict[str, str]:
    """Calls that must raise ValueError on every rank; returns {scenario: message}."""
    messages = {}
    x = torch.randn(1, 8, 2, 4)

    def expect(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except ValueError as err:
            messages[name] = str(err)
            return
        raise AssertionError(f"{name}: no ValueError on rank {rank}")

    segs = [8] if rank == 0 else [16]
    expect("segments", lambda: RingDilatedAttention(segs, [1])(x, x, x))
    n = 3 if rank == 0 else 2  # a sequence of 5 split unevenly
    expect("chunk", lambda: RingDilatedAttention([4], [1])(x[:, :n], x[:, :n], x[:, :n]))
    y = x if rank == 0 else x.double()
    expect("dtype", lambda: RingDilatedAttention([4], [1])(y, y, y))
    expect("causal", lambda: RingDilatedAttention([4], [1])(x, x, x, is_causal=rank == 1))
    hkv = x if rank == 0 else x[:, :, :1]
    expect("heads", lambda: RingDilatedAttention([4], [1])(x, hkv, hkv))
    expect("comm", lambda: RingDilatedAttention([4], [1], comm="ring" if rank else "all_gather")(x, x, x))
    expect("shard", lambda: shard_sequence(torch.randn(1, 5, 2, 4)))
    scale = 0.5 if rank == 0 else 0.25
    expect("scale", lambda: RingDilatedAttention([4], [1], softmax_scale=scale)(x, x, x))
    expect(
        "layout", lambda: RingDilatedAttention([4], [1], layout="zigzag" if rank else "contiguous")(x, x, x)
    )
    expect("ring_size", lambda: RingDilatedAttention([4], [1], ring_size=2 + rank)(x, x, x))
    g = x.clone().requires_grad_(rank == 0)  # only rank 0 would run the backward exchange
    expect("backward", lambda: RingDilatedAttention([4], [1])(g, g, g))
    expect("gather", lambda: gather_sequence(torch.zeros(1, 4 + rank, 2)))
    # the group still works afterwards
    q, k, v, _, _ = inputs(1, 16, 2, 2, 4)
    out = RingDilatedAttention([16], [2])(*(shard_sequence(t) for t in (q, k, v)))
    ref, _ = reference_attention(q, k, v, [16], [2])
    torch.testing.assert_close(out, shard_sequence(ref), rtol=0, atol=1e-12)
    return messages


def test_mismatched_ranks_raise_everywhere(cluster2):
    reports = cluster2.run(misuse)
    for messages in reports:
        assert "segment_lengths[0]: rank 0: 8, rank 1: 16" in messages["segments"]
        assert "chunk length N/P: rank 0: 3, rank 1: 2" in messages["chunk"]
        assert "divisible" in messages["chunk"]
        assert "dtype: rank 0: float32, rank 1: float64" in messages["dtype"]
        assert "is_causal" in messages["causal"]
        assert "key/value heads" in messages["heads"]
        assert "comm: rank 0: all_gather, rank 1: ring" in messages["comm"]
        assert "N = 5" in messages["shard"] and "P = 2" in messages["shard"]
        assert "softmax_scale: rank 0: 0.5, rank 1: 0.25" in messages["scale"]
        assert "layout: rank 0: contiguous, rank 1: zigzag" in messages["layout"]
        assert "ring_size: rank 0: 2, rank 1: 3" in messages["ring_size"]
        assert (
            "runs backward (grad enabled, inputs require grad): rank 0: True, rank 1: False"
            in (messages["backward"])
        )
        assert "rank 0: (1, 4, 2) torch.float32, rank 1: (1, 5, 2) torch.float32" in messages["gather"]


def out_of_step(rank: int, P: int, check: bool | str) -> list[str]:
    """Both ranks run a causal and a non-causal call together, then fall out of step: rank 0 calls
    the one, rank 1 the other, each a configuration every rank has used before. Returns what each
    out-of-step call raised."""
    module = RingDilatedAttention([4, 16], [1, 2], check_consistency=check)
    q, k, v, _, _ = inputs(1, 16, 2, 2, 4)
    mine = [shard_sequence(t) for t in (q, k, v)]
    for causal in (False, True):
        out = module(*mine, is_causal=causal)
        ref, _ = reference_attention(q, k, v, [4, 16], [1, 2], causal)
        torch.testing.assert_close(out, shard_sequence(ref), rtol=0, atol=1e-12)
    errors = []
    for _ in range(2):
        try:
            module(*mine, is_causal=rank == 1)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_ranks_out_of_step_between_known_configurations_raise(cluster2):
    """The check runs on every call: configurations that every rank has checked before are still
    compared (a check once per configuration let them exchange messages of different sizes,
    giving uninitialised values on one rank and an abort on the other)."""
    for errors in cluster2.run(out_of_step, True):
        assert len(errors) == 2 and all("is_causal: rank 0: False, rank 1: True" in e for e in errors)


def subgroup_mismatch(rank: int, P: int) -> str | None:
    """Ranks 2 and 3 share a group and disagree; the message numbers them globally."""
    groups = [dist.new_group(ranks=[0, 1]), dist.new_group(ranks=[2, 3])]
    if rank < 2:
        return None
    x = torch.randn(1, 8, 2, 4)
    segs = [8] if rank == 2 else [16]
    try:
        RingDilatedAttention(segs, [1], process_group=groups[1])(x, x, x)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"no ValueError on rank {rank}")


def test_mismatch_names_global_ranks(cluster4):
    reports = cluster4.run(subgroup_mismatch)
    for msg in reports[2:]:
        assert "segment_lengths[0]: rank 2: 8, rank 3: 16" in msg, msg


def outside_group(rank: int, P: int) -> str | None:
    """Rank 1 is not in the group: it may build the module but its forward says so."""
    group = dist.new_group(ranks=[0])
    module = RingDilatedAttention([4], [1], process_group=group)
    if rank == 0:
        return None
    x = torch.randn(1, 8, 2, 4)
    try:
        module(x, x, x)
    except RuntimeError as err:
        return str(err)
    raise AssertionError("no error outside the group")


def test_rank_outside_group_is_told(cluster2):
    _, msg = cluster2.run(outside_group)
    assert "not a member of the process_group" in msg and "global rank 1" in msg


def check_once(rank: int, P: int, check: bool | str) -> list[int]:
    """Calls of the consistency check over four forward calls: two shapes, each called twice."""
    module = RingDilatedAttention([16], [2], check_consistency=check)
    reset_comm_stats()
    calls = []
    for n in (8, 8, 12, 12):
        q, k, v, _, _ = inputs(1, 2 * n, 2, 2, 4)
        out = module(*(t[:, rank * n : (rank + 1) * n] for t in (q, k, v)))
        ref, _ = reference_attention(q, k, v, [16], [2])
        torch.testing.assert_close(out, ref[:, rank * n : (rank + 1) * n], rtol=0, atol=1e-12)
        calls.append(int(comm_stats().get("check", {}).get("calls", 0)))
    return calls


def test_consistency_check_runs_every_call_or_once_per_shape(cluster2):
    for calls in cluster2.run(check_once, True):
        assert calls == [1, 2, 3, 4]
    for calls in cluster2.run(check_once, "once"):
        assert calls == [1, 1, 2, 2]
    # unsafe: only the first call compares (the ranks' modes agree), nothing after
    for calls in cluster2.run(check_once, False):
        assert calls == [1, 1, 1, 1]


def silent_peer(rank: int, P: int, where: str, comm: str) -> float | str:
    """On a new group with a 2 s timeout, rank 1 skips the forward (or the backward); rank 0 must
    raise a RuntimeError once the timeout has passed."""
    timeout = 2.0
    group = dist.new_group(ranks=list(range(P)), timeout=datetime.timedelta(seconds=timeout))
    x = [torch.randn(1, 8, 2, 4, requires_grad=True) for _ in range(3)]
    module = RingDilatedAttention([16], [1], comm=comm, process_group=group)
    if rank == 1:
        if where == "backward":
            module(*x)
        time.sleep(timeout + 2.0)  # alive but silent
        return "silent"
    start = time.monotonic()
    try:
        out = module(*x)
        out.sum().backward()
    except RuntimeError as err:
        assert "does not answer" in str(err), str(err)
        return time.monotonic() - start
    raise AssertionError("rank 0 did not raise although its peer never answered")


@pytest.mark.parametrize("where,comm", [("forward", "all_gather"), ("backward", "ring")])
def test_silent_peer_raises_after_timeout(cluster2, where, comm):
    elapsed, silent = cluster2.run(silent_peer, where, comm, deadline=60.0)
    assert silent == "silent"
    assert elapsed >= 1.5  # told after the group's timeout of 2 s, not at once


# ---------------------------------------------------------------------------------------------
# A group of one, no group, and the constructor
# ---------------------------------------------------------------------------------------------


def double_backward(rank: int, P: int) -> str:
    """A second backward through the spanning pieces (the local runs on manual, which has one):
    the message of the error it raises."""
    q, k, v, _, _ = inputs(1, 32, 2, 2, 8)
    sl = slice(rank * 16, (rank + 1) * 16)
    mine = [t[:, sl].clone().requires_grad_() for t in (q, k, v)]
    module = RingDilatedAttention([32], [1], attention_backend="manual")
    out = module(*mine, is_causal=True)
    grads = torch.autograd.grad(out.square().sum(), mine, create_graph=True)
    try:
        sum(g.square().sum() for g in grads).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_double_backward_through_spanning_pieces_says_how_to_get_it(cluster2):
    for msg in cluster2.run(double_backward):
        assert "ring (" in msg and "no second-order gradients" in msg and "backend='manual'" in msg, msg


def group_of_one(rank: int, P: int) -> tuple[float, list[str]] | None:
    """Rank 0 runs the module on a group of one (rank 1 only takes part in creating the group),
    without and with ring_size=2."""
    group = dist.new_group(ranks=[0])
    if rank != 0:
        return None
    q, k, v, _, _ = inputs(2, 20, 4, 2, 8)
    out = RingDilatedAttention([4, 8], [1, 2], process_group=group)(q, k, v, is_causal=True)
    ref, _ = reference_attention(q, k, v, [4, 8], [1, 2], True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RingDilatedAttention([4, 8], [1, 2], process_group=group, ring_size=2)(q, k, v)
    said = [str(w.message) for w in caught if issubclass(w.category, SequenceSplitWarning)]
    return (out - ref).abs().max().item(), said


def test_group_of_one_runs_the_local_op(cluster2):
    (err, said), _ = cluster2.run(group_of_one)
    assert err < 1e-12
    assert any("ring_size=2 but the process group has 1 rank" in m for m in said), said


def test_without_process_group_equals_local_op():
    assert not (dist.is_available() and dist.is_initialized())
    q, k, v, dout, dlse = inputs(1, 24, 4, 2, 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = RingDilatedAttention([6, 24], [1, 3])(*leaves, is_causal=True, return_lse=True)
    got = (out, lse, *torch.autograd.grad(loss(out, lse, dout, dlse), leaves))
    expected = _reference(q, k, v, dout, dlse, [6, 24], [1, 3], True, torch.float64)
    for a, e in zip(got, expected, strict=True):
        assert_within_rule("single", a, e, e, torch.float64)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_inputs_are_refused_naming_what_the_ring_takes():
    """The ring modules take no padding mask: a nested tensor's error says so, and does not send
    the user to a key_padding_mask (or packed sequences) that they do not take."""
    nt = torch.nested.nested_tensor([torch.randn(8, 2, 4), torch.randn(6, 2, 4)])
    with pytest.raises(
        TypeError, match=r"q must be a dense .* nested tensor; RingDilatedAttention takes no"
    ) as e:
        RingDilatedAttention([8], [1])(nt, nt, nt)
    assert "use dilated_attention_varlen or key_padding_mask" not in str(e.value)
    x = torch.nested.nested_tensor([torch.randn(8, 8), torch.randn(6, 8)])
    mha = RingMultiheadDilatedAttention(8, 2, [8], [1])
    with pytest.raises(TypeError, match=r"query must be a dense .* RingMultiheadDilatedAttention takes no"):
        mha(x, x, x)


def test_compat_alias_is_the_ring_module():
    """``RingDilatedAttentionV2Collective`` is RingDilatedAttention itself on every import path
    (dilated_attention.ring.compat holds it), so its modules pickle and copy as RingDilatedAttention."""
    import dilated_attention
    from dilated_attention.ring import compat

    assert compat.RingDilatedAttentionV2Collective is RingDilatedAttention
    assert dilated_attention.RingDilatedAttentionV2Collective is RingDilatedAttention
    assert RingDilatedAttentionV2Collective is RingDilatedAttention  # dilated_attention.ring's
    module = RingDilatedAttentionV2Collective([8, 16], [1, 2], softmax_scale=0.5)
    for twin in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module), copy.copy(module)):
        assert type(twin) is RingDilatedAttention
        assert (twin.segment_lengths, twin.dilation_rates, twin.softmax_scale) == ([8, 16], [1, 2], 0.5)
    with pytest.raises(AttributeError, match="has no attribute 'RingDilatedAttentionV3'"):
        dilated_attention.ring.RingDilatedAttentionV3  # noqa: B018


def test_spec_configurations_construct_and_run():
    device = torch.device("cpu")
    module = RingDilatedAttentionV2Collective(
        segment_lengths=[2048, 4096],
        dilation_rates=[1, 2],
        device=device,
        dtype=torch.float32,
        use_pattern_cache=True,
        enable_memory_pool=True,
        memory_pool_threshold_mb=16.0,
    )
    assert RingDilatedAttentionV2Collective is RingDilatedAttention
    q, k, v, _, _ = inputs(1, 64, 4, 4, 16)
    q, k, v = q.float(), k.float(), v.float()
    out = module(q, k, v)
    torch.testing.assert_close(out, dattn(q, k, v, [2048, 4096], [1, 2]))
    config = StandardizedRingConfig(
        dim=768,
        heads=12,
        segment_lengths=[2048, 4096],
        dilation_rates=[1, 2],
        ring_size=2,
        dtype=torch.float32,
    )
    assert (config.embed_dim, config.num_heads, config.head_dim) == (768, 12, 64)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"unknown_option": 1}, TypeError, "unknown_option"),
        ({"attention_dropout": 0.1}, ValueError, "dropout"),
        ({"comm": "tree"}, ValueError, "comm"),
        ({"process_group": "world"}, TypeError, "process_group"),
        ({"segment_lengths": [4], "dilation_rates": [8]}, ValueError, "dilation_rates"),
        ({"memory_pool_threshold_mb": -1}, ValueError, "memory_pool_threshold_mb"),
        ({"attention_backend": "fastest"}, ValueError, "fastest"),
        ({"check_consistency": "always"}, ValueError, "check_consistency must be True, False or 'once'"),
        ({"check_consistency": 1}, ValueError, "check_consistency"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = {"segment_lengths": [4], "dilation_rates": [1]}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        RingDilatedAttention(**args)


def test_under_a_launcher_without_a_group_raises_saying_what_to_call(monkeypatch):
    """torchrun sets WORLD_SIZE; without init_process_group every process would treat its chunk as
    the whole sequence and return a wrong result: an error that names the call, unless the local
    run is asked for with ring_size=1."""
    assert not (dist.is_available() and dist.is_initialized())
    x = torch.randn(1, 8, 2, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for module in (
        RingDilatedAttention([4], [1]),
        RingMultiheadDilatedAttention(8, 2, [4], [1]),
    ):
        with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*init_process_group\(\.\.\.\).*ring_size=1"):
            module(x, x, x) if isinstance(module, RingDilatedAttention) else module(x.reshape(1, 8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = RingDilatedAttention([4], [1], ring_size=1)(x, x, x)  # a local run, asked for
        torch.testing.assert_close(out, dattn(x, x, x, [4], [1]))


def test_ring_size_without_a_group_warns_at_the_callers_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    x = torch.randn(1, 8, 2, 4)
    module = RingDilatedAttention([4], [1], ring_size=2)
    with pytest.warns(SequenceSplitWarning, match="ring_size=2") as record:
        module(x, x, x)
    assert issubclass(SequenceSplitWarning, DilatedAttentionWarning)
    assert record[0].filename == __file__, record[0].filename
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RingDilatedAttention([4], [1])(x, x, x)


def test_shard_without_group_is_identity():
    x = torch.randn(1, 5, 2, 4)
    assert shard_sequence(x) is x or torch.equal(shard_sequence(x), x)
