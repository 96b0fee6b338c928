"""Every CPU backend (native, sdpa, manual) with float32 logits of standard deviation 32-64 against
the float64 reference under SPEC section 4's rule: out, lse and every gradient.

At such logits the rounding of each score (several float32 epsilons of ``|s|``, and more where D
products are summed in float) is the largest part of every error, plain PyTorch's included, and
two computations of the same rounding quality, the scores summed in another order, differ by more
than the rule's 2x in a few percent of random cases; so do an ``out`` rounded before the backward
reads it back in ``dout . (v - out)`` (rows whose weight sits nearly on one key, where plain
PyTorch subtracts ``rowsum(P * dP)`` from the same dP) and branch merges through a float32 running
lse. The 128 random configurations per backend below put native past the rule in 2, sdpa in 6
and manual in 5 (``REGRESSIONS``: up to 4.3x, and 80x for ``out`` at ``N = 1``). Now native keeps
each score to about 48 bits, merges its branches in double and takes out's rounding back out in
the backward (docs/cpu-kernel.md), sdpa runs float32 CPU calls in float64, manual computes in
float64, and the Python merge normalises once in float64 (docs/backends.md).

``_inputs`` draws q (times the logit standard deviation), k, v, dout and dlse from one generator;
``_config`` draws a geometry: one to three branches, dilation up to 4, causal or not, grouped heads.
"""

from __future__ import annotations

import random

import pytest
import torch
from common import grads, one_thread  # noqa: F401
from reference import reference_attention
from tolerance import assert_within_rule

from dilated_attention import dilated_attention as dattn
from dilated_attention.backends.sdpa import SdpaBackend
from dilated_attention.merge import merge

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # rates above the head count

BACKENDS = ["native", "sdpa", "manual"]


def _config(seed: int) -> dict:
    """A random geometry (N up to 48, D 8-128) and whether a gradient of lse is taken."""
    rng = random.Random(seed)
    segs, rates = [], []
    for _ in range(rng.randint(1, 3)):
        w = rng.choice([1, 2, 4, 8, 16, 32, 64])
        segs.append(w)
        rates.append(rng.randint(1, min(w, 4)))
    Hkv, G = rng.choice([1, 2]), rng.choice([1, 2])
    return {
        "N": rng.choice([1, 2, 3, 5, 8, 9, 16, 17, 24, 32, 33, 48]),
        "Hq": Hkv * G,
        "Hkv": Hkv,
        "D": rng.choice([8, 16, 32, 64, 128]),
        "segs": segs,
        "rates": rates,
        "causal": rng.random() < 0.5,
        "dlse": rng.random() < 0.5,
        "seed": rng.randrange(10**6),
    }


