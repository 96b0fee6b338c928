"""The CUDA kernels, run on the CPU through their emulation (tests/cuda_emulation), with scores far
beyond any model's logits (~4e9 to ~5e30, through ``softmax_scale`` or through large inputs: the
argument checks accept scales up to ~1.7e38) against the float64 reference under SPEC section 4's
rule: the SIMT kernels (float32, bfloat16, float64), the sm80 and the sm90 tensor-core kernels
(bfloat16); out, lse, dq, dk, dv; one to three branches, causal, grouped-query attention. The SIMT
float32 dq and dk were 1.5-6.5x the rule while the backward formed dP - delta as
dout . v - (dout . out - dlse); it now forms dout . (v - out) + dlse, as the CPU kernels do (at
most 0.7x).

The forwards' exponents are single float scores less their running max (<= 0 at any magnitude).
The backwards read the saved lse in base 2, hi + lo: the tensor-core kernels took 2^(s - hi)
alone, so a key read through two branches got P = 1 instead of 1/2 once hi's unit in the last
place passed 1 (scores ~1e7: dv off by ~6); every kernel took the lse's rounding (double) into P,
up to 2^-9 at 1e12 and any exponent at all past ~1e15 (infinite gradients). They now follow the
CPU kernels' rule (common.cuh da_lse_slack, da_snap_exponent, da_exponent; csrc/cpu/softmax.h).

As on the CPU, a double lse cannot hold ln(l) past ~5e14: rows whose largest key is read through
several branches get P = 1 per branch there; such cases check out and lse under the rule and the
gradients for P <= 1 only (``_check``, the bound on dv).
"""

from __future__ import annotations

import pytest
import torch
from common import HUGE_SCORE_GEOMETRIES, HUGE_SCORE_MAGNITUDES, grads
from reference import multiplicity, reference_attention
from test_cuda import _emu_call, emu  # noqa: F401  (emu: the emulation's fixture)
from tolerance import assert_within_rule

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

D = 32  # the tensor-core kernels' smallest head dim

# (softmax_scale or None for 1/sqrt(D), scale of q and k): the largest |score| is about 2e10,
# 2e13, 2e31, 7e11 and 6e30.
MAGNITUDES = HUGE_SCORE_MAGNITUDES

# (N, Hq, Hkv, segment_lengths, dilation_rates, is_causal)
GEOMETRIES = HUGE_SCORE_GEOMETRIES

# (dtype, family: 0 sm80 tensor cores, 1 SIMT, 2 sm90 tensor cores)
KERNELS = [
    pytest.param(torch.float32, 1, id="simt-fp32"),
    pytest.param(torch.bfloat16, 1, id="simt-bf16"),
    pytest.param(torch.float64, 1, id="simt-fp64"),
    pytest.param(torch.bfloat16, 0, id="sm80-bf16"),
    pytest.param(torch.bfloat16, 2, id="sm90-bf16"),
]

# Where a double lse still holds ln(l) well below float32's rounding of P for rows whose largest
# key is read through several branches (tests/op/test_op_huge_scores.py).
DOUBLE_LSE_LIMIT = 1e14


def _inputs(seed, N, Hq, Hkv, mag, D=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64) * mag
    k = torch.randn(1, N, Hkv, D, generator=g, dtype=torch.float64) * mag
    v = torch.randn(1, N, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, Hq, N, generator=g, dtype=torch.float64)
    return (q, k, v), dout, dlse


def _emulated(emu, q, k, v, dout, dlse, segs, rates, causal, family, scale):  # noqa: F811
    """out, lse (float64, as the op saves it for its backward) and (dq, dk, dv) of the emulated
    kernels at softmax_scale ``scale`` (test_cuda's harness, _emu_call)."""
    tiling = (0, 0, 4, 32) if family == 1 else (0, 0, 16, 64)
    B, N, Hq, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, N, dtype=torch.float64)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    emu.da_emu_lse64(1)
    try:
        _emu_call(
            emu.da_emu_forward, q.dtype, family, q, k, segs, rates, causal, scale, tiling, (q, k, v, out, lse)
        )
        _emu_call(emu.da_emu_backward, q.dtype, family, q, k, segs, rates, causal, scale, tiling,
                  (dout, q, k, v, out, lse, dlse, dq, dk, dv))  # fmt: skip
    finally:
        emu.da_emu_lse64(0)
    return out, lse, (dq, dk, dv)


