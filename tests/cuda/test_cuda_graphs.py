"""The default bfloat16 CUDA path (the sdpa backend's C++ driver, csrc/views) captured in a CUDA
graph: nothing in its forward or backward synchronises with the host or allocates by data, so
torch.cuda.graph records a training step of the module (forward and backward) and its replays
recompute it for new inputs, against the float64 reference (SPEC section 4). Non-finite inputs
replayed through the same graph take the corrections (flagged on the device, applied in the
merge): NaN reaches exactly the rows that read it."""

from __future__ import annotations

import pytest
import torch
from common import make_inputs
from reference import multiplicity, reference_attention
from tolerance import assert_within_rule

from dilated_attention import DilatedAttention
from dilated_attention.backends import sdpa_kernels
from dilated_attention.op import views as _views_op

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not _views_op.available("cuda"),
        reason="needs a CUDA GPU and the extension's CUDA kernels",
    ),
]

# GPT-2 small's heads (12 of 64) at a short length, LongNet branches w = 256 * 2^i, r = 2^i
B, N, H, D = 1, 2048, 12, 64
SEGS, RATES = [256, 512, 1024, 2048], [1, 2, 4, 8]
DTYPE = torch.bfloat16


class Step:
    """A forward and backward of the module on static q, k, v and dout, captured once."""

    def __init__(self, module: torch.nn.Module, q, k, v, dout):
        self.module, self.q, self.k, self.v, self.dout = module, q, k, v, dout
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: plans, cuDNN graphs, lazy initialisation
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        for t in (q, k, v):
            t.grad = None  # the gradients allocated in the graph's pool
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._run()

    def _run(self) -> torch.Tensor:
        out = self.module(self.q, self.k, self.v, is_causal=True)
        out.backward(self.dout)
        return out

    def replay(self, q, k, v, dout):
        """(out, dq, dk, dv) of the graph replayed on these values (copied into the static inputs)."""
        with torch.no_grad():
            for static, new in ((self.q, q), (self.k, k), (self.v, v), (self.dout, dout)):
                static.copy_(new)
        self.graph.replay()
        torch.cuda.synchronize()
        return self.out.clone(), self.q.grad.clone(), self.k.grad.clone(), self.v.grad.clone()


def _inputs(seed: int):
    q, k, v = make_inputs(B, N, H, H, D, DTYPE, seed=seed, requires_grad=False, device="cuda")
    g = torch.Generator().manual_seed(seed + 100)
    dout = torch.randn(B, N, H, D, generator=g, dtype=torch.float64).to("cuda", DTYPE)
    return q, k, v, dout


def _reference(q, k, v, dout, dtype):
    """(out, dq, dk, dv) of the reference attention computed in dtype."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = reference_attention(*leaves, SEGS, RATES, is_causal=True, dtype=dtype)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout.to(dtype))
    return out, dq, dk, dv


@pytest.fixture(scope="module")
def step():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs an sm_80+ GPU (cuDNN or flash attention)")
    q, k, v, dout = _inputs(0)
    assert sdpa_kernels.cpp_driver_runs(q, k, v, 0.0)
    module = DilatedAttention(SEGS, RATES, attention_backend="sdpa")
    statics = [t.clone().requires_grad_(True) for t in (q, k, v)]
    s = Step(module, *statics, dout.clone())
    assert "sdpa" in module.selected_backends
    return s


@pytest.mark.parametrize("seed", [1, 2])
def test_replayed_step_matches_the_reference(step, seed):
    """Two replays on new values (not those of the capture): out and every gradient within the
    tolerance rule of the float64 reference."""
    q, k, v, dout = _inputs(seed)
    got = step.replay(q, k, v, dout)
    want = _reference(q, k, v, dout, torch.float64)
    plain = _reference(q, k, v, dout, DTYPE)
    for name, a, e, p in zip(("out", "dq", "dk", "dv"), got, want, plain, strict=True):
        assert_within_rule(name, a.double(), e, p.double(), DTYPE)


def test_replayed_nonfinite_key_reaches_exactly_its_readers(step):
    """A NaN key replayed through the captured graph: the rows that read it (some branch) are NaN,
    every other row is as without it (the corrections need no read on the host)."""
    q, k, v, dout = _inputs(3)
    clean = step.replay(q, k, v, dout)[0]
    pos, head = 700, 5
    k[0, pos, head, 11] = float("nan")
    out = step.replay(q, k, v, dout)[0]
    readers = multiplicity(N, H, SEGS, RATES, True)[head, :, pos] > 0  # (N,) rows of head `head`
    nan_rows = out[0, :, head].isnan().any(-1).cpu()
    assert torch.equal(nan_rows, readers)
    keep = torch.ones(N, H, dtype=torch.bool)
    keep[:, head] = ~readers
    torch.testing.assert_close(out[0][keep.cuda()], clean[0][keep.cuda()], rtol=1e-3, atol=1e-3)
