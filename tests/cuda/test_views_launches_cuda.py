"""The launch count of the sdpa backend's C++ driver (dilated_attention/backends/sdpa_launches.py)
on the device: the attention operator calls of one views_fwd and one views_bwd are the count's
kernel calls, and the kernels the device runs (printed beside the count) are at least the count's
launches (an operator call counts as one launch there; cuDNN's backward runs several kernels)."""

from __future__ import annotations

import pytest
import torch
from common import make_inputs

from dilated_attention.backends import sdpa_kernels
from dilated_attention.backends.sdpa_launches import views_launches
from dilated_attention.op import views as _views_op

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not _views_op.available("cuda"),
        reason="needs a CUDA GPU and the extension's CUDA kernels",
    ),
]

_OPERATORS = {
    "cudnn": (
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_cudnn_attention_backward",
    ),
    "flash": (
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_backward",
    ),
}


@pytest.mark.parametrize(
    "N,segs,rates",
    [(4096, [512, 1024, 2048, 4096], [1, 2, 4, 8]), (8192, [2048, 4096, 8192], [1, 2, 4])],
    ids=["one-segment", "several-segments"],
)
def test_operator_calls_and_kernels_against_the_count(N, segs, rates, capsys):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs an sm_80+ GPU (cuDNN or flash attention)")
    q, k, v = make_inputs(1, N, 12, 12, 64, torch.bfloat16, requires_grad=False, device="cuda")
    assert sdpa_kernels.cpp_driver_runs(q, k, v, 0.0)
    scale = 64**-0.5
    out, lse = torch.ops.dilated_attention.views_fwd(q, k, v, segs, rates, True, scale)  # warm-up
    dout = torch.randn_like(out)
    torch.ops.dilated_attention.views_bwd(dout, q, k, v, out, lse, None, segs, rates, True, scale)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        out, lse = torch.ops.dilated_attention.views_fwd(q, k, v, segs, rates, True, scale)
        torch.ops.dilated_attention.views_bwd(dout, q, k, v, out, lse, None, segs, rates, True, scale)
        torch.cuda.synchronize()
    events = prof.key_averages()
    ops = {e.key: e.count for e in events}
    kind = "cudnn" if ops.get(_OPERATORS["cudnn"][0], 0) else "flash"
    counted = views_launches(1, N, 12, 12, segs, rates, True, kind=kind)
    fwd_op, bwd_op = _OPERATORS[kind]
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    with capsys.disabled():
        print(
            f"\nN={N} {kind}: {counted.calls} calls; counted launches forward {counted.forward}, backward "
            f"{counted.backward}; the device ran {kernels} kernels and memsets"
        )
    assert ops.get(fwd_op, 0) == counted.calls
    assert ops.get(bwd_op, 0) == counted.calls
    assert kernels >= counted.forward + counted.backward
