"""RingDilatedAttention in float16 and bfloat16 within SPEC section 4's rule, where the merged output
of a row is read back by the backward.

The backward's ``rowsum(dout * out)`` reads the rank's merged out. Where that out was merged from
parts rounded to 16 bits (the pieces' and the local runs' outs), its rounding, times ``|dout|``
summed over D, entered every score gradient of the row, and, times the scale and the row's
(nearly one-hot, for large logits) weighted mean of the keys, dq and dk: several times the rule's
bound where the one-process op, which keeps its out in float32 for the backward, is within half
of it. The parts are now computed, merged and kept in float32 and rounded once.

The inputs are rounded to the dtype first, and the reference runs on the rounded inputs (float64
and, for the rule's "plain PyTorch" error, the dtype itself), as FlashAttention's tests do: the
errors are then the implementations' own, not the rounding of the inputs, which is the same for
all. The cotangent of out lines up with out's rounding (its sign, times 4): the case where a
rounded out shows most in the gradients. Two gloo ranks, both exchange modes.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from reference import reference_attention
from ring_cluster import Cluster, inputs, loss
from tolerance import assert_within_rule

from dilated_attention.ring import RingDilatedAttention

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
DOUT_SIZE = 4.0  # |dout|: the gradients' errors grow with it, the rule's floor (ATOL) does not


def _reference(q, k, v, dout, dlse, segs, rates, causal, scale, dtype):
    """(out, lse, dq, dk, dv) of the dense reference on the whole sequence, computed in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*leaves, segs, rates, causal, scale, dtype=dtype)
    grads = torch.autograd.grad(loss(out, lse, dout, dlse), leaves)
    return (out.detach(), lse.detach(), *grads)


def check(rank: int, P: int, cases: list[tuple]) -> dict[str, str | None]:
    """Run every case on this rank; map its id to None (pass) or the failure message."""
    report: dict[str, str | None] = {}
    for case_id, B, N, Hq, Hkv, D, segs, rates, causal, scale, comm, dtype_name, seed in cases:
        try:
            dtype = DTYPES[dtype_name]
            q, k, v, _, dlse = inputs(B, N, Hq, Hkv, D, seed=seed)
            q, k, v = (t.to(dtype).double() for t in (q, k, v))  # the inputs every run reads
            dlse = dlse.float().double()
            out64, _ = reference_attention(q, k, v, segs, rates, causal, scale)
            dout = DOUT_SIZE * torch.sign(out64.to(dtype).double() - out64)  # exact in dtype
            expected = _reference(q, k, v, dout, dlse, segs, rates, causal, scale, torch.float64)
            plain = _reference(q, k, v, dout, dlse, segs, rates, causal, scale, dtype)
            sl = slice(rank * (N // P), (rank + 1) * (N // P))
            mine = [t[:, sl].to(dtype).requires_grad_() for t in (q, k, v)]
            module = RingDilatedAttention(segs, rates, softmax_scale=scale, comm=comm)
            out, lse = module(*mine, is_causal=causal, return_lse=True)
            grads = torch.autograd.grad(loss(out, lse, dout[:, sl], dlse[:, :, sl]), mine)
            got = (out, lse, *grads)
            for name, a, e, p in zip(("out", "lse", "dq", "dk", "dv"), got, expected, plain, strict=True):
                idx = (slice(None), slice(None), sl) if name == "lse" else (slice(None), sl)
                assert_within_rule(f"rank {rank} {name}", a, e[idx], p[idx], dtype)
            report[case_id] = None
        except Exception:
            report[case_id] = traceback.format_exc()
    return report


# (B, N, Hq, Hkv, D, segment_lengths, dilation_rates, causal, softmax_scale, seed): one branch w > N,
# r = 5, causal, scale 0.37 (1.03x and 1.9x the rule's bound in dk with comm="all_gather"), then
# cases of a random sweep where the rounded out showed most (up to 9.9x in bfloat16 dq). With the
# out kept in float32, every case is within 0.45 of the bound, as the one-process op.
CONFIGS = [
    (1, 28, 5, 5, 128, [61], [5], True, 0.37, 0),
    (1, 22, 1, 1, 128, [36], [6], True, 0.37, 100),
    (1, 26, 1, 1, 32, [20], [3], True, 0.6, 115),
    (2, 12, 1, 1, 64, [30], [3], False, 0.6, 110),
    (1, 12, 3, 1, 32, [13], [6], True, 0.37, 102),
]


def _cases() -> list[tuple]:
    cases = []
    for B, N, Hq, Hkv, D, segs, rates, causal, scale, seed in CONFIGS:
        for comm in ("all_gather", "ring"):
            for dtype_name in DTYPES:
                branches = "-".join(f"w{w}r{r}" for w, r in zip(segs, rates, strict=True))
                kind = "causal" if causal else "full"
                cid = f"N{N}-H{Hq}kv{Hkv}-D{D}-{branches}-{kind}-{comm}-{dtype_name}"
                cases.append((cid, B, N, Hq, Hkv, D, segs, rates, causal, scale, comm, dtype_name, seed))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    cluster = Cluster(2)
    try:
        reports = cluster.run(check, CASES)
    finally:
        cluster.close()
    merged: dict[str, str | None] = {}
    for report in reports:
        for cid, msg in report.items():
            merged[cid] = merged.get(cid) or msg
    return merged


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_half_precision_within_the_rule(results, case_id):
    msg = results[case_id]
    assert msg is None, msg
