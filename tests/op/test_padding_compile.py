"""Padding masks where nothing can be read on the host: torch.compile(fullgraph=True), meta tensors
and fake tensors, for DilatedAttention, MultiheadDilatedAttention and DropInMultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from reference import reference_varlen
from torch._subclasses.fake_tensor import FakeTensorMode

from dilated_attention import DilatedAttention, DropInMultiheadAttention, MultiheadDilatedAttention

SEGS, RATES = [4, 8], [1, 2]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def real_tokens(N: int = 12) -> torch.Tensor:
    """(3, N) bool, True = a real token: right padding, left padding, none."""
    real = torch.ones(3, N, dtype=torch.bool)
    real[0, 9:] = False
    real[1, :4] = False
    return real


def _reference(q, k, v, real, is_causal):
    """Each row's real run alone through the float64 reference; zeros at padded positions."""
    runs = [(int(r.nonzero()[0]), int(r.nonzero()[-1]) + 1) for r in real]
    cu = [0]
    for s, e in runs:
        cu.append(cu[-1] + e - s)
    flat = [torch.cat([t[b, s:e] for b, (s, e) in enumerate(runs)]) for t in (q, k, v)]
    out, _ = reference_varlen(*flat, cu, SEGS, RATES, is_causal)
    full = torch.zeros(q.shape, dtype=torch.float64)
    for b, (s, e) in enumerate(runs):
        full[b, s:e] = out[cu[b] : cu[b + 1]]
    return full


@pytest.mark.parametrize("is_causal", [False, True])
def test_dilated_attention_key_padding_mask_compiles_in_one_graph(is_causal):
    """fullgraph=True: no graph break on the mask (it was a data-dependent guard); forward and
    backward equal the float64 reference, padded positions 0 with no gradient."""
    attn = DilatedAttention(SEGS, RATES, attention_backend="native")
    real = real_tokens()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 12, 2, 8, generator=g, requires_grad=True) for _ in range(3))
    out = torch.compile(attn, fullgraph=True, backend="aot_eager")(
        q, k, v, is_causal=is_causal, key_padding_mask=real
    )
    want = _reference(q.detach().double(), k.detach().double(), v.detach().double(), real, is_causal)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert not q.grad[~real].any() and not k.grad[~real].any() and not v.grad[~real].any()
    eager = [t.detach().requires_grad_() for t in (q, k, v)]
    attn(*eager, is_causal=is_causal, key_padding_mask=real).square().sum().backward()
    for t, e in zip((q, k, v), eager, strict=True):
        torch.testing.assert_close(t.grad, e.grad, rtol=1e-5, atol=1e-6)


def test_one_inductor_compile_of_the_padded_path():
    attn = DilatedAttention(SEGS, RATES, attention_backend="native")
    real = real_tokens()
    q = torch.randn(3, 12, 2, 8, requires_grad=True)
    out = torch.compile(attn, fullgraph=True)(q, q, q, is_causal=True, key_padding_mask=real)
    torch.testing.assert_close(
        out, attn(q, q, q, is_causal=True, key_padding_mask=real), rtol=1e-5, atol=1e-6
    )
    out.sum().backward()
    assert q.grad is not None and not q.grad[~real].any()


def test_gap_in_the_mask_under_compile_fails_on_the_device():
    attn = DilatedAttention(SEGS, RATES, attention_backend="native")
    gap = real_tokens()
    gap[2, 5] = False
    q = torch.randn(3, 12, 2, 8)
    with pytest.raises(RuntimeError, match="not one contiguous run"):
        torch.compile(attn, fullgraph=True, backend="aot_eager")(q, q, q, key_padding_mask=gap)


def test_modules_with_masks_compile_in_one_graph():
    """MultiheadDilatedAttention (True = real token) and DropInMultiheadAttention (torch's masks:
    True = padding, and the causal attn_mask) under fullgraph=True equal their eager results."""
    torch.manual_seed(0)
    real = real_tokens()
    x = torch.randn(3, 12, 16)
    own = MultiheadDilatedAttention(16, 4, SEGS, RATES, attention_backend="native")
    got = torch.compile(own, fullgraph=True, backend="aot_eager")(x, key_padding_mask=real, is_causal=True)[0]
    torch.testing.assert_close(got[real], own(x, key_padding_mask=real, is_causal=True)[0][real])
    drop_in = DropInMultiheadAttention(
        16, 4, batch_first=True, segment_lengths=SEGS, dilation_rates=RATES, attention_backend="native"
    )
    causal = torch.ones(12, 12, dtype=torch.bool).triu(1)
    kw = {"key_padding_mask": ~real, "attn_mask": causal, "need_weights": False}
    got = torch.compile(drop_in, fullgraph=True, backend="aot_eager")(x, x, x, **kw)[0]
    torch.testing.assert_close(got[real], drop_in(x, x, x, **kw)[0][real])


def test_meta_tensors_give_shapes():
    """A meta key_padding_mask was a NotImplementedError (its values were read on the host)."""
    real = real_tokens().to("meta")
    q = torch.randn(3, 12, 2, 8, device="meta", requires_grad=True)
    out = DilatedAttention(SEGS, RATES)(q, q, q, key_padding_mask=real)
    assert out.shape == q.shape and out.device.type == "meta"
    out.sum().backward()
    assert q.grad.shape == q.shape
    x = torch.randn(3, 12, 16, device="meta")
    own = MultiheadDilatedAttention(16, 4, SEGS, RATES, device="meta")
    assert own(x, key_padding_mask=real)[0].shape == (3, 12, 16)
    drop_in = DropInMultiheadAttention(16, 4, device="meta", segment_lengths=SEGS, dilation_rates=RATES)
    xs = x.transpose(0, 1)  # sequence-first, torch's default
    out, w = drop_in(xs, xs, xs, key_padding_mask=~real, need_weights=False)
    assert out.shape == (12, 3, 16) and out.device.type == "meta" and w is None


def test_fake_tensors_give_shapes():
    with FakeTensorMode():
        real = real_tokens()
        q = torch.randn(3, 12, 2, 8)
        out = DilatedAttention(SEGS, RATES, attention_backend="native")(q, q, q, key_padding_mask=real)
        assert out.shape == q.shape
