"""DilatedAttention and MultiheadDilatedAttention against independent float64 references."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from reference import reference_attention

import dilated_attention
from dilated_attention import DilatedAttention, MultiheadDilatedAttention, hardware
from dilated_attention import dilated_attention as dattn
from dilated_attention.hilbert import hilbert_permutation

LOGGER = "dilated_attention.backends.registry"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rand(*shape, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)


# ----------------------------------------------------------------------------------------------
# DilatedAttention
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "native", "sdpa", "manual"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_dilated_attention_matches_reference(backend, is_causal):
    segs, rates = [8, 16, 32], [1, 2, 4]
    q = rand(2, 37, 4, 8, seed=1, requires_grad=True)
    k = rand(2, 37, 2, 8, seed=2, requires_grad=True)
    v = rand(2, 37, 2, 8, seed=3, requires_grad=True)
    attn = DilatedAttention(segs, rates, softmax_scale=0.4, attention_backend=backend)
    out = attn(q, k, v, is_causal=is_causal)
    ref, _ = reference_attention(q, k, v, segs, rates, is_causal, 0.4)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = rand(*out.shape, seed=4)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_dropout_in_training_only(caplog):
    q, k, v = (rand(1, 24, 2, 8, seed=s) for s in range(3))
    attn = DilatedAttention([8, 16], [1, 2], attention_dropout=0.3)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        a, b = attn(q, k, v), attn(q, k, v)
        assert not torch.equal(a, b)  # training: dropout
        attn.eval()
        c = attn(q, k, v)
    torch.testing.assert_close(c, reference_attention(q, k, v, [8, 16], [1, 2])[0])
    infos = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(infos) == 2 and "'native'" in infos[0] and "'native'" in infos[1]
    assert all(m.startswith("DilatedAttention:") for m in infos)
    assert "native (cpu float64, dropout), native (cpu float64)" in repr(attn)


def test_each_module_chooses_and_logs_once(caplog):
    q = rand(1, 16, 2, 8)
    a, b = DilatedAttention([8], [1]), DilatedAttention([8], [1])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            a(q, q, q)
            b(q, q, q)
    assert len([r for r in caplog.records if r.name == LOGGER]) == 2


def test_hilbert_ordering():
    H, W = 5, 6
    perm, inv = hilbert_permutation(H, W)
    segs, rates = [6, 12], [1, 2]
    q = rand(2, H * W, 4, 8, seed=1, requires_grad=True)
    k = rand(2, H * W, 2, 8, seed=2)
    v = rand(2, H * W, 2, 8, seed=3)
    attn = DilatedAttention(segs, rates, ordering="hilbert", grid=(H, W))
    out = attn(q, k, v, is_causal=True)
    # Independently: attend in curve order, then back to row-major order.
    ref = reference_attention(q[:, perm], k[:, perm], v[:, perm], segs, rates, True)[0][:, inv]
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    plain = DilatedAttention(segs, rates)(q, k, v, is_causal=True)
    assert not torch.allclose(out, plain)  # the order matters
    (gq,) = torch.autograd.grad(out.sum(), q)
    (rq,) = torch.autograd.grad(ref.sum(), q)
    torch.testing.assert_close(gq, rq, rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match=r"height=5, width=6.*30, got N=31"):
        attn(rand(1, 31, 4, 8), rand(1, 31, 2, 8), rand(1, 31, 2, 8))
    assert "ordering='hilbert', grid=(5, 6)" in repr(attn)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"ordering": "zorder"}, ValueError, "ordering must be one of"),
        ({"grid": (4, 4)}, ValueError, "only used with ordering='hilbert'"),
        ({"ordering": "hilbert"}, ValueError, "needs grid=\\(height, width\\)"),
        ({"ordering": "hilbert", "grid": (0, 4)}, ValueError, "grid must be a pair"),
        ({"ordering": "hilbert", "grid": (4,)}, ValueError, "grid must be a pair"),
        ({"ordering": "hilbert", "grid": 4}, ValueError, "grid must be a pair"),
        ({"attention_backend": "flash"}, ValueError, "unknown attention backend 'flash'"),
        ({"attention_dropout": 1.0}, ValueError, "dropout_p must be in"),
        ({"softmax_scale": float("inf")}, ValueError, "finite"),
        ({"use_xpos": True}, TypeError, "use_xpos"),
    ],
)
def test_dilated_attention_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DilatedAttention([8], [2], **kwargs)


def test_dilated_attention_bad_branches():
    with pytest.raises(ValueError, match="must not exceed"):
        DilatedAttention([4], [8])
    with pytest.raises(ValueError, match="same length"):
        DilatedAttention([4, 8], [1])


def test_compiles_fullgraph():
    attn = DilatedAttention([8, 16], [1, 2], attention_backend="native")
    q = rand(1, 24, 2, 8, dtype=torch.float32, requires_grad=True)
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    out = compiled(q, q, q, is_causal=True)
    torch.testing.assert_close(
        out.double(), reference_attention(q, q, q, [8, 16], [1, 2], True)[0], rtol=1e-5, atol=1e-5
    )
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def _scriptable_candidates() -> dict[str, torch.nn.Module]:
    from dilated_attention import DropInMultiheadAttention, RingDilatedAttention

    layer = torch.nn.TransformerEncoderLayer(32, 4, batch_first=True)
    layer.self_attn = DropInMultiheadAttention.from_torch(layer.self_attn, [8], [1])
    return {
        "DilatedAttention": DilatedAttention([8], [1]),
        "MultiheadDilatedAttention": MultiheadDilatedAttention(
            32, 4, segment_lengths=[8], dilation_rates=[1]
        ),
        "DropInMultiheadAttention": DropInMultiheadAttention(32, 4, segment_lengths=[8], dilation_rates=[1]),
        "RingDilatedAttention": RingDilatedAttention([8], [1]),
        "in nn.Sequential": torch.nn.Sequential(DilatedAttention([8], [1])),
        "in nn.TransformerEncoderLayer": layer,
    }


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script's own deprecation
@pytest.mark.parametrize("case", list(_scriptable_candidates()))
def test_torch_jit_script_is_refused_by_name(case):
    """torch.jit.script of a module, or of a model holding one, names torch.jit.script and the
    alternatives instead of failing inside TorchScript ("Unknown type annotation")."""
    module = _scriptable_candidates()[case]
    name = case if not case.startswith("in ") else "DilatedAttention|DropInMultiheadAttention"
    with pytest.raises(
        RuntimeError, match=rf"({name}) cannot be compiled by torch.jit.script.*torch.compile"
    ):
        torch.jit.script(module)


# ----------------------------------------------------------------------------------------------
# MultiheadDilatedAttention
# ----------------------------------------------------------------------------------------------


def mhda_reference(m: MultiheadDilatedAttention, query, key, value, is_causal):
    """The module's computation written out in float64 from its parameters."""

    def lin(layer, x):
        y = x.double() @ layer.weight.double().T
        return y if layer.bias is None else y + layer.bias.double()

    B, N, E = query.shape
    H, Dh = m.num_heads, E // m.num_heads
    q = lin(m.q_proj, query).view(B, N, H, Dh)
    k = lin(m.k_proj, key).view(B, N, H, Dh)
    v = lin(m.v_proj, value).view(B, N, H, Dh)
    o, _ = reference_attention(q, k, v, m.segment_lengths, m.dilation_rates, is_causal)
    o = o.reshape(B, N, E)
    if m.norm is not None:
        o = F.layer_norm(o, (E,), m.norm.weight.double(), m.norm.bias.double(), m.norm.eps)
    return lin(m.out_proj, o)


