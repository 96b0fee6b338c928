"""MultiheadDilatedAttention's nn.MultiheadAttention-style arguments (batch-first; its padding mask
keeps this library's convention, True = a real token): the causal attn_mask, from_torch, and the
sequence-first warning. The drop-in with torch's conventions is tests/modules/test_drop_in.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from dilated_attention import LayoutWarning, MultiheadDilatedAttention

E, H = 16, 4


def _torch_mha(batch_first: bool = True, bias: bool = True, dropout: float = 0.0) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(
        E, H, dropout=dropout, bias=bias, batch_first=batch_first, dtype=torch.float64
    )
    with torch.no_grad():  # biases start at zero in torch; make them count
        for p in mha.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mha.eval()


@pytest.mark.parametrize("backend", ["native", "sdpa", "manual"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_from_torch_equals_multihead_attention(backend, bias, causal):
    """One branch whose segment covers the whole sequence, r = 1, layer_norm=False: the converted
    module computes nn.MultiheadAttention, forward and backward, cross-attention included."""
    mha = _torch_mha(bias=bias)
    N = 24
    ours = MultiheadDilatedAttention.from_torch(mha, [32], [1], attention_backend=backend)
    assert ours.norm is None and ours.q_proj.weight.dtype == torch.float64
    torch.manual_seed(1)
    x = torch.randn(3, N, E, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(3, N, E, dtype=torch.float64, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64) if causal else None
    want, _ = mha(x, mem, mem, need_weights=False, attn_mask=mask, is_causal=causal)
    got, weights = ours(x, mem, mem, need_weights=False, is_causal=causal)
    assert weights is None
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    gx_want, gm_want = torch.autograd.grad(want.square().sum(), (x, mem))
    gx_got, gm_got = torch.autograd.grad(got.square().sum(), (x, mem))
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(gm_got, gm_want, rtol=1e-9, atol=1e-10)


def test_from_torch_is_a_copy_and_can_fail():
    mha = _torch_mha()
    ours = MultiheadDilatedAttention.from_torch(mha, [32], [1])
    x = torch.randn(2, 20, E, dtype=torch.float64)
    with torch.no_grad():
        ours.v_proj.weight.mul_(2)  # the copy is independent of the source...
    assert mha.in_proj_weight.data_ptr() != ours.q_proj.weight.data_ptr()
    want, _ = mha(x, x, x, need_weights=False)
    got, _ = ours(x)
    assert not torch.allclose(got, want)  # ...and the comparison above can fail
    # A dilated pattern differs from full attention.
    dilated = MultiheadDilatedAttention.from_torch(mha, [8, 16], [1, 2])
    assert not torch.allclose(dilated(x)[0], want)


def test_from_torch_keeps_dropout_mode_and_rejects_what_has_no_counterpart():
    mha = _torch_mha(dropout=0.25).train()
    ours = MultiheadDilatedAttention.from_torch(mha, [8], [1], layer_norm=True)
    assert ours.dropout == 0.25 and ours.training and ours.norm is not None
    with pytest.raises(TypeError, match=r"must be a torch\.nn\.MultiheadAttention, got Linear"):
        MultiheadDilatedAttention.from_torch(nn.Linear(4, 4), [8], [1])
    with pytest.raises(ValueError, match="kdim=8 and vdim=8"):
        MultiheadDilatedAttention.from_torch(nn.MultiheadAttention(E, H, kdim=8, vdim=8), [8], [1])
    with pytest.raises(ValueError, match="add_bias_kv=True or add_zero_attn=True"):
        MultiheadDilatedAttention.from_torch(nn.MultiheadAttention(E, H, add_bias_kv=True), [8], [1])
    with pytest.warns(LayoutWarning, match=r"batch_first=False.*x.transpose\(0, 1\)"):
        MultiheadDilatedAttention.from_torch(nn.MultiheadAttention(E, H), [8], [1])


def _mhda() -> MultiheadDilatedAttention:
    torch.manual_seed(0)
    return MultiheadDilatedAttention(E, H, [4, 8], [1, 2], dtype=torch.float64)


def test_causal_attn_mask_in_every_form_means_is_causal():
    m = _mhda()
    B, N = 2, 10
    x = torch.randn(B, N, E, dtype=torch.float64)
    want, _ = m(x, is_causal=True)
    bool_mask = torch.ones(N, N, dtype=torch.bool).triu(1)
    float_mask = nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64)
    # Within float64 rounding, not bitwise: an unbatched call may run other BLAS kernels.
    for mask in (bool_mask, float_mask, bool_mask.expand(B * H, N, N), float_mask.float()):
        got, _ = m(x, x, x, attn_mask=mask)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got, _ = m(x, x, x, attn_mask=mask, is_causal=True)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    unbatched, _ = m(x[0], attn_mask=bool_mask)
    torch.testing.assert_close(unbatched, want[0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(m(x)[0], want)  # causal differs from not causal here


@pytest.mark.parametrize(
    "mask,match",
    [
        (torch.ones(10, 10, dtype=torch.bool).tril(-1), "is not the causal mask"),
        (torch.ones(10, 10, dtype=torch.bool).triu(2), "is not the causal mask"),
        (torch.full((10, 10), -1.0), "only 0 and -inf"),
        (torch.ones(10, 10, dtype=torch.bool).triu(1)[:9, :9], r"got shape \(9, 9\)"),
        (torch.ones(3, 10, 10, dtype=torch.bool).triu(1), r"\(8, 10, 10\), got shape \(3, 10, 10\)"),
        (torch.ones(10, 10, dtype=torch.int64).triu(1), "bool or floating tensor, got torch.int64"),
    ],
)
def test_other_attn_masks_are_errors(mask, match):
    m = _mhda()
    x = torch.randn(2, 10, E, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        m(x, x, x, attn_mask=mask)


def test_an_attn_mask_that_masks_nothing_is_no_mask():
    """All False, or all 0 (what nn.TransformerEncoderLayer makes of an all-False src_mask), masks
    nothing, as in nn.MultiheadAttention; with is_causal=True it contradicts the hint."""
    m = _mhda()
    x = torch.randn(2, 10, E, dtype=torch.float64)
    want, _ = m(x)
    for mask in (torch.zeros(10, 10, dtype=torch.bool), torch.zeros(2 * H, 10, 10, dtype=torch.float64)):
        torch.testing.assert_close(m(x, x, x, attn_mask=mask)[0], want, rtol=1e-12, atol=1e-12)
        with pytest.raises(
            ValueError,
            match=r"not the causal mask \(True, or -inf, exactly above the diagonal\) although is_causal=True",
        ):
            m(x, x, x, attn_mask=mask, is_causal=True)


def test_need_weights_and_average_attn_weights():
    m = _mhda()
    x = torch.randn(2, 10, E, dtype=torch.float64)
    out, w = m(x, x, x, need_weights=False, average_attn_weights=False)
    assert w is None
    torch.testing.assert_close(out, m(x, x, x, need_weights=False, average_attn_weights=True)[0])
    with pytest.raises(ValueError, match="need_weights=True: dilated attention never forms"):
        m(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="need_weights must be a bool, got 1"):
        m(x, x, x, need_weights=1)
    with pytest.raises(ValueError, match="average_attn_weights must be a bool"):
        m(x, x, x, average_attn_weights="yes")
    with pytest.raises(TypeError, match=r"attn_mask must be a torch\.Tensor or None, got list"):
        m(x, x, x, attn_mask=[[0.0]])


def test_positional_arguments_follow_multihead_attention():
    """query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal."""
    m = _mhda()
    x = torch.randn(2, 10, E, dtype=torch.float64)
    mask = torch.ones(10, 10, dtype=torch.bool).triu(1)
    got, _ = m(x, x, x, None, False, mask, True, True)
    torch.testing.assert_close(got, m(x, is_causal=True)[0], rtol=1e-12, atol=1e-12)


def test_sequence_first_input_warns_once_with_the_fix():
    m = MultiheadDilatedAttention(E, H, [64, 128], [1, 2], dtype=torch.float64)
    seq_first = torch.randn(256, 2, E, dtype=torch.float64)  # (N, B, E)
    with pytest.warns(LayoutWarning, match=r"pass x.transpose\(0, 1\)") as seen:
        m(seq_first)
        m(seq_first)
    assert len([w for w in seen if w.category is LayoutWarning]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)
        m(seq_first.transpose(0, 1))  # (B, N, E): fine
        m(torch.randn(300, 128, E, dtype=torch.float64))  # a large batch of full-length rows: fine


def _encoder_layers(train: bool) -> tuple[nn.TransformerEncoderLayer, nn.TransformerEncoderLayer]:
    """An nn.TransformerEncoderLayer (batch-first) and a copy whose self_attn is
    MultiheadDilatedAttention.from_torch of it with one branch covering the sequence (w >= N,
    r = 1): dense attention, so both compute the same function."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
    with torch.no_grad():  # torch's in_proj biases start at zero; make them count
        ref.self_attn.in_proj_bias.normal_(0.0, 0.1)
    ours = copy.deepcopy(ref)
    ours.self_attn = MultiheadDilatedAttention.from_torch(ref.self_attn, [16], [1])
    return ref.train(train), ours.train(train)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_in_a_torch_encoder_layer_torch_masks_mean_what_they_mean_to_torch(train):
    """As the self_attn of nn.TransformerEncoderLayer: the layer turns src_key_padding_mask (bool,
    True = padding) into a float mask (0 = keep, -inf = padding) before calling self_attn. An
    all-False mask ("no padding") was read as all padding, every output out_proj's bias. Now, with
    one dense branch, the layer equals the same layer with nn.MultiheadAttention: no mask, the
    all-False mask, right and left padding (at the real positions), float masks given directly,
    and the causal src_mask. (The module is batch-first only: the layer is built batch_first=True.)"""
    ref, ours = _encoder_layers(train)
    x = torch.randn(2, 10, E, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-10, atol=1e-10)
    none = torch.zeros(2, 10, dtype=torch.bool)  # torch's "no padding"
    torch.testing.assert_close(
        ours(x, src_key_padding_mask=none), ref(x, src_key_padding_mask=none), rtol=1e-10, atol=1e-10
    )
    padding = none.clone()
    padding[0, :3] = True  # left
    padding[1, 7:] = True  # right
    as_float = torch.zeros(2, 10, dtype=torch.float64).masked_fill(padding, float("-inf"))
    real = ~padding
    for mask in (padding, as_float):
        got, want = ours(x, src_key_padding_mask=mask), ref(x, src_key_padding_mask=mask)
        torch.testing.assert_close(got[real], want[real], rtol=1e-10, atol=1e-10)
    causal = nn.Transformer.generate_square_subsequent_mask(10, dtype=torch.float64)
    no_padding = torch.zeros(2, 10, dtype=torch.float64)  # the same type as src_mask
    got = ours(x, src_mask=causal, is_causal=True, src_key_padding_mask=no_padding)
    want = ref(x, src_mask=causal, is_causal=True, src_key_padding_mask=no_padding)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    got, want = ours(x, src_mask=none[0].expand(10, 10)), ref(x, src_mask=none[0].expand(10, 10))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)  # a src_mask that masks nothing
    assert ours.self_attn.in_proj_bias.shape == (3 * E,)


