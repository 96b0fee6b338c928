"""The tolerance rule of SPEC section 4 (FlashAttention's test rule).

An implementation run in dtype ``t`` passes when its error against the float64 reference is at
most twice the error of the plain PyTorch reference run in ``t``, plus a small floor ``atol``
that absorbs rounding noise when both errors are near zero.
"""

from __future__ import annotations

import torch

ATOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference; -inf entries must match exactly and are then ignored."""
    actual, expected = actual.double(), expected.double()
    inf_a, inf_e = torch.isneginf(actual), torch.isneginf(expected)
    if not torch.equal(inf_a, inf_e):
        return float("inf")
    diff = (actual - expected).abs()
    diff = torch.where(inf_e, torch.zeros_like(diff), diff)
    if torch.isnan(diff).any():
        return float("inf")
    return diff.max().item() if diff.numel() else 0.0


def assert_within_rule(
    name: str, actual: torch.Tensor, expected64: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype
) -> None:
    """``actual`` and ``plain`` (the reference run in ``dtype``) against the float64 ``expected64``."""
    assert actual.shape == expected64.shape, (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected64.shape)}"
    )
    err = max_error(actual, expected64)
    base = max_error(plain, expected64)
    bound = 2 * base + ATOL[dtype]
    assert err <= bound, (
        f"{name} ({dtype}): error {err:.3e} exceeds 2 x plain PyTorch error {base:.3e} + {ATOL[dtype]:.0e}"
    )


def assert_causal_segment_within_rule(q, k, v, dout, out, lse, grads) -> None:
    """One causal segment of N = q.shape[1] (w = N, r = 1, one head; q, k, v, dout (1, N, 1, D)):
    out, lse and dq of the rows N/2, N-2, N-1 and dk, dv of the keys 0, 1, N/8 (sums over half or
    all of the segment) within the rule, against float64 and plain float32 computations of those
    rows and keys (reference.causal_segment_sample)."""
    from reference import causal_segment_sample

    N = q.shape[1]
    dq, dk, dv = grads
    rows = torch.tensor([N // 2, N - 2, N - 1])  # queries that read half or all of the segment
    keys = torch.tensor([0, 1, N // 8])  # keys read by nearly every query
    got = {"out": out[0, rows, 0], "lse": lse[0, 0, rows], "dq": dq[0, rows, 0], "dk": dk[0, keys, 0]}
    got["dv"] = dv[0, keys, 0]
    ref = causal_segment_sample(q, k, v, dout, rows, keys, torch.float64)
    plain = causal_segment_sample(q, k, v, dout, rows, keys, torch.float32)
    for name in got:
        assert_within_rule(f"{name} (N={N})", got[name], ref[name], plain[name], torch.float32)