@pytest.mark.parametrize("layer_norm,bias", [(True, True), (False, False)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_mhda_matches_reference(layer_norm, bias, is_causal):
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(
        32, 4, [8, 16], [1, 2], bias=bias, layer_norm=layer_norm, dtype=torch.float64
    )
    if layer_norm:  # make the LayerNorm's affine part matter
        with torch.no_grad():
            m.norm.weight.uniform_(0.5, 1.5)
            m.norm.bias.uniform_(-0.5, 0.5)
    x_q, x_k, x_v = (rand(2, 21, 32, seed=s, requires_grad=True) for s in range(3))
    out, weights = m(x_q, x_k, x_v, is_causal=is_causal)
    assert weights is None and out.shape == (2, 21, 32)
    ref = mhda_reference(m, x_q, x_k, x_v, is_causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    params = [m.q_proj.weight, m.v_proj.weight, m.out_proj.weight]
    got = torch.autograd.grad(out.square().sum(), [x_q, x_k, x_v, *params])
    want = torch.autograd.grad(ref.square().sum(), [x_q, x_k, x_v, *params])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_self_attention_shortcut_and_unbatched():
    m = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2], dtype=torch.float64)
    x = rand(3, 12, 16)
    a, _ = m(x)
    b, _ = m(x, x, x)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    c, _ = m(x[1])  # (N, E)
    torch.testing.assert_close(c, a[1])


def test_both_spellings_of_width_and_heads():
    torch.manual_seed(0)
    a = MultiheadDilatedAttention(embed_dim=32, num_heads=4, segment_lengths=[8], dilation_rates=[1])
    torch.manual_seed(0)
    b = MultiheadDilatedAttention(dim=32, heads=4, segment_lengths=[8], dilation_rates=[1])
    torch.manual_seed(0)
    c = MultiheadDilatedAttention(32, 4, [8], [1], dim=32, heads=4)  # both, agreeing
    for m in (b, c):
        for (n1, p1), (n2, p2) in zip(a.named_parameters(), m.named_parameters(), strict=True):
            assert n1 == n2 and torch.equal(p1, p2)
    assert (b.dim, b.heads, b.embed_dim, b.num_heads, b.head_dim) == (32, 4, 32, 4, 8)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((32, 4, [8], [1]), {"dim": 64}, ValueError, "embed_dim=32 and dim=64 disagree"),
        ((32, 4, [8], [1]), {"heads": 2}, ValueError, "num_heads=4 and heads=2 disagree"),
        (
            (),
            {"num_heads": 4, "segment_lengths": [8], "dilation_rates": [1]},
            TypeError,
            "embed_dim \\(or dim\\) is required",
        ),
        (
            (32,),
            {"segment_lengths": [8], "dilation_rates": [1]},
            TypeError,
            "num_heads \\(or heads\\) is required",
        ),
        ((32, 4), {}, TypeError, "segment_lengths and dilation_rates are required"),
        ((30, 4, [8], [1]), {}, ValueError, "divisible by num_heads"),
        ((1028, 4, [8], [1]), {}, ValueError, "exceeds 256"),
        ((32, 0, [8], [1]), {}, ValueError, "num_heads must be an int >= 1, got 0"),
        ((32.0, 4, [8], [1]), {}, ValueError, "embed_dim must be an int"),
        ((32, 4, [8], [1]), {"dropout": 1.5}, ValueError, "dropout_p must be in"),
        ((32, 4, [8], [1]), {"bias": "yes"}, ValueError, "bias must be a bool"),
        ((32, 4, [8], [1]), {"gamma_init": 0.0}, ValueError, "gamma_init must be a finite number > 0"),
        ((32, 4, [8], [1]), {"dtype": torch.int32}, ValueError, "dtype must be"),
        ((32, 4, [8], [1]), {"dtype": "float8"}, ValueError, "dtype must be"),
        ((32, 4, [8], [1]), {"attention_backend": "xformer"}, ValueError, "unknown attention backend"),
        ((32, 4, [8], [1]), {"layer_norm_eps": 0}, ValueError, "layer_norm_eps"),
        ((32, 4, [8], [16]), {}, ValueError, "must not exceed"),
        ((32, 4, [8], [1]), {"batch_first": True}, TypeError, "batch_first"),
        ((32, 4, [8], [1]), {"use_rel_pos": True}, TypeError, "use_rel_pos"),
    ],
)
def test_mhda_bad_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MultiheadDilatedAttention(*args, **kwargs)


