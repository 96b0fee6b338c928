"""Non-finite values (NaN, +-inf) in q, k or v reach exactly the rows that read them, forward, and
stay in their segment backward, on every backend that runs on the CPU. Found mishandled by a
randomized run against the float64 reference (the other such inputs: tests/backends/test_hostile_inputs.py).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from backend_fixtures import RUNNABLE, fresh_selection, one_thread  # noqa: F401
from common import make_inputs

from dilated_attention import dilated_attention as dattn

# ----------------------------------------------------------------------------------------------
# Non-finite values reach exactly the rows that read them
# ----------------------------------------------------------------------------------------------

NF_SHAPE = (1, 24, 4, 2, 8)  # B, N, Hq, Hkv, D
NF_SEGS, NF_RATES = [8, 16], [1, 2]


def _readers(N, Hq, Hkv, is_causal):
    """reads[h, p, x]: row p of query head h reads key x (some branch); covered[h, p]."""
    from reference import multiplicity

    mult = multiplicity(N, Hq, NF_SEGS, NF_RATES, is_causal) > 0
    return mult, mult.any(-1)


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "tensor,value",
    [("v", math.nan), ("v", math.inf), ("v", -math.inf), ("q", math.nan), ("q", math.inf), ("k", math.nan)],
)
def test_nonfinite_value_reaches_exactly_the_rows_that_read_it(backend, is_causal, tensor, value):
    _, N, Hq, Hkv, D = NF_SHAPE
    reads, covered = _readers(N, Hq, Hkv, is_causal)
    G = Hq // Hkv
    for pos, head, ch in [(5, 1, 3), (13, 0, 0), (20, 1, 7)]:
        q, k, v = make_inputs(*NF_SHAPE, torch.float32, requires_grad=False)
        clean = dattn(q, k, v, NF_SEGS, NF_RATES, is_causal=is_causal, return_lse=True, backend=backend)
        bad = {"q": q, "k": k, "v": v}[tensor].clone()
        bad[0, pos, head, ch] = value
        args = {"q": q, "k": k, "v": v, tensor: bad}
        out, lse = dattn(
            args["q"],
            args["k"],
            args["v"],
            NF_SEGS,
            NF_RATES,
            is_causal=is_causal,
            return_lse=True,
            backend=backend,
        )
        if tensor == "q":  # row pos of head `head` reads its own query
            hit = torch.zeros(Hq, N, dtype=torch.bool)
            hit[head, pos] = covered[head, pos]
        else:  # the rows of the query heads of key/value head `head` that read key pos
            hit = torch.zeros(Hq, N, dtype=torch.bool)
            for h in range(head * G, (head + 1) * G):
                hit[h] = reads[h, :, pos]
        assert hit.any()
        hit_bnh = hit.T[None]  # (1, N, Hq)
        channels = slice(ch, ch + 1) if tensor == "v" else slice(None)
        # Rows that do not read it: exactly as without it.
        same = ~hit_bnh
        # Within float32 rounding (not bitwise: BLAS may pick other kernels); NaN or inf would fail.
        torch.testing.assert_close(out[same], clean[0][same], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[~hit[None]], clean[1][~hit[None]], rtol=1e-5, atol=1e-6)
        # Rows that read it: non-finite where it enters (v: its channel only; q, k: the row and lse).
        assert not torch.isfinite(out[hit_bnh][:, channels]).any()
        if tensor == "v":
            other = torch.ones(D, dtype=torch.bool)
            other[ch] = False
            torch.testing.assert_close(
                out[hit_bnh][:, other], clean[0][hit_bnh][:, other], rtol=1e-5, atol=1e-6
            )
            torch.testing.assert_close(lse, clean[1], rtol=1e-5, atol=1e-6)
        else:
            assert not torch.isfinite(lse[hit[None]]).any()


@pytest.mark.parametrize("backend", RUNNABLE)
def test_all_minus_inf_keys_give_nan_rows(backend):
    """Every key is -inf (and, in a second run, only keys 3 and later): the scores of the rows that
    read them are NaN or +inf, so out and lse are not finite there, on every backend."""
    q, k, v = make_inputs(1, 8, 1, 1, 4, torch.float32, requires_grad=False)
    for first in (0, 3):
        kk = k.clone()
        kk[0, first:] = -math.inf
        out, lse = dattn(q, kk, v, [8], [1], is_causal=True, return_lse=True, backend=backend)
        assert not torch.isfinite(out[0, first:]).any() and not torch.isfinite(lse[0, 0, first:]).any()
        assert torch.isfinite(out[0, :first]).all() and torch.isfinite(lse[0, 0, :first]).all()


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_nonfinite_value_backward_stays_in_its_segment(backend, tensor):
    """The backward may spread a non-finite value within the dilated sub-sequences it touches
    (docs/backends.md), never to another segment."""
    q, k, v = make_inputs(1, 32, 2, 2, 8, torch.float32, requires_grad=False)
    bad = {"q": q, "k": k, "v": v}[tensor].clone()
    bad[0, 5, 1, 2] = math.nan  # segment 0 of w = 16
    args = {"q": q, "k": k, "v": v, tensor: bad}
    inputs = [t.clone().requires_grad_() for t in (args["q"], args["k"], args["v"])]
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(1, 32, 2, 8, generator=g)
    for ins in (inputs, clean):
        out = dattn(*ins, [16], [1], is_causal=True, backend=backend)
        out.backward(dout)
    for a, c in zip(inputs, clean, strict=True):
        torch.testing.assert_close(a.grad[0, 16:], c.grad[0, 16:], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Backward: outside the sub-sequences that hold a non-finite value or a row that reads one,
# gradients are finite and as without it
# ----------------------------------------------------------------------------------------------


def _unspecified(N, Hq, Hkv, segs, rates, is_causal, tensor, pos, head):
    """The gradient positions that docs/backends.md leaves unspecified for one non-finite entry of
    ``tensor`` at (pos, head): those of every dilated sub-sequence (branch, segment, query head's
    phase) that holds the entry or a row that reads it. Returns (N, Hq) for dq and (N, Hkv) for
    dk and dv."""
    from reference import multiplicity

    G = Hq // Hkv
    reads = multiplicity(N, Hq, segs, rates, is_causal) > 0  # (Hq, N, N)
    touched = torch.zeros(Hq, N, dtype=torch.bool)  # the entry itself, and the rows that read it
    if tensor == "q":
        touched[head, pos] = True
    else:
        for h in range(head * G, (head + 1) * G):
            touched[h] = reads[h, :, pos]
            touched[h, pos] = True
    out = torch.zeros(Hq, N, dtype=torch.bool)
    p = torch.arange(N)
    for w, r in zip(segs, rates, strict=True):
        for h in range(Hq):
            phase = (p % w) % r == h % r
            for s in range((N + w - 1) // w):
                sub = phase & (p // w == s)
                if (sub & touched[h]).any():
                    out[h] |= sub
    return out.T, out.view(Hkv, G, N).any(1).T


# (N, Hq, Hkv, segment_lengths, dilation_rates, pos, head): a causal case of each kind where the
# sdpa backward leaked a non-finite v into dk of another branch (its merged delta read 0 * inf)
LEAKED = [(24, 1, 1, [32, 8, 32], [4, 4, 3], 15, 0), (24, 2, 2, [8, 16], [1, 4], 14, 0)]


def _random_cases(seed, count):
    rng = random.Random(seed)
    cases = list(LEAKED)
    while len(cases) < count:
        N, Hkv = rng.choice([16, 24, 33]), rng.choice([1, 2])
        Hq = Hkv * rng.choice([1, 2])
        segs = [rng.choice([4, 8, 16, 32]) for _ in range(rng.choice([1, 2, 3]))]
        rates = [rng.randint(1, min(w, 4)) for w in segs]
        cases.append((N, Hq, Hkv, segs, rates, rng.randrange(N), rng.randrange(Hq)))
    return cases


@pytest.mark.parametrize("backend", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "tensor,value",
    [("v", math.nan), ("v", math.inf), ("v", -math.inf), ("q", math.nan), ("k", math.nan), ("k", math.inf)],
)
def test_nonfinite_value_backward_leaves_other_subsequences_as_without_it(
    backend, dtype, is_causal, tensor, value
):
    """One NaN or inf at random positions and geometries: every gradient position outside the
    sub-sequences that hold it or a row that reads it is finite and, within the dtype's rule,
    the float64 reference's gradient of the inputs without it."""
    from reference import reference_attention
    from tolerance import assert_within_rule

    D = 8
    for i, (N, Hq, Hkv, segs, rates, pos, head) in enumerate(_random_cases(11, 10)):
        g = torch.Generator().manual_seed(100 + i)
        q = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64)
        k, v = (torch.randn(1, N, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64)
        clean = {"q": q, "k": k, "v": v}
        head = head % clean[tensor].shape[2]
        bad = clean[tensor].clone()
        bad[0, pos, head, i % D] = value
        ins = [(bad if name == tensor else clean[name]).to(dtype).requires_grad_() for name in "qkv"]
        out = dattn(*ins, segs, rates, is_causal=is_causal, backend=backend)
        got = torch.autograd.grad(out, ins, dout.to(dtype))
        leaves = [clean[name].clone().requires_grad_() for name in "qkv"]
        ref = torch.autograd.grad(reference_attention(*leaves, segs, rates, is_causal)[0], leaves, dout)
        low = [clean[name].to(dtype).requires_grad_() for name in "qkv"]
        plain_out = reference_attention(*low, segs, rates, is_causal, dtype=dtype)[0]
        plain = torch.autograd.grad(plain_out, low, dout.to(dtype))
        free_q, free_kv = _unspecified(N, Hq, Hkv, segs, rates, is_causal, tensor, pos, head)
        for name, a, e, p, free in zip(
            ("dq", "dk", "dv"), got, ref, plain, (free_q, free_kv, free_kv), strict=True
        ):
            keep = ~free[None]
            where = f"{name}, case {i}: N={N}, Hq={Hq}, Hkv={Hkv}, {segs}, {rates}, {tensor}[{pos}, {head}]"
            assert torch.isfinite(a[keep]).all(), f"{where}: non-finite outside its sub-sequences"
            if keep.any():
                assert_within_rule(where, a[keep], e[keep], p[keep], dtype)
