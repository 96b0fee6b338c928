"""DropInMultiheadAttention: nn.MultiheadAttention's conventions exactly (True = padding, float
additive masks, need_weights, batch_first, attn_mask forms), inside torch's transformer layers.

With one branch whose segment covers the sequence and r = 1, dilated attention is dense attention,
so torch's own nn.MultiheadAttention is the reference; with real dilated branches, the float64
reference of tests/reference.py is."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from reference import multiplicity, reference_attention

from dilated_attention import DropInMultiheadAttention, MultiheadDilatedAttention
from dilated_attention.modules import DropInMultiheadAttention as FromModules

E, H, N = 16, 4, 12
F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-10}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def torch_mha(batch_first: bool = False, bias: bool = True, **kw) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, dtype=F64, **kw)
    with torch.no_grad():  # torch's biases start at zero; make them count
        for p in mha.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mha


def padding() -> torch.Tensor:
    """(3, N) bool in torch's convention, True = padding: right, left and none."""
    kpm = torch.zeros(3, N, dtype=torch.bool)
    kpm[0, 9:] = True
    kpm[1, :4] = True
    return kpm


def test_exported_under_both_paths():
    assert DropInMultiheadAttention is FromModules
    assert "DropInMultiheadAttention" in __import__("dilated_attention").__all__


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("float_mask", [False, True], ids=["bool_mask", "float_mask"])
@pytest.mark.parametrize("causal", [False, True])
def test_masks_in_torch_convention_equal_multihead_attention(batch_first, float_mask, causal):
    """True (or -inf) = padding, as torch: the real positions equal nn.MultiheadAttention's, forward
    and backward (the weights' gradients included)."""
    mha = torch_mha(batch_first)
    ours = DropInMultiheadAttention.from_torch(mha, [N], [1])
    assert ours.batch_first == batch_first and ours.segment_lengths == [N]
    kpm = padding()
    if float_mask:
        kpm = torch.zeros(3, N, dtype=F64).masked_fill(kpm, float("-inf"))
    attn_mask = torch.ones(N, N, dtype=torch.bool).triu(1) if causal else None
    if causal and float_mask:
        attn_mask = nn.Transformer.generate_square_subsequent_mask(N, dtype=F64)
    x = torch.randn(3, N, E, dtype=F64)
    x = x if batch_first else x.transpose(0, 1)
    real = ~padding() if batch_first else ~padding().T
    got, w_got = ours(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    want, _ = mha(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    assert w_got is None and got.shape == want.shape
    torch.testing.assert_close(got[real], want[real], **TOL)
    g_got = torch.autograd.grad(got[real].square().sum(), [ours.q_proj_weight, ours.out_proj.weight])
    g_want = torch.autograd.grad(want[real].square().sum(), [mha.in_proj_weight, mha.out_proj.weight])
    torch.testing.assert_close(g_got[0], g_want[0][:E], **TOL)
    torch.testing.assert_close(g_got[1], g_want[1], **TOL)


def test_a_mask_of_one_convention_is_wrong_for_the_other():
    """The library's own module reads True as a real token; the drop-in reads True as padding."""
    mha = torch_mha(batch_first=True)
    drop_in = DropInMultiheadAttention.from_torch(mha, [N], [1])
    own = MultiheadDilatedAttention.from_torch(mha, [N], [1])
    x = torch.randn(3, N, E, dtype=F64)
    kpm = padding()
    want, _ = mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    real = ~kpm
    torch.testing.assert_close(drop_in(x, x, x, key_padding_mask=kpm)[0][real], want[real], **TOL)
    torch.testing.assert_close(own(x, key_padding_mask=real)[0][real], want[real], **TOL)
    assert not torch.allclose(own(x, key_padding_mask=kpm.flip(1))[0][real], want[real])


def _layers(kind: str, norm_first: bool, batch_first: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    cls = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    ref = cls(E, H, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=F64)
    ours = cls(E, H, 32, dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=F64)
    ours.load_state_dict(ref.state_dict())
    ours.self_attn = DropInMultiheadAttention.from_torch(ours.self_attn, [64], [1])
    if kind == "decoder":
        ours.multihead_attn = DropInMultiheadAttention.from_torch(ours.multihead_attn, [64], [1])
    return ref, ours


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("batch_first,norm_first", [(True, False), (False, True)])
@pytest.mark.parametrize("causal", [False, True])
def test_inside_torch_transformer_layers(kind, train, batch_first, norm_first, causal):
    """As self_attn (and the decoder's multihead_attn over a memory of the same length, unmasked) in
    train and eval mode: torch's fast path is skipped cleanly, the result is torch's at the real positions,
    and so are the gradients of every parameter."""
    ref, ours = _layers(kind, norm_first, batch_first)
    ref.train(train)
    ours.train(train)
    x = torch.randn(3, N, E, dtype=F64)
    mem = torch.randn(3, N, E, dtype=F64)
    kpm = padding()
    mask = torch.ones(N, N, dtype=torch.bool).triu(1) if causal else None
    if not batch_first:
        x, mem = x.transpose(0, 1), mem.transpose(0, 1)
    real = ~kpm if batch_first else ~kpm.T
    outs = []
    for layer in (ref, ours):
        if kind == "encoder":
            outs.append(layer(x, src_mask=mask, src_key_padding_mask=kpm, is_causal=causal))
        else:
            # no memory_key_padding_mask: a mask on the cross-attention is refused (test below)
            outs.append(layer(x, mem, tgt_mask=mask, tgt_key_padding_mask=kpm, tgt_is_causal=causal))
    want, got = outs
    torch.testing.assert_close(got[real], want[real], **TOL)
    g_want = dict(
        zip(
            dict(ref.named_parameters()),
            torch.autograd.grad(want[real].sum(), list(ref.parameters())),
            strict=True,
        )
    )
    g_got = dict(
        zip(
            dict(ours.named_parameters()),
            torch.autograd.grad(got[real].sum(), list(ours.parameters())),
            strict=True,
        )
    )
    for attn in ("self_attn", "multihead_attn") if kind == "decoder" else ("self_attn",):
        stacked = torch.cat([g_got.pop(f"{attn}.{n}_proj_weight") for n in "qkv"])
        torch.testing.assert_close(stacked, g_want.pop(f"{attn}.in_proj_weight"), **TOL)
    assert g_got.keys() == g_want.keys()
    for name, g in g_got.items():
        torch.testing.assert_close(g, g_want[name], **TOL, msg=name)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_encoder_layer_in_eval_under_no_grad_and_torch_encoder():
    """The eval, no-grad case in which torch's layer would take its fused dense fast path: it is
    skipped (``_qkv_same_embed_dim`` is False), in a layer and in an nn.TransformerEncoder stack
    built from it."""
    ref, ours = _layers("encoder", False, True)
    ref.eval()
    ours.eval()
    x = torch.randn(3, N, E, dtype=F64)
    kpm = padding()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors off for this layer
        stack = nn.TransformerEncoder(ours, 2, enable_nested_tensor=True).eval()
        ref_stack = nn.TransformerEncoder(ref, 2, enable_nested_tensor=False).eval()
    assert not stack.use_nested_tensor
    with torch.no_grad():
        torch.testing.assert_close(
            ours(x, src_key_padding_mask=kpm)[~kpm], ref(x, src_key_padding_mask=kpm)[~kpm], **TOL
        )
        torch.testing.assert_close(
            stack(x, src_key_padding_mask=kpm)[~kpm], ref_stack(x, src_key_padding_mask=kpm)[~kpm], **TOL
        )
    sa = ours.self_attn
    assert sa._qkv_same_embed_dim is False and sa.in_proj_bias.shape == (3 * E,)
    torch.testing.assert_close(sa.in_proj_weight, ref.self_attn.in_proj_weight, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_encoder_built_before_the_swap_passes_nested_tensors():
    """nn.TransformerEncoder built with nn.MultiheadAttention layers turns a right-padded batch into
    a nested tensor in eval mode without gradients; the drop-in set in afterwards takes it."""
    ref, _ = _layers("encoder", False, True)
    stack = nn.TransformerEncoder(ref, 2, enable_nested_tensor=True).eval()
    ref_stack = nn.TransformerEncoder(ref, 2, enable_nested_tensor=False).eval()
    for layer in stack.layers:
        layer.self_attn = DropInMultiheadAttention.from_torch(layer.self_attn, [64], [1])
    x = torch.randn(3, N, E, dtype=F64)
    kpm = torch.zeros(3, N, dtype=torch.bool)
    kpm[0, 9:] = True  # right padding, which torch nests
    with torch.no_grad():
        got, want = stack(x, src_key_padding_mask=kpm), ref_stack(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(got[~kpm], want[~kpm], **TOL)
    assert not got[kpm].any()  # torch's nested path: zeros at padded positions
    sa = stack.layers[0].self_attn
    nested = torch.nested.nested_tensor([torch.randn(N, E, dtype=F64)])
    with pytest.raises(ValueError, match="nested tensors are taken only as"):
        sa(nested, x, x)


@pytest.mark.parametrize("average", [True, False])
def test_need_weights_equals_torch_on_the_dense_pattern(average):
    mha = torch_mha(batch_first=True)
    ours = DropInMultiheadAttention.from_torch(mha, [N], [1])
    x = torch.randn(3, N, E, dtype=F64)
    kpm = padding()
    for mask in (None, torch.ones(N, N, dtype=torch.bool).triu(1)):
        out, w = ours(x, x, x, key_padding_mask=kpm, attn_mask=mask, average_attn_weights=average)
        want, w_want = mha(x, x, x, key_padding_mask=kpm, attn_mask=mask, average_attn_weights=average)
        real = ~kpm
        torch.testing.assert_close(out[real], want[real], **TOL)
        rows = real if average else real[:, None].expand(3, H, N)
        torch.testing.assert_close(w[rows], w_want[rows].nan_to_num(0.0), **TOL)
    assert ours(x[0], x[0], x[0])[1].shape == (N, N)  # unbatched


def _projected(m: DropInMultiheadAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    bq, bk, bv = m.in_proj_bias.chunk(3)
    return tuple(
        nn.functional.linear(x, w, b).view(*x.shape[:2], H, E // H)
        for w, b in zip((m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), (bq, bk, bv), strict=True)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_branches_against_the_float64_reference(causal):
    """Real dilated branches, with padding: each row's real run alone through the reference, for the
    output (fused kernels and need_weights=True) and for the weights (the reference's multiplicity)."""
    torch.manual_seed(0)
    segs, rates = [4, 8], [1, 2]
    m = DropInMultiheadAttention(
        E, H, batch_first=True, dtype=F64, segment_lengths=segs, dilation_rates=rates
    )
    with torch.no_grad():
        m.in_proj_bias.normal_()
    x = torch.randn(3, N, E, dtype=F64)
    kpm = padding()
    fused, none = m(x, x, x, key_padding_mask=kpm, need_weights=False, is_causal=causal)
    dense, w = m(x, x, x, key_padding_mask=kpm, is_causal=causal, average_attn_weights=False)
    assert none is None and w.shape == (3, H, N, N)
    q, k, v = _projected(m, x)
    for b in range(3):
        run = (~kpm[b]).nonzero().squeeze(1)
        s, e = int(run[0]), int(run[-1]) + 1
        out, _ = reference_attention(
            q[b : b + 1, s:e], k[b : b + 1, s:e], v[b : b + 1, s:e], segs, rates, causal
        )
        want = nn.functional.linear(out.reshape(1, e - s, E), m.out_proj.weight, m.out_proj.bias)[0]
        torch.testing.assert_close(fused[b, s:e], want, **TOL)
        torch.testing.assert_close(dense[b, s:e], want, **TOL)
        mult = multiplicity(e - s, H, segs, rates, causal).to(F64)  # (H, n, n)
        scores = torch.einsum("phd,xhd->hpx", q[b, s:e], k[b, s:e]) / (E // H) ** 0.5
        p = mult * (scores - scores.amax(-1, keepdim=True)).exp()
        torch.testing.assert_close(w[b, :, s:e, s:e], p / p.sum(-1, keepdim=True), **TOL)
        assert not w[b, :, :, :s].any() and not w[b, :, :, e:].any()  # padded keys: weight 0
        assert torch.equal(fused[b, :s], m.out_proj.bias.expand(s, E))  # padded queries: out_proj(0)


@pytest.mark.parametrize("backend", ["native", "manual"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_dilated_branches_inside_an_encoder_layer_against_the_reference(backend, train):
    """Real dilated branches as the self_attn of nn.TransformerEncoderLayer: the layer's output at
    the real positions is torch's own norm and feed-forward around the float64 reference's
    attention of each row's real run."""
    segs, rates = [4, 8], [1, 2]
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, dtype=F64).train(train)
    layer.self_attn = DropInMultiheadAttention.from_torch(
        layer.self_attn, segs, rates, attention_backend=backend
    )
    x = torch.randn(3, N, E, dtype=F64)
    kpm = padding()
    with torch.no_grad():
        got = layer(x, src_key_padding_mask=kpm, src_mask=torch.ones(N, N, dtype=torch.bool).triu(1))
        sa = layer.self_attn
        q, k, v = _projected(sa, x)
        for b in range(3):
            run = (~kpm[b]).nonzero().squeeze(1)
            s, e = int(run[0]), int(run[-1]) + 1
            rows = slice(s, e)
            out, _ = reference_attention(
                q[b : b + 1, rows], k[b : b + 1, rows], v[b : b + 1, rows], segs, rates, True
            )
            attn = sa.out_proj(out.reshape(e - s, E))
            h = layer.norm1(x[b, rows] + attn)
            want = layer.norm2(h + layer.linear2(layer.activation(layer.linear1(h))))
            torch.testing.assert_close(got[b, rows], want, **TOL)


def test_state_dict_of_torch_loads_and_from_torch_keeps_everything():
    mha = torch_mha(batch_first=False, kdim=8, vdim=12)
    ours = DropInMultiheadAttention.from_torch(mha, [N], [1])
    assert (ours.kdim, ours.vdim, ours.in_proj_weight) == (8, 12, None)
    x, k, v = (
        torch.randn(N, 2, E, dtype=F64),
        torch.randn(N, 2, 8, dtype=F64),
        torch.randn(N, 2, 12, dtype=F64),
    )
    torch.testing.assert_close(ours(x, k, v)[0], mha(x, k, v)[0], **TOL)
    plain = torch_mha()
    fresh = DropInMultiheadAttention(E, H, dtype=F64, segment_lengths=[N], dilation_rates=[1])
    fresh.load_state_dict(plain.state_dict())  # the stacked in_proj_weight is split
    x = torch.randn(N, 2, E, dtype=F64)
    torch.testing.assert_close(fresh(x, x, x)[0], plain(x, x, x)[0], **TOL)
    torch.testing.assert_close(fresh(x, x, x)[1], plain(x, x, x)[1], **TOL)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda m, x: m(x, x[:8], x[:8]), ValueError, r"key length S = 8 differs from query length L = 12"),
        (lambda m, x: m(x, x, x, attn_mask=torch.ones(N, N).tril(-1).log()), ValueError, "not the causal mask"),
        (lambda m, x: m(x, x, x, attn_mask=torch.ones(N, N, dtype=torch.bool).tril(-1)), ValueError, "not the causal"),
        (lambda m, x: m(x, x, x, attn_mask=torch.zeros(N, N), is_causal=True), ValueError, "although is_causal"),
        (lambda m, x: m(x, x, x, attn_mask=torch.full((N, N), -1e9).triu(1)), ValueError, "only 0 and -inf"),
        (lambda m, x: m(x, x, x, key_padding_mask=torch.full((2, N), 0.5)), ValueError, r"only 0 .* -inf .* got 0\.5"),
        (lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(2, N, dtype=torch.int64)), TypeError, "torch.int64"),
        (lambda m, x: m(x, x, x, key_padding_mask=torch.zeros(N, 2, dtype=torch.bool)), ValueError, r"\(B, S\) = \(2, 12\)"),
        (lambda m, x: m(x, x, x, key_padding_mask=torch.tensor([[0, 1] * 6] * 2).bool()), ValueError, "row 0: its real keys"),
        (lambda m, x: m(x, x, x, need_weights=1), ValueError, "need_weights must be a bool"),
        (lambda m, x: m(x, x + 1, x + 1, key_padding_mask=torch.zeros(2, N, dtype=torch.bool)), ValueError, "key_padding_mask with cross-attention"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_by_name(call, error, match):
    m = DropInMultiheadAttention(E, H, segment_lengths=[4, 8], dilation_rates=[1, 2])
    with pytest.raises(error, match=match):
        call(m, torch.randn(N, 2, E))


def test_decoder_memory_mask_is_refused_not_misapplied():
    """A decoder layer's memory_key_padding_mask reaches the cross-attention as key_padding_mask:
    the padded memory positions were taken out of the target's queries too (their outputs were
    out_proj's bias where torch attends to the real memory keys). Refused; the self-attention's
    mask, in the sequence-first layout, still equals torch."""
    layer = nn.TransformerDecoderLayer(E, H, dim_feedforward=32, dropout=0.0, dtype=F64).eval()
    layer.multihead_attn = DropInMultiheadAttention.from_torch(layer.multihead_attn, [N], [1])
    tgt, mem = torch.randn(N, 2, E, dtype=F64), torch.randn(N, 2, E, dtype=F64)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[0, 9:] = True
    with pytest.raises(ValueError, match="key_padding_mask with cross-attention"):
        layer(tgt, mem, memory_key_padding_mask=pad)
    mha = torch_mha()
    ours = DropInMultiheadAttention.from_torch(mha, [N], [1])
    x = torch.randn(N, 2, E, dtype=F64)
    got, want = ours(x, x, x, key_padding_mask=pad)[0], mha(x, x, x, key_padding_mask=pad)[0]
    torch.testing.assert_close(got[:9], want[:9], **TOL)  # the real rows; padded rows are out_proj(0)


def test_empty_sequence_with_weights_is_empty_as_in_torch():
    m = DropInMultiheadAttention(E, H, batch_first=True, segment_lengths=[4], dilation_rates=[1])
    x = torch.randn(2, 0, E)
    out, weights = m(x, x, x, average_attn_weights=False)
    assert out.shape == (2, 0, E) and weights.shape == (2, H, 0, 0)


def test_constructor_follows_torch_and_refuses_appended_keys():
    m = DropInMultiheadAttention(E, H, 0.1, False, segment_lengths=8, dilation_rates=1)
    assert (m.dropout, m.in_proj_bias, m.out_proj.bias, m.batch_first) == (0.1, None, None, False)
    assert "True = padding" in repr(m)
    with pytest.raises(ValueError, match="add_bias_kv=True, add_zero_attn=False"):
        DropInMultiheadAttention(E, H, add_bias_kv=True, segment_lengths=[8], dilation_rates=[1])
    with pytest.raises(ValueError, match="add_bias_kv=True or add_zero_attn=True"):
        DropInMultiheadAttention.from_torch(nn.MultiheadAttention(E, H, add_zero_attn=True), [8], [1])
    with pytest.raises(ValueError, match="kdim must be an int >= 1 or None, got 0"):
        DropInMultiheadAttention(E, H, kdim=0, segment_lengths=[8], dilation_rates=[1])
    with pytest.raises(TypeError, match="dilation_rates"):
        DropInMultiheadAttention(E, H, segment_lengths=[8])  # the branches are required
