"""The native CPU kernels with scores far beyond any model's logits (1e9 to 1e30, through
``softmax_scale`` or through large inputs: the argument checks accept scales up to ~1.7e38) against
the float64 reference under SPEC section 4's rule: out, lse and every gradient, float32 and
bfloat16, one to three branches, causal or not; the pieces of sequence parallelism with their keys
split and merged as the ring does; and the decode step.

The kernels keep each float score as hi + lo and took 2^(s - m) as 2^((hi - m) + lo) with m the
largest hi: from |s| ~ 1.5e9 (2^31 in base 2) lo, up to half a unit in the last place of m, passed
the +-127 clamp of their 2^x, so the weights lost their ratios and sums of 2^127 overflowed (out off
by 4, infinite lse). The forward now measures the exponents from the row's largest (hi, lo) pair
wherever the row's largest score reaches 2^12, and the backward rounds the exponents of rows whose
lse is that large to what a double lse can tell (softmax.h: pair_ref_lo, lse_slack,
snap_exponent): exact for a row whose weight sits on keys at its largest score (P = 1 / c for c
such keys, counting the branches that read each), which at these magnitudes is nearly every row.

A double lse holds ln(l) only while |lse| is well under 2^53: past ~5e14 it cannot tell a key read
through two branches (P = 1/2 each) from one read once (P = 1); there the forward and the
one-branch backward stay exact, and the several-branch backward is only bounded
(``test_several_branches_past_a_double_lse``).
"""

from __future__ import annotations

import pytest
import torch
from common import HUGE_SCORE_GEOMETRIES, HUGE_SCORE_MAGNITUDES, grads, one_thread  # noqa: F401  (one_thread: an autouse fixture)
from reference import reference_attention, reference_piece
from tolerance import assert_within_rule

from dilated_attention import dilated_attention as dattn
from dilated_attention import op as _ops
from dilated_attention.decode import BoundedDilatedKVCache
from dilated_attention.merge import merge

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # rates above the head count

D = 16

# (softmax_scale or None for 1/sqrt(D), scale of q and k): the largest |score| is about 4e9, 4e12,
# 4e30, 2e11 and 5e30 (q . k / sqrt(D) has standard deviation |q| |k|).
MAGNITUDES = HUGE_SCORE_MAGNITUDES

# (N, Hq, Hkv, segment_lengths, dilation_rates, is_causal)
GEOMETRIES = HUGE_SCORE_GEOMETRIES

DTYPES = [torch.float32, torch.bfloat16]

# Where a double lse still holds ln(l) to well below float32's rounding of P for rows whose largest
# key is read through several branches (lse_slack: |lse / ln 2| * 2^-50 under 1/4).
DOUBLE_LSE_LIMIT = 1e14


def _inputs(seed, N, Hq, Hkv, mag, nk=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64) * mag
    k = torch.randn(1, nk or N, Hkv, D, generator=g, dtype=torch.float64) * mag
    v = torch.randn(1, nk or N, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, Hq, N, generator=g, dtype=torch.float64)
    return (q, k, v), dout, dlse


def _largest_score(q, k, scale):
    G = q.shape[2] // k.shape[2]
    s = torch.einsum("bphd,bxhd->bhpx", q, k.repeat_interleave(G, dim=2)) * scale
    return s.abs().max().item()


def _check(name, out, lse, leaves, reference, dtype, dout, dlse, gradients=True):
    """out, lse and (gradients) dq, dk, dv of the kernels against reference (q, k, v, dtype) in
    float64 and in dtype (plain PyTorch), under the rule."""
    r64 = tuple(t.detach().double().requires_grad_() for t in leaves)
    rpl = tuple(t.detach().clone().requires_grad_() for t in leaves)
    out64, lse64 = reference(*r64, None)
    outp, lsep = reference(*rpl, dtype)
    assert_within_rule(f"{name} out", out, out64, outp, dtype)
    assert_within_rule(f"{name} lse", lse, lse64, lsep, dtype)
    got = grads(out, lse, leaves, dout, dlse)
    if not gradients:
        for g in got:
            assert torch.isfinite(g).all(), f"{name}: a non-finite gradient"
        return got
    ref = grads(out64, lse64, r64, dout, dlse)
    plain = grads(outp, lsep, rpl, dout, dlse)
    for gname, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(f"{name} {gname}", a, e, p, dtype)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale,mag", MAGNITUDES)
