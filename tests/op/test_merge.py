"""The log-sum-exp merge (dilated_attention.merge, SPEC section 3) against float64 references.

The parts are attention over disjoint key sets of the same queries, with rows that some parts do
not cover (lse -inf, out 0) and rows that no part covers. Each path of the one rule (the
differentiable :func:`merge`, the running state in place and out of place) must give, from the
parts as the kernels hand them over (out in the inputs' dtype, lse in float32), the float64 merge
of those same parts to within the rounding of its result, at logits large enough that a float32
running lse would miss by tens of float32 epsilons; the union of the key sets computed directly
in float64 to within the parts' own rounding; rows no part covers as out 0 and lse -inf without
NaN, forward and backward; and gradients through out and lse equal to float64 autograd's.
"""

from __future__ import annotations

import math

import pytest
import torch

from dilated_attention.merge import (
    across,
    beside,
    finish_state,
    merge,
    merge_state_,
    merged_state,
    start_state,
)

B, N, NK, H, D, PARTS = 2, 24, 36, 3, 8, 3
EPS32 = torch.finfo(torch.float32).eps


def _attention(q, k, v, visible, scale):
    """float64 (out (B, N, H, D), lse (B, H, N)) of q over the visible keys; out 0, lse -inf where
    a row sees none."""
    s = torch.einsum("bnhd,bkhd->bhnk", q, k) * scale
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    w = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.einsum("bhnk,bkhd->bnhd", w, v), lse


