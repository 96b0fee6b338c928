"""The kernel launches of the sdpa backend's C++ driver on CUDA, counted from its plan
(dilated_attention/backends/sdpa_launches.py), at the example GPT's geometry: B = 1, 12 query heads
(12, 4, 3 or 1 key/value heads), causal, LongNet branches w = 2048 * 2^i, r = 2^i up to the block
length, for blocks of 16K, 64K and 128K. The counts are printed against the target "at most 4 launches per branch and direction plus a
constant", which every branch meets, and the number of kernel calls the count is built on is
checked against the operator calls of the driver's own CPU run."""

from __future__ import annotations

import pytest
import torch
from common import make_inputs
from reference import reference_attention

from dilated_attention.backends import strided
from dilated_attention.backends.sdpa_launches import driver_calls, views_launches
from dilated_attention.op import views as _views_op

pytestmark = pytest.mark.skipif(not _views_op.available("cpu"), reason="the extension lacks the views driver")

TARGET = 4  # launches per branch and direction


def _gpt_branches(N: int, base: int = 2048) -> tuple[list[int], list[int]]:
    """w = base * 2^i, r = 2^i for every w <= N."""
    segs, rates = [], []
    while base << len(segs) <= N:
        segs.append(base << len(segs))
        rates.append(1 << len(rates))
    return segs, rates


@pytest.mark.parametrize("N", [16 * 1024, 64 * 1024, 128 * 1024], ids=lambda n: f"{n // 1024}K")
@pytest.mark.parametrize("Hkv", [12, 4, 3, 1], ids=lambda h: f"12-{h}")
@pytest.mark.parametrize("kind", ["cudnn", "flash", "efficient"])
def test_gpt_geometry_launch_count(N, Hkv, kind, capsys):
    """The target holds with grouped-query heads too (Hkv = 4, 3, 1: the key/value heads repeated
    per run, or for the whole op where a branch would split), on every CUDA operator the driver
    runs (efficient: float32)."""
    segs, rates = _gpt_branches(N)
    counted = views_launches(1, N, 12, Hkv, segs, rates, True, kind=kind)
    lines = [
        f"N={N // 1024}K Hq=12 Hkv={Hkv} {kind}: {counted.calls} calls, forward {counted.forward}, "
        f"backward {counted.backward} launches"
    ]
    for w, r, b in zip(segs, rates, counted.branches, strict=True):
        lines.append(
            f"  w={w:6d} r={r:2d}: {b.calls:2d} calls, forward {b.forward:3d}, backward {b.backward:3d}"
        )
    lines.append(
        f"  constant: forward {counted.forward_constant}, backward {counted.backward_constant}; "
        f"target: at most {TARGET} per branch and direction, "
        f"{'met' if counted.most_per_branch() <= TARGET else f'not met (most: {counted.most_per_branch()})'}"
    )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert counted.forward == counted.forward_constant + sum(b.forward for b in counted.branches)
    for b in counted.branches:
        assert b.calls >= 1 and b.forward >= b.calls and b.backward >= b.calls  # an operator each
    assert counted.most_per_branch() <= TARGET