def test_float_padding_masks_other_than_torchs_are_refused_by_value():
    """A float key_padding_mask is torch's additive one (0 = keep, -inf = padding): a 0/1 float
    mask (this library's convention given as floats) or a bias is a ValueError naming the value
    and the bool mask to pass instead; a gap between real keys names the row. The bool mask keeps
    this module's convention, True = a real token."""
    m = _mhda()
    x = torch.randn(2, 10, E, dtype=torch.float64)
    ones = torch.ones(2, 10, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"holds 1\.0: .*pass a bool mask \(e\.g\. mask\.bool\(\)"):
        m(x, key_padding_mask=ones)
    with pytest.raises(ValueError, match=r"holds -5\.0"):
        m(x, key_padding_mask=torch.full((2, 10), -5.0, dtype=torch.float64))
    gap = torch.zeros(2, 10, dtype=torch.float64)
    gap[1, 4] = float("-inf")
    with pytest.raises(ValueError, match="row 1: its real keys"):
        m(x, key_padding_mask=gap)
    real = torch.ones(2, 10, dtype=torch.bool)
    real[1, 7:] = False
    as_float = torch.zeros(2, 10, dtype=torch.float64).masked_fill(~real, float("-inf"))
    got, want = m(x, key_padding_mask=as_float)[0], m(x, key_padding_mask=real)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(m(x, key_padding_mask=torch.zeros_like(ones))[0], m(x)[0], rtol=0, atol=0)