def _parts(scale: float, seed: int = 0):
    """The union's (out, lse) in float64, and PARTS float64 parts over disjoint key sets."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, NK, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, NK, H, D, generator=g, dtype=torch.float64)
    visible = torch.rand(B, H, N, NK, generator=g) < 0.7
    visible[:, :, :3] = False  # rows that no part covers
    owner = torch.randint(0, PARTS, (NK,), generator=g)  # each key in one part
    owner[:4] = torch.arange(4) % PARTS  # every part has keys
    parts = []
    for j in range(PARTS):
        vis = visible & (owner == j)
        vis[:, :, 3 + j :: 5] = False  # rows that this part does not cover
        parts.append(_attention(q, k, v, vis, scale))
    union_vis = torch.zeros_like(visible)
    for j in range(PARTS):
        union_vis |= visible & (owner == j)
        union_vis[:, :, 3 + j :: 5] &= owner != j
    return _attention(q, k, v, union_vis, scale), parts


def _merge64(outs, lses):
    """The float64 merge of the parts, by torch.logsumexp; differentiable."""
    L = torch.stack([x.double() for x in lses])
    lse = torch.logsumexp(L, dim=0)
    w = torch.exp(L - torch.where(torch.isfinite(lse), lse, 0.0)).transpose(-1, -2).unsqueeze(-1)
    return (w * torch.stack([o.double() for o in outs])).sum(dim=0), lse


def _by_merge(outs, lses):
    return merge(outs, lses)


def _by_state_in_place(outs, lses):
    wt = torch.float64 if lses[0].dtype == torch.float32 else torch.float32
    acc, m, den = start_state(outs[0], beside(lses[0]), wt)
    for o, lse in zip(outs[1:], lses[1:], strict=True):
        merge_state_(acc, m, den, o, beside(lse))
    out, lse = finish_state(acc, m, den)
    return out, across(lse)


def _by_state_out_of_place(outs, lses):
    wt = torch.float64 if lses[0].dtype == torch.float32 else torch.float32
    state = start_state(outs[0], beside(lses[0]), wt)
    for o, lse in zip(outs[1:], lses[1:], strict=True):
        state = merged_state(*state, o, beside(lse))
    out, lse = finish_state(*state)
    return out, across(lse)


PATHS = {"merge": _by_merge, "state_": _by_state_in_place, "merged_state": _by_state_out_of_place}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.3, 60.0])  # |lse| of a few, and of hundreds
def test_merge_of_disjoint_parts(path, dtype, scale):
    (out_u, lse_u), parts = _parts(scale)
    outs = [o.to(dtype) for o, _ in parts]  # as the kernels hand them over
    lses = [lse.float() for _, lse in parts]
    out, lse = PATHS[path](outs, lses)
    ref_out, ref_lse = _merge64(outs, lses)

    covered = torch.isfinite(ref_lse)
    assert not covered[:, :, :3].any() and covered.any()
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out.transpose(1, 2)[~covered], torch.zeros_like(out.transpose(1, 2)[~covered]))
    assert torch.isneginf(lse[~covered]).all()

    # the merge's own error: the rounding of its float32 result (a float32 running lse would miss
    # by |lse| times float32 epsilons at scale 60)
    out_err = (out.double() - ref_out).abs().max().item()
    lse_err = (lse.double() - ref_lse)[covered].abs().max().item()
    assert out_err <= 4 * EPS32 * ref_out.abs().max().item(), out_err
    assert lse_err <= 4 * EPS32 * ref_lse[covered].abs().max().item(), lse_err

    # against the union computed directly: within the parts' own rounding (of out in dtype, and
    # of lse in float32, which moves a part's weight by |lse| float32 epsilons)
    weight_eps = torch.finfo(dtype).eps + 2 * EPS32 * lse_u[covered].abs().max().item()
    assert (out.double() - out_u).abs().max().item() <= 2 * weight_eps * out_u.abs().max().item()
    assert (lse.double() - lse_u)[covered].abs().max().item() <= 4 * EPS32 * lse_u[covered].abs().max().item()


@pytest.mark.parametrize("path", ["merge", "merged_state"])
@pytest.mark.parametrize("scale", [0.3, 60.0])
def test_merge_gradients(path, scale):
    """Gradients with respect to every part's out and lse, through the merged out and lse, equal
    float64 autograd of the logsumexp merge; rows no part covers give zero gradients, no NaN."""
    _, parts = _parts(scale, seed=1)
    outs = [o.float().requires_grad_() for o, _ in parts]
    lses = [lse.float().requires_grad_() for _, lse in parts]
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(B, N, H, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, H, N, generator=g, dtype=torch.float64)

    def loss(o, lse):
        lse = lse.double()
        return (o.double() * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()

    got = torch.autograd.grad(loss(*PATHS[path](outs, lses)), [*outs, *lses])
    outs64 = [o.detach().double().requires_grad_() for o in outs]
    lses64 = [x.detach().double().requires_grad_() for x in lses]
    ref = torch.autograd.grad(loss(*_merge64(outs64, lses64)), [*outs64, *lses64])
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert not a.isnan().any(), i
        known = ~b.isnan()  # float64 logsumexp's gradient at rows no part covers is NaN
        assert (a.double() - b)[known].abs().max().item() <= 8 * EPS32 * max(
            b[known].abs().max().item(), 1.0
        ), i
    for a, lse in zip(got[PARTS:], lses, strict=True):
        assert (a[torch.isneginf(lse)] == 0).all()  # an uncovered part has no weight


def test_merge_of_non_finite_parts():
    """A NaN part makes its rows NaN and no other row; an uncovered row stays out 0, lse -inf."""
    _, parts = _parts(0.3)
    outs = [o.float() for o, _ in parts]
    lses = [lse.float() for _, lse in parts]
    lses[1][0, 0, 5] = math.nan
    outs[1][0, 5, 0] = math.nan
    for path in PATHS.values():
        out, lse = path(outs, lses)
        assert lse[0, 0, 5].isnan() and out[0, 5, 0].isnan().all()
        lse[0, 0, 5], out[0, 5, 0] = 0.0, 0.0
        assert not lse.isnan().any() and not out.isnan().any()
        assert torch.isneginf(lse[:, :, :3]).all() and (out[:, :3] == 0).all()


def test_merge_refuses_mismatched_parts():
    out, lse = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="2 outs and 1 lses"):
        merge([out, out], [lse])
    with pytest.raises(ValueError, match="0 outs"):
        merge([], [])