@pytest.mark.parametrize("N", [16 * 1024, 64 * 1024, 128 * 1024], ids=lambda n: f"{n // 1024}K")
@pytest.mark.parametrize("Hq,Hkv", [(12, 4), (6, 2)], ids=["12-4", "6-2"])
def test_irregular_grouped_query_heads_launch_as_mha(N, Hq, Hkv, capsys):
    """Grouped-query heads whose key/value heads do not step evenly along a phase (12 / 4 with r =
    2: key/value heads 0, 0, 1, 2, 2, 3) run their branch on k and v repeated to Hq heads (the
    plan's Plan::repeated): no branch takes more kernel calls than with as many key/value heads as
    query heads, and the launches meet the target as those do."""
    segs, rates = _gpt_branches(N)
    gqa = views_launches(1, N, Hq, Hkv, segs, rates, True)
    mha = views_launches(1, N, Hq, Hq, segs, rates, True)
    made = driver_calls(1, N, Hq, Hkv, segs, rates)
    repeated = [any(rep for _, _, _, rep, _ in runs) for runs in made]
    with capsys.disabled():
        print(
            f"\nHq={Hq} Hkv={Hkv} N={N // 1024}K: calls {[b.calls for b in gqa.branches]} "
            f"(Hkv={Hq}: {[b.calls for b in mha.branches]}), forward "
            f"{[b.forward for b in gqa.branches]}, backward {[b.backward for b in gqa.branches]}, "
            f"repeated {repeated}"
        )
    assert any(repeated)  # some branch splits with the key/value heads as they are
    for g, m, rep in zip(gqa.branches, mha.branches, repeated, strict=True):
        assert g.calls <= m.calls
        if rep:  # the branch runs as the same branch of as many key/value heads as query heads
            assert (g.calls, g.forward, g.backward) == (m.calls, m.forward, m.backward)
    assert gqa.most_per_branch() <= max(TARGET, mha.most_per_branch())
    # the repeat costs a constant: one move forward; one move, the zeroed gradients and their sums back
    assert (gqa.forward_constant, gqa.backward_constant) == (
        mha.forward_constant + 1,
        mha.backward_constant + 3,
    )


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "B,N,Hq,Hkv,segs,rates",
    [
        (1, 256, 12, 12, [32, 64, 128, 256], [1, 2, 4, 8]),  # the GPT geometry, scaled down
        (1, 512, 12, 12, [32, 64, 128, 256, 512], [1, 2, 4, 8, 16]),  # r >= Hq: a head per phase
        (2, 200, 4, 4, [64, 128], [1, 2]),  # a short last part: one run per batch entry
        (1, 96, 12, 12, [32, 96], [4, 8]),  # phases of one segment as one call's batch
        (1, 100, 6, 6, [100], [4]),  # phases of different lengths: runs of equal ones
        (1, 256, 12, 4, [32, 64, 128, 256], [1, 2, 4, 8]),  # irregular grouped-query heads
        (2, 200, 6, 2, [64, 128, 200], [1, 2, 4]),  # the same, batch entries and short parts
    ],
)
def test_calls_are_the_driver_operator_calls(B, N, Hq, Hkv, segs, rates, is_causal):
    """The kernel calls the count is built on (the plan's calls, once per batch run) are the
    attention operator calls the driver makes (its CPU run, the same plan and grouping)."""
    q, k, v = make_inputs(B, N, Hq, Hkv, 8, torch.bfloat16, requires_grad=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.dilated_attention.views_fwd(q, k, v, segs, rates, is_causal, 8**-0.5)
    ran = sum(
        e.count for e in prof.key_averages() if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu"
    )
    assert ran == views_launches(B, N, Hq, Hkv, segs, rates, is_causal).calls


def test_kind_is_checked_by_name():
    with pytest.raises(ValueError, match="'tpu'"):
        views_launches(1, 64, 2, 2, [64], [1], False, kind="tpu")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "B,N,Hq,Hkv,segs,rates",
    [
        (1, 64, 12, 12, [64], [8]),  # 8 phases of 2 or 1 heads: the heads along their phases, two calls
        (1, 64, 12, 6, [16, 32, 64], [2, 4, 8]),  # grouped-query heads over several segments: gathered
        (1, 64, 6, 2, [64], [8]),  # r >= Hq: the heads of every key/value head in one call
        (1, 60, 6, 2, [60], [4]),  # phases of 15 rows each
        (1, 61, 6, 3, [61], [4]),  # phases of different lengths
        (1, 96, 12, 12, [16, 32, 96], [2, 4, 8]),  # several segments: the phases gathered
        (3, 48, 8, 4, [16, 24], [2, 4]),  # several batch entries too
        (2, 40, 4, 4, [16], [2]),  # a short last segment: its own runs per batch entry
        (1, 64, 12, 4, [16, 32, 64], [1, 2, 4]),  # irregular grouped-query heads: k, v repeated
        (2, 48, 6, 2, [16, 48], [2, 4]),  # the same with batch entries, and a branch as it is
        (3, 40, 12, 4, [8, 16], [2, 4]),  # repeated, batch entries and a short last segment
        (1, 64, 32, 8, [64], [16]),  # the phases' key/value heads not stepping evenly
    ],
)
def test_phases_run_as_one_call_exactly(B, N, Hq, Hkv, segs, rates, is_causal):
    """The calls of a branch's phases run as one kernel call (their index the kernel's batch dim,
    with the segments and batch entries gathered into it where those are several too), no more
    calls than the plan has (that of as many key/value heads as query heads where the branch runs
    on k and v repeated), and out, lse and every gradient are the float64 reference's."""
    plans = {
        rep: strided.plan_branches(N, Hq, Hq if rep else Hkv, tuple(segs), tuple(rates), True)
        for rep in (0, 1)
    }
    made = driver_calls(B, N, Hq, Hkv, segs, rates)

    def batch_runs(c):  # plan.h folds(): every batch entry at once, else one run each
        return (
            1 if B == 1 or c.part.rows == 1 or (c.part.start == 0 and c.part.rows * c.part.length == N) else B
        )

    repeated = [any(rep for _, _, _, rep, _ in m) for m in made]
    runs = [sum(map(batch_runs, plans[rep][br])) for br, rep in enumerate(repeated)]
    assert [sum(n for _, n, *_ in m) for m in made] == runs  # every plan call once per batch run
    assert sum(map(len, made)) <= sum(runs)
    q, k, v = make_inputs(B, N, Hq, Hkv, 8, torch.float64)
    out, lse = torch.ops.dilated_attention.views_fwd(q, k, v, segs, rates, is_causal, 0.3)
    ref, ref_lse = reference_attention(q, k, v, segs, rates, is_causal, 0.3)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse.detach(), rtol=1e-10, atol=1e-10)
    dout = torch.randn_like(out)
    got = torch.ops.dilated_attention.views_bwd(dout, q, k, v, out, lse, None, segs, rates, is_causal, 0.3)
    for a, e in zip(got, torch.autograd.grad(ref, (q, k, v), dout), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_driver_calls_name_a_bad_batch():
    with pytest.raises(ValueError, match="B must be >= 1, got 0"):
        driver_calls(0, 64, 2, 2, [64], [1])


@pytest.mark.parametrize("seed", range(4))
def test_random_geometries_match_the_reference_in_float64(seed):
    """The driver's runs on random geometries (batches of several sequences, several segments and
    branches, rates above and below the head count, grouped-query heads, causal or not): out, lse
    and every gradient are the float64 reference's, whichever of the plan's calls run as one
    (gathered or not)."""
    import random

    rng = random.Random(seed)
    for _ in range(10):
        B, Hkv = rng.randint(1, 3), rng.randint(1, 3)
        Hq = Hkv * rng.randint(1, 4)
        N = rng.choice([rng.randint(1, 40), 8 * rng.randint(1, 8)])
        segs = [rng.choice([rng.randint(1, N + 4), 8 * rng.randint(1, 4)]) for _ in range(rng.randint(1, 3))]
        rates = [rng.randint(1, max(1, min(w, 2 * Hq))) for w in segs]
        is_causal, scale = rng.random() < 0.5, rng.choice([0.3, -0.2])
        q, k, v = make_inputs(B, N, Hq, Hkv, 4, torch.float64, seed=rng.randint(0, 1000))
        geometry = (B, N, Hq, Hkv, segs, rates, is_causal, scale)
        out, lse = torch.ops.dilated_attention.views_fwd(q, k, v, segs, rates, is_causal, scale)
        ref, ref_lse = reference_attention(q, k, v, segs, rates, is_causal, scale)
        torch.testing.assert_close(
            out, ref.detach(), rtol=1e-10, atol=1e-10, msg=lambda m, g=geometry: f"{g}: {m}"
        )
        torch.testing.assert_close(
            lse, ref_lse.detach(), rtol=1e-10, atol=1e-10, msg=lambda m, g=geometry: f"{g}: {m}"
        )
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        got = torch.ops.dilated_attention.views_bwd(
            dout, q, k, v, out, lse, dlse, segs, rates, is_causal, scale
        )
        want = torch.autograd.grad((ref, ref_lse), (q, k, v), (dout, dlse))
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9, msg=lambda m, g=geometry: f"{g}: {m}")