def _run(emu, N, Hq, Hkv, segs, rates, causal, scale, mag, dtype, family, D=D):  # noqa: F811
    """The emulated kernels against the float64 reference: out, lse, dq, dk and dv under the rule (float64 kernels: against plain PyTorch's float32 error, as the rule's
    float64 floor, 1e-10, is below the rounding of an lse of ~1e10); where a double lse cannot hold
    ln(l) (several branches past DOUBLE_LSE_LIMIT), P <= 1 instead: every gradient finite and dv at
    most the sum of |dout| over the rows (with their branches) that read the key."""
    (q, k, v), dout, dlse = _inputs(7, N, Hq, Hkv, mag, D)
    s = scale if scale is not None else D**-0.5
    leaves = [t.to(dtype).contiguous() for t in (q, k, v)]
    rule = torch.float32 if dtype == torch.float64 else dtype
    lse_t = torch.float64 if dtype == torch.float64 else torch.float32
    out, lse, got = _emulated(emu, *leaves, dout.to(dtype).contiguous(), dlse.to(lse_t).contiguous(), segs, rates,
                              causal, family, s)  # fmt: skip
    G = Hq // Hkv
    sc = torch.einsum("bphd,bxhd->bhpx", leaves[0].double(), leaves[1].double().repeat_interleave(G, 2)) * s
    assert sc.abs().max().item() > 1e9  # past 2^31 in base 2
    r64 = [t.double().requires_grad_() for t in leaves]
    rpl = [t.to(rule).clone().requires_grad_() for t in leaves]
    out64, lse64 = reference_attention(*r64, segs, rates, causal, softmax_scale=s)
    outp, lsep = reference_attention(*rpl, segs, rates, causal, softmax_scale=s, dtype=rule)
    assert_within_rule("out", out, out64, outp, rule)
    assert_within_rule("lse", lse, lse64, lsep, rule)
    if len(segs) > 1 and sc.abs().max().item() >= DOUBLE_LSE_LIMIT:
        for g in got:
            assert torch.isfinite(g).all(), "a non-finite gradient"
        mult = multiplicity(N, Hq, segs, rates, causal).double()  # (Hq, N queries, N keys)
        bound = torch.einsum("hpx,phd->xhd", mult, dout[0].abs()).view(N, Hkv, G, -1).sum(2)
        assert (got[2][0].double().abs() <= bound * (1 + 1e-2) + 1e-6).all()
        return
    ref = grads(out64, lse64, r64, dout, dlse)
    plain = grads(outp, lsep, rpl, dout, dlse)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(name, a, e, p, rule)


@pytest.mark.parametrize("dtype,family", KERNELS)
@pytest.mark.parametrize("scale,mag", MAGNITUDES)
@pytest.mark.parametrize("N,Hq,Hkv,segs,rates,causal", GEOMETRIES)
def test_emulated_huge_scores_within_rule(emu, N, Hq, Hkv, segs, rates, causal, scale, mag, dtype, family):  # noqa: F811
    """out, lse, dq, dk, dv within the rule."""
    _run(emu, N, Hq, Hkv, segs, rates, causal, scale, mag, dtype, family)


@pytest.mark.parametrize("head_dim", [128, 192])
def test_emulated_sm90_dkv_huge_scores_at_wide_head_dims(emu, head_dim):  # noqa: F811
    """The sm90 dk/dv pass reads the lse's low part from its stage (sLlo) at head dims whose chunks
    are 16 (128) and 32 (192) queries in five and four stages, two branches reading the keys."""
    _run(emu, 40, 2, 2, [8, 16], [1, 2], True, 1e9, 1.0, torch.bfloat16, 2, D=head_dim)
