"""The fused decode step ``torch.ops.dilated_attention.decode_step`` (CPU): registration (schema,
fake kernel, opcheck), split-K over threads, and its checks; its outputs against the float64
reference are tested through ``BoundedDilatedKVCache`` in test_decode_bounded.py."""

from __future__ import annotations

import pytest
import torch
from common import make_inputs, one_thread  # noqa: F401  (one_thread: an autouse fixture)
from reference import reference_attention

from dilated_attention.decode import BoundedDilatedKVCache
from dilated_attention.op.decode import decode_step, has_decode_kernel
from dilated_attention.op.slots import branch_slots

pytestmark = pytest.mark.skipif(
    not has_decode_kernel("cpu"), reason="the extension has no decode_step kernel"
)


def step_args(dtype, B=2, Hq=8, Hkv=2, D=16, segs=(8, 32), rates=(1, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    layout = branch_slots(segs, rates, Hq // Hkv, None)
    T = sum(br.rows * br.length for br in layout)
    q = torch.randn(B, Hq, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    kc, vc = (torch.randn(B, Hkv, T, D, generator=gen).to(dtype) for _ in range(2))
    pos = torch.tensor([21, -1, 5, 40][:B])
    return q, k, v, kc, vc, pos, layout


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_opcheck(dtype):
    q, k, v, kc, vc, pos, layout = step_args(dtype)
    args = (
        q,
        k,
        v,
        kc,
        vc,
        pos,
        [b.w for b in layout],
        [b.r for b in layout],
        [b.length for b in layout],
        0.25,
    )
    torch.library.opcheck(torch.ops.dilated_attention.decode_step.default, args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_equals_plain_on_any_slots(dtype):
    """On slots full of arbitrary values (stale or never written), the op and the plain PyTorch
    step write the same slots and give the same out and lse: no slot outside a row's range leaks."""
    q, k, v, kc, vc, pos, layout = step_args(dtype, B=4)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = decode_step(q, k, v, kc, vc, pos, layout, 0.3, fused=True)
    ref, ref_lse = decode_step(q, k, v, kc2, vc2, pos, layout, 0.3, fused=False)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=tol, atol=tol)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()  # pos -1


def test_split_over_keys_with_threads():
    """B * Hkv = 1 on 2 threads splits the rows into chunks merged by lse: equal to the reference
    of the whole causal sequence at positions far into long rows."""
    segs, rates, N = (1024, 2048), (1, 2), 700
    qkv = make_inputs(1, N, 4, 1, 8, torch.float64, seed=7, requires_grad=False)
    ref, ref_lse = reference_attention(*qkv, segs, rates, is_causal=True)
    cache = BoundedDilatedKVCache(1, 1, 4, 1, 8, segs, rates, dtype=torch.float64, fused=True)
    cache.attend(0, *(t[:, : N - 3] for t in qkv))
    cache.advance(N - 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for p in range(N - 3, N):
            out, lse = cache.attend(0, *(t[:, p : p + 1] for t in qkv), return_lse=True)
            cache.advance(1)
            torch.testing.assert_close(out[:, 0], ref[:, p], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse[..., 0], ref_lse[..., p], rtol=1e-10, atol=1e-10)
    finally:
        torch.set_num_threads(threads)


def test_checks_name_the_bad_value():
    q, k, v, kc, vc, pos, layout = step_args(torch.float32)
    segs, rates, lens = [b.w for b in layout], [b.r for b in layout], [b.length for b in layout]
    op = torch.ops.dilated_attention.decode_step
    with pytest.raises(RuntimeError, match="must have 40 slots for these branches, got 39"):
        op(q, k, v, kc[:, :, :39].contiguous(), vc[:, :, :39].contiguous(), pos, segs, rates, lens, 1.0)
    short = branch_slots(segs, rates, 4, 16)  # slots for 16 positions: [8, 4], 24 in all
    ks, vs = kc[:, :, :24].contiguous(), vc[:, :, :24].contiguous()
    with pytest.raises(RuntimeError, match="position 21 of sequence 0 is beyond the cache's slots"):
        op(q, k, v, ks, vs, pos, segs, rates, [b.length for b in short], 1.0)
    with pytest.raises(RuntimeError, match="pos must be an int64"):
        op(q, k, v, kc, vc, pos.int(), segs, rates, lens, 1.0)
    with pytest.raises(RuntimeError, match="must have q's dtype"):
        op(q, k.double(), v, kc, vc, pos, segs, rates, lens, 1.0)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        op(q, k, v, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, pos, segs, rates, lens, 1.0)


def test_compiles_without_graph_breaks():
    """The op (with its in-place writes) under ``torch.compile(fullgraph=True)``: the same slots
    and outputs as eager."""
    q, k, v, kc, vc, pos, layout = step_args(torch.float32)
    kc2, vc2 = kc.clone(), vc.clone()

    def step(q, k, v, kc, vc, pos):
        return decode_step(q, k, v, kc, vc, pos, layout, 0.3, fused=True)

    out, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, kc, vc, pos)
    ref, ref_lse = step(q, k, v, kc2, vc2, pos)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