def _inputs(c: dict, std: float):
    g = torch.Generator().manual_seed(c["seed"])
    N, Hq, Hkv, D = c["N"], c["Hq"], c["Hkv"], c["D"]
    q = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64) * std  # logits of std ~std
    k = torch.randn(1, N, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, N, Hkv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(1, N, Hq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, Hq, N, generator=g, dtype=torch.float64) if c["dlse"] else None
    return (q, k, v), dout, dlse


def _check(backend: str, c: dict, std: float) -> None:
    (q, k, v), dout, dlse = _inputs(c, std)
    segs, rates, causal = c["segs"], c["rates"], c["causal"]
    leaves = tuple(t.float().requires_grad_() for t in (q, k, v))
    out, lse = dattn(*leaves, segs, rates, is_causal=causal, return_lse=True, backend=backend)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    r64 = tuple(t.detach().double().requires_grad_() for t in leaves)
    out64, lse64 = reference_attention(*r64, segs, rates, causal)
    rpl = tuple(t.detach().clone().requires_grad_() for t in leaves)
    outp, lsep = reference_attention(*rpl, segs, rates, causal, dtype=torch.float32)
    assert_within_rule(f"{backend} out", out, out64, outp, torch.float32)
    assert_within_rule(f"{backend} lse", lse, lse64, lsep, torch.float32)
    got = grads(out, lse, leaves, dout, dlse)
    ref = grads(out64, lse64, r64, dout, dlse)
    plain = grads(outp, lsep, rpl, dout, dlse)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(f"{backend} {name}", a, e, p, torch.float32)


@pytest.mark.parametrize("seed", range(64))
@pytest.mark.parametrize("std", [32, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_large_logits_within_rule(backend, std, seed):
    _check(backend, _config(1000 * std + seed), std)


def _c(N, Hq, Hkv, D, segs, rates, causal, dlse, seed):
    return {"N": N, "Hq": Hq, "Hkv": Hkv, "D": D, "segs": segs, "rates": rates, "causal": causal,
            "dlse": dlse, "seed": seed}  # fmt: skip


# Inputs that exceeded the rule before (logit std, then the config): native put dk of a key that
# three branches read alone (dS of a one-key row must be 0) at 2.2x and dk of a row whose weight
# sits nearly on one key at 1.1-1.6x; manual dk at 4.3x; sdpa dk at 2.0x and out at 1.9x.
REGRESSIONS = [
    pytest.param(64, _c(2, 4, 1, 64, [8, 8, 8], [2, 4, 3], False, False, 56265), id="one-key-three-branches"),
    pytest.param(48, _c(9, 2, 2, 64, [8], [2], False, False, 958864), id="nearly-one-key"),
    pytest.param(64, _c(32, 1, 1, 128, [8], [4], True, False, 171464), id="dilated-causal-d128"),
    pytest.param(48, _c(9, 1, 1, 128, [8, 64, 32], [1, 2, 2], False, False, 34035), id="three-branches-d128"),
    pytest.param(
        48, _c(32, 4, 2, 64, [1, 8, 4], [1, 3, 4], True, True, 628104), id="one-position-branch-gqa"
    ),
]


@pytest.mark.parametrize("std,c", REGRESSIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_regressions_within_rule(backend, std, c):
    _check(backend, c, std)


def _one_position(seed: int):
    """N = 1, several branches that all read the one key: logits in the tens, |v| in the hundreds."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 4, 64, generator=g, dtype=torch.float64) * 40
    k = torch.randn(1, 1, 2, 64, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 2, 64, generator=g, dtype=torch.float64) * 100
    return tuple(t.float() for t in (q, k, v))


@pytest.mark.parametrize("driver", ["default", "python"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_position_several_branches(backend, driver, monkeypatch):
    """Every branch finds the same key, so out = v exactly, as plain PyTorch gives it: the branch
    merge used to go through a float32 running lse (sdpa: out 80x past the rule) or weights 1/3
    rounded before the sum (native, manual: 3x)."""
    if driver == "python":
        if backend != "sdpa":
            pytest.skip("the Python driver is sdpa's")
        # the Python driver's merge (dilated_attention.merge) on the float32 kernel
        monkeypatch.setattr(SdpaBackend, "cpp_driver", False)
        monkeypatch.setattr(SdpaBackend, "cpu_float32_in_float64", False, raising=False)
    segs, rates = [16, 16, 16, 2], [1, 1, 2, 1]
    for seed in range(4):
        q, k, v = _one_position(seed)
        out, lse = dattn(q, k, v, segs, rates, return_lse=True, backend=backend)
        out64, lse64 = reference_attention(q.double(), k.double(), v.double(), segs, rates)
        outp, lsep = reference_attention(q, k, v, segs, rates, dtype=torch.float32)
        assert_within_rule(f"{backend} out", out, out64, outp, torch.float32)
        assert_within_rule(f"{backend} lse", lse, lse64, lsep, torch.float32)
        covered = lse64[0].isfinite().T  # (N, Hq): the heads some branch covers
        assert torch.equal(out[0][covered], v[0].repeat_interleave(2, dim=1)[covered])


def test_merge_normalises_once():
    """Three parts with the same lse and the same out (a key that three branches read) merge to that
    out exactly and to lse + log 3, with exact gradients."""
    v = (torch.randn(1, 5, 2, 8, dtype=torch.float64) * 100).float()
    lse = (torch.randn(1, 2, 5, dtype=torch.float64) * 30 - 50).float()
    out, merged = merge([v, v, v], [lse, lse, lse])
    assert torch.equal(out, v)
    torch.testing.assert_close(
        merged.double(), lse.double() + torch.log(torch.tensor(3.0, dtype=torch.float64))
    )
    # differentiable: d out / d out_i = 1/3, d lse / d lse_i = 1/3
    outs = [v.clone().requires_grad_() for _ in range(3)]
    lses = [lse.clone().requires_grad_() for _ in range(3)]
    o, m = merge(outs, lses)
    (o.sum() + m.sum()).backward()
    for t in outs + lses:
        torch.testing.assert_close(t.grad, torch.full_like(t, 1 / 3))