@pytest.mark.parametrize("N,Hq,Hkv,segs,rates,causal", GEOMETRIES)
def test_huge_scores_within_rule(N, Hq, Hkv, segs, rates, causal, scale, mag, dtype):
    (q, k, v), dout, dlse = _inputs(7, N, Hq, Hkv, mag)
    leaves = tuple(t.to(dtype).requires_grad_() for t in (q, k, v))
    s = scale if scale is not None else D**-0.5
    largest = _largest_score(*(t.double() for t in leaves[:2]), s)
    assert largest > 1e9  # past 2^31 in base 2, where the kernels' weights left [0, 1]
    out, lse = dattn(*leaves, segs, rates, is_causal=causal, softmax_scale=scale, return_lse=True,
                     backend="native")  # fmt: skip
    assert out.dtype == dtype and lse.dtype == torch.float32

    def reference(q, k, v, dt):
        return reference_attention(q, k, v, segs, rates, causal, softmax_scale=scale, dtype=dt)

    # several branches past a double lse: test_several_branches_past_a_double_lse
    full = len(segs) == 1 or largest < DOUBLE_LSE_LIMIT
    _check("native", out, lse, leaves, reference, dtype, dout, dlse, gradients=full)


def test_several_branches_past_a_double_lse():
    """Scores ~5e30 through three branches: out and lse within the rule, and P <= 1 in the
    backward (lse_slack): dv = sum_p P dout is at most the sum of |dout| over the rows (with their
    branches) that read the key, where unbounded weights gave infinite gradients."""
    N, Hq, Hkv, segs, rates = 41, 4, 2, [4, 8, 32], [1, 2, 4]
    (q, k, v), dout, dlse = _inputs(3, N, Hq, Hkv, 1.0)
    leaves = tuple(t.float().requires_grad_() for t in (q, k, v))
    out, lse = dattn(*leaves, segs, rates, softmax_scale=1e30, return_lse=True, backend="native")

    def reference(q, k, v, dt):
        return reference_attention(q, k, v, segs, rates, softmax_scale=1e30, dtype=dt)

    _, _, dv = _check("native", out, lse, leaves, reference, torch.float32, dout, dlse, gradients=False)
    from reference import multiplicity

    mult = multiplicity(N, Hq, segs, rates, False).double()  # (Hq, N queries, N keys)
    G = Hq // Hkv
    bound = torch.einsum("hpx,phd->xhd", mult, dout[0].abs())  # per key and query head
    bound = bound.view(N, Hkv, G, D).sum(2)
    assert (dv[0].double().abs() <= bound * (1 + 1e-5) + 1e-6).all()


# (nq, nk, Hq, Hkv, causal offset or None, the key at which the keys are cut)
PIECES = [
    pytest.param(24, 56, 2, 1, None, 23, id="dense-gqa"),
    pytest.param(33, 64, 4, 2, 31, 40, id="causal-offset"),
]