def test_mhda_bad_inputs():
    m = MultiheadDilatedAttention(16, 2, [4], [1])
    x = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="\\(B, N, 16\\)"):
        m(torch.randn(2, 8, 12))
    with pytest.raises(ValueError, match="\\(B, N, 16\\)"):
        m(torch.randn(1, 2, 8, 16))
    with pytest.raises(ValueError, match="give both key and value"):
        m(x, x)
    with pytest.raises(ValueError, match="same shape"):
        m(x, x[:, :4], x[:, :4])
    with pytest.raises(TypeError, match=r"query must be a torch\.Tensor"):
        m(x.tolist())
    with pytest.raises(
        ValueError, match=r"query is torch\.float64 but the module's weights are torch\.float32"
    ):
        m(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts at each projection
        assert m(x)[0].dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_mhda_refuses_nested_inputs_by_name():
    """A nested tensor gets the TypeError of the package, not PyTorch's internal error about sizes."""
    m = MultiheadDilatedAttention(8, 2, segment_lengths=[8], dilation_rates=[1])
    x = torch.nested.nested_tensor([torch.randn(8, 8), torch.randn(6, 8)])
    with pytest.raises(TypeError, match=r"query must be a dense .* nested tensor; .* key_padding_mask"):
        m(x, x, x)


def test_functional_refuses_nested_sparse_and_meta_mask():
    """Tensors the kernels cannot read are refused by the package, not by PyTorch's internals."""
    x = torch.randn(1, 8, 2, 4)
    nested = torch.nested.nested_tensor([torch.randn(8, 2, 4), torch.randn(6, 2, 4)])
    with pytest.raises(TypeError, match=r"q must be a dense \(strided\) tensor, got a nested tensor"):
        dattn(nested, nested, nested, [4], [1])
    with pytest.raises(
        TypeError, match=r"k must be a dense \(strided\) tensor, got layout torch\.sparse_coo"
    ):
        dattn(x, x.to_sparse(), x, [4], [1])
    mask = torch.ones(1, 8, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"key_padding_mask is a meta tensor .* q is on cpu"):
        DilatedAttention([4], [1])(x, x, x, key_padding_mask=mask)


def test_dtype_auto_and_names(monkeypatch):
    m = MultiheadDilatedAttention(16, 2, [4], [1], dtype="auto")
    assert m.q_proj.weight.dtype == hardware.recommended_dtype("cpu") == torch.float32
    monkeypatch.setattr(hardware, "recommended_dtype", lambda device=None: torch.bfloat16)
    m = MultiheadDilatedAttention(16, 2, [4], [1], dtype="auto", device="cpu")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    out, _ = m(torch.randn(1, 8, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    m = MultiheadDilatedAttention(16, 2, [4], [1], dtype="float64")
    assert m.out_proj.weight.dtype == torch.float64


def test_initialisation():
    E, gamma = 256, 0.5
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(E, 4, [8], [1], gamma_init=gamma)
    xavier = math.sqrt(2.0 / (E + E))
    for lin, gain in ((m.q_proj, 1.0), (m.k_proj, 1.0), (m.v_proj, gamma), (m.out_proj, gamma)):
        assert abs(lin.weight.std().item() / (gain * xavier) - 1) < 0.03
        assert abs(lin.weight.mean().item()) < 0.01 * gain * xavier * 10
        assert (lin.bias == 0).all()
    assert m.norm is not None and isinstance(m.norm, torch.nn.LayerNorm)


def test_mhda_dropout_and_repr(caplog):
    m = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2], dropout=0.5, dtype=torch.float64)
    x = rand(1, 16, 16)
    assert "not selected yet" in repr(m)
    a, _ = m(x)
    b, _ = m(x)
    assert not torch.equal(a, b)
    m.eval()
    c, _ = m(x)
    torch.testing.assert_close(c, mhda_reference(m, x, x, x, False), rtol=1e-10, atol=1e-10)
    text = repr(m)
    for part in (
        "embed_dim=16",
        "num_heads=2",
        "dropout=0.5",
        "segment_lengths=[4, 8]",
        "dilation_rates=[1, 2]",
        "attention_backend='auto'",
        "native (cpu float64, dropout)",
        "native (cpu float64)",
        "(norm)",
    ):
        assert part in text, (part, text)


def test_mhda_explicit_backend_and_hilbert():
    m = MultiheadDilatedAttention(
        16,
        4,
        [6, 12],
        [1, 2],
        attention_backend="manual",
        ordering="hilbert",
        grid=(3, 8),
        dtype=torch.float64,
    )
    x = rand(2, 24, 16)
    out, _ = m(x, is_causal=True)
    perm, inv = hilbert_permutation(3, 8)
    # Attention in curve order is the module on the permuted sequence, permuted back (the
    # projections and the LayerNorm act per token).
    seq = MultiheadDilatedAttention(16, 4, [6, 12], [1, 2], dtype=torch.float64)
    seq.load_state_dict(m.state_dict())
    torch.testing.assert_close(out, seq(x[:, perm], is_causal=True)[0][:, inv], rtol=1e-10, atol=1e-10)
    assert "manual (cpu float64)" in repr(m)


def test_copy_and_state_dict():
    m = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2], dtype=torch.float64)
    x = rand(1, 8, 16)
    a, _ = m(x)
    c = copy.deepcopy(m)
    assert "not selected yet" in repr(c.attention)
    torch.testing.assert_close(c(x)[0], a)
    fresh = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2], dtype=torch.float64)
    fresh.load_state_dict(m.state_dict())
    torch.testing.assert_close(fresh(x)[0], a)
    assert set(m.state_dict()) == {
        f"{n}.{p}" for n in ("q_proj", "k_proj", "v_proj", "out_proj", "norm") for p in ("weight", "bias")
    }


def test_exports():
    for name in (
        "DilatedAttention",
        "MultiheadDilatedAttention",
        "dilated_attention",
        "hardware",
        "backends",
        "hilbert_permutation",
        "recommended_dtype",
        "recommended_backends",
        "select_backend",
    ):
        assert hasattr(dilated_attention, name), name
        assert name in dilated_attention.__all__