def test_in_a_torch_decoder_layer_a_bool_padding_mask_is_refused():
    """nn.TransformerDecoderLayer passes its bool tgt_key_padding_mask (torch's convention, True =
    padding) to self_attn as given, with need_weights=False: read in this module's convention it
    took every real token for padding, silently. A bool mask in a call that names need_weights is
    now a ValueError naming DropInMultiheadAttention; the float form is read as torch reads it and
    equals the same layer with nn.MultiheadAttention at the real positions."""
    torch.manual_seed(0)
    ref = nn.TransformerDecoderLayer(E, H, 32, dropout=0.0, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():
        ref.self_attn.in_proj_bias.normal_(0.0, 0.1)
    ours = copy.deepcopy(ref)
    ours.self_attn = MultiheadDilatedAttention.from_torch(ref.self_attn, [16], [1])
    x, memory = torch.randn(2, 10, E, dtype=torch.float64), torch.randn(2, 6, E, dtype=torch.float64)
    padding = torch.zeros(2, 10, dtype=torch.bool)
    padding[1, 7:] = True
    with pytest.raises(
        ValueError, match=r"bool mask in a call that passes need_weights.*DropInMultiheadAttention"
    ):
        ours(x, memory, tgt_key_padding_mask=padding)
    as_float = torch.zeros(2, 10, dtype=torch.float64).masked_fill(padding, float("-inf"))
    got = ours(x, memory, tgt_key_padding_mask=as_float)
    want = ref(x, memory, tgt_key_padding_mask=as_float)
    torch.testing.assert_close(got[~padding], want[~padding], rtol=1e-10, atol=1e-10)
    # Called directly, the module's own bool convention (True = a real token) still holds.
    m = ours.self_attn
    direct = m(x, key_padding_mask=~padding)[0]
    torch.testing.assert_close(direct[~padding], m(x, key_padding_mask=as_float)[0][~padding])
    with pytest.raises(ValueError, match="leave need_weights out"):
        m(x, key_padding_mask=~padding, need_weights=False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_in_torch_layers_an_integer_padding_mask_is_refused_as_torch_refuses_it(dtype):
    """nn.TransformerDecoderLayer passes an integer tgt_key_padding_mask (nonzero = padding, in
    torch's eyes) to self_attn as given, with need_weights=False: the module read it in its own
    convention (1 = a real token), inverted, and returned numbers. nn.MultiheadAttention refuses
    an integer mask ("only bool and floating types of key_padding_mask are supported"); so does
    the module now in a call that names need_weights, with a TypeError naming the dtype and both
    conventions. In nn.TransformerEncoderLayer torch itself refuses the mask before self_attn.
    Called directly (need_weights left out), an integer mask keeps the module's convention."""
    torch.manual_seed(0)
    dec = nn.TransformerDecoderLayer(E, H, 32, dropout=0.0, batch_first=True, dtype=torch.float64).eval()
    ours_dec = copy.deepcopy(dec)
    ours_dec.self_attn = MultiheadDilatedAttention.from_torch(dec.self_attn, [16], [1])
    x, memory = torch.randn(2, 10, E, dtype=torch.float64), torch.randn(2, 6, E, dtype=torch.float64)
    padding = torch.zeros(2, 10, dtype=dtype)
    padding[1, 7:] = 1
    with pytest.raises(AssertionError, match="only bool and floating types of key_padding_mask"):
        dec(x, memory, tgt_key_padding_mask=padding)  # torch's own layer
    with pytest.raises(
        TypeError,
        match=rf"key_padding_mask has dtype {dtype} .*need_weights.*nn\.MultiheadAttention refuses it",
    ):
        ours_dec(x, memory, tgt_key_padding_mask=padding)
    m = ours_dec.self_attn
    with pytest.raises(TypeError, match=rf"dtype {dtype}.*1 = a real token.*DropInMultiheadAttention"):
        m(x, key_padding_mask=padding, need_weights=False)
    _, enc = _encoder_layers(train=False)
    with pytest.raises(AssertionError, match="only bool and floating types of src_key_padding_mask"):
        enc(x, src_key_padding_mask=padding)
    # Called directly, the module's own convention: 1 = a real token, as the bool mask's True.
    real = (1 - padding).to(dtype)
    got = m(x, key_padding_mask=real)[0]
    want = m(x, key_padding_mask=real.bool())[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