@pytest.mark.skipif(not _ops.has_piece_kernel("cpu"), reason="extension built without piece op")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale,mag", MAGNITUDES)
@pytest.mark.parametrize("nq,nk,Hq,Hkv,offset,cut", PIECES)
def test_piece_huge_scores_within_rule(nq, nk, Hq, Hkv, offset, cut, scale, mag, dtype):
    """The pieces as the ring runs them: the keys in two blocks, each block's forward, the merge
    (float64 lse), then each block's backward fed the merged out and lse; the gradients summed."""
    (q, k, v), dout, dlse = _inputs(11, nq, Hq, Hkv, mag, nk)
    s = scale if scale is not None else D**-0.5
    causal = offset is not None
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    parts = [(0, cut), (cut, nk)]
    outs, lses = [], []
    for lo, hi in parts:
        o, lse = _ops.piece_forward(qd, kd[:, lo:hi], vd[:, lo:hi], causal, (offset or 0) - lo, s, True)
        outs.append(o)
        lses.append(lse)
    out, lse = merge(outs, lses)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dks, dvs = [], []
    for lo, hi in parts:
        g = _ops.piece_backward(dout.to(dtype), qd, kd[:, lo:hi], vd[:, lo:hi], out.to(dtype), lse,
                                dlse, causal, (offset or 0) - lo, s)  # fmt: skip
        dq += g[0].double()
        dks.append(g[1])
        dvs.append(g[2])
    got = (dq, torch.cat(dks, 1), torch.cat(dvs, 1))

    def ref(dt):  # on the inputs the kernels read: q, k, v rounded to dtype
        leaves = tuple(t.to(dt or torch.float64).detach().requires_grad_() for t in (qd, kd, vd))
        o, ls = reference_piece(*leaves, offset, s, dtype=dt)
        return o, ls, grads(o, ls, leaves, dout, dlse)

    out64, lse64, g64 = ref(None)
    outp, lsep, gp = ref(dtype)
    assert_within_rule("piece out", out.to(dtype), out64, outp, dtype)
    assert_within_rule("piece lse", lse.float(), lse64, lsep, dtype)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, g64, gp, strict=True):
        assert_within_rule(f"piece {name}", a, e, p, dtype)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "slots"])
@pytest.mark.parametrize("scale", [1e9, 1e30], ids=lambda s: f"scale-{s:g}")
def test_decode_huge_scores_within_rule(scale, fused):
    """The decode step after a native prefill, token by token over three branches, against the
    reference of the whole causal sequence: fused (its own kernel, csrc/cpu/decode_cpu.cpp: the
    scores single floats less their maximum) and not (op/slots.py attend_slots: the weights
    normalised by their own softmax, not from a rounded lse)."""
    N, Hq, Hkv, segs, rates = 24, 4, 2, (4, 8, 16), (1, 2, 4)
    (q, k, v), _, _ = _inputs(5, N, Hq, Hkv, 1.0)
    q, k, v = (t.float() for t in (q, k, v))
    cache = BoundedDilatedKVCache(1, 1, Hq, Hkv, D, segs, rates, dtype=torch.float32, fused=fused)
    outs, lses = [], []
    for a, b in [(0, 5)] + [(p, p + 1) for p in range(5, N)]:
        o, lse = cache.attend(0, q[:, a:b], k[:, a:b], v[:, a:b], return_lse=True, softmax_scale=scale)
        cache.advance(b - a)
        outs.append(o)
        lses.append(lse)
    out64, lse64 = reference_attention(q.double(), k.double(), v.double(), segs, rates, True, scale)
    outp, lsep = reference_attention(q, k, v, segs, rates, True, scale, dtype=torch.float32)
    assert_within_rule("decode out", torch.cat(outs, 1), out64, outp, torch.float32)
    assert_within_rule("decode lse", torch.cat(lses, -1), lse64, lsep, torch.float32)


@pytest.mark.parametrize("top,gap", [(1e5, 23.5), (1e5, 24.5), (3e3, 30.0)])
def test_float64_gradients_keep_small_weights_at_large_scores(top, gap):
    """float64 rows are not rounded to a slack below 2^22 (their lse's own rounding is smaller): a
    row's second key, of weight e^-gap (~1e-10) next to its top key at a score of ~1e5, keeps its
    weight in dv within float64's rule (the reference is float64 itself: twice its error is 0, plus
    the absolute floor)."""
    N = 8
    q = torch.zeros(1, N, 1, 4, dtype=torch.float64)
    k = torch.zeros(1, N, 1, 4, dtype=torch.float64)
    q[..., 0] = 1.0
    k[0, 0, 0, 0], k[0, 1, 0, 0] = top, top - gap
    for j in range(2, N):
        k[0, j, 0, 0] = top - 200 - j
    g = torch.Generator().manual_seed(1)
    v, dout = (
        torch.randn(1, N, 1, 4, generator=g, dtype=torch.float64),
        torch.randn(1, N, 1, 4, generator=g, dtype=torch.float64),
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dattn(*leaves, [N], [1], softmax_scale=1.0, backend="native")
    got = torch.autograd.grad(out, leaves, dout)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*refs, [N], [1], False, 1.0)
    want = torch.autograd.grad(ref, refs, dout)
    for name, a, e in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=0, msg=name)
