"""Non-finite values (NaN, +-inf) in q, k or v reach exactly the rows that read them, forward, and
stay in their segment backward, on every backend that runs on the CPU. Found mishandled by a
randomized run against the float64 reference (the other such inputs: tests/test_hostile_inputs.py).
"""

from __future__ import annotations

import math

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
