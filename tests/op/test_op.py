"""The fused native op on the CPU against the float64 dense reference (SPEC sections 1-4)."""

from __future__ import annotations

import random
import re

import pytest
import torch
from common import grads, make_inputs
from reference import reference_attention
from tolerance import assert_within_rule

import dilated_attention
from dilated_attention import dilated_attention as dattn

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# (B, N, Hq, Hkv, D, segment_lengths, dilation_rates)
CONFIGS = [
    pytest.param(1, 16, 1, 1, 8, [4], [1], id="one-branch"),
    pytest.param(2, 37, 4, 2, 16, [8, 16], [1, 2], id="odd-N-gqa-ragged"),
    pytest.param(1, 64, 4, 4, 32, [16, 32, 64], [1, 2, 4], id="three-branches"),
    pytest.param(2, 50, 6, 3, 24, [5, 10, 20, 40], [1, 2, 3, 4], id="four-branches-ragged"),
    pytest.param(1, 20, 2, 1, 8, [32], [2], id="w-greater-than-N"),
    pytest.param(1, 30, 4, 2, 16, [6, 12], [6, 3], id="r-equals-w"),
    pytest.param(1, 129, 8, 2, 64, [32, 64, 128], [1, 2, 4], id="blocks-span-segments"),
    pytest.param(1, 16, 2, 2, 8, [8], [4], id="uncovered-rows"),
    pytest.param(1, 9, 2, 1, 1, [4], [2], id="head-dim-1"),
    pytest.param(1, 70, 1, 1, 256, [64], [1], id="head-dim-256"),
    pytest.param(3, 200, 2, 1, 16, [64, 256], [2, 8], id="batch-3-long"),
    pytest.param(1, 1, 2, 1, 4, [1, 4], [1, 2], id="N-1"),
    pytest.param(2, 96, 4, 1, 8, [8, 8], [1, 1], id="repeated-branch-counts-twice"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,N,Hq,Hkv,D,segs,rates", CONFIGS)
def test_matches_reference(B, N, Hq, Hkv, D, segs, rates, is_causal, dtype):
    q, k, v = make_inputs(B, N, Hq, Hkv, D, dtype)
    out, lse = dattn(q, k, v, segs, rates, is_causal=is_causal, return_lse=True, backend="native")
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (B, Hq, N)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_attention(q64, k64, v64, segs, rates, is_causal)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_attention(ql, kl, vl, segs, rates, is_causal, dtype=dtype)

    assert_within_rule("out", out, out64, outl, dtype)
    assert_within_rule("lse", lse, lse64, lsel, dtype)

    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64) if dtype != torch.float16 else None
    got = grads(out, lse, (q, k, v), dout, dlse)
    ref = grads(out64, lse64, (q64, k64, v64), dout, dlse)
    plain = grads(outl, lsel, (ql, kl, vl), dout, dlse)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert a.dtype == dtype
        assert_within_rule(name, a, e, p, dtype)


def test_uncovered_rows_are_zero_with_neg_inf_lse():
    # r = 4 > Hq = 2: positions at phases 2 and 3 of each segment are read by no head.
    q, k, v = make_inputs(1, 16, 2, 2, 8, torch.float32)
    out, lse = dattn(q, k, v, [8], [4], return_lse=True)
    phase = (torch.arange(16) % 8) % 4
    for h in range(2):
        covered = phase == h  # head h reads phase h only
        assert torch.isfinite(lse[0, h, covered]).all()
        assert torch.isneginf(lse[0, h, ~covered]).all()
        assert (out[0, ~covered, h] == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_softmax_scale_and_transposed_inputs():
    B, N, H, D = 2, 45, 4, 16
    g = torch.Generator().manual_seed(3)
    # (B, H, N, D) storage seen as (B, N, H, D): not contiguous.
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, N, H, 2 * D, generator=g, dtype=torch.float64)[..., ::2]  # strided last dim
    assert not q.is_contiguous() and not v.is_contiguous()
    q.requires_grad_()
    out, lse = dattn(q, k, v, [8, 32], [1, 4], softmax_scale=0.3, return_lse=True, is_causal=True)
    out64, lse64 = reference_attention(q, k, v, [8, 32], [1, 4], True, softmax_scale=0.3)
    torch.testing.assert_close(out, out64, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse64, rtol=1e-10, atol=1e-10)
    (dq,) = torch.autograd.grad(out.sum(), q)
    (dq64,) = torch.autograd.grad(out64.sum(), q)
    torch.testing.assert_close(dq, dq64, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
def test_large_float32_in_both_layouts(layout):
    """Inputs of 4 MiB each, so that the CPU op's head-major copies and accumulators are large
    buffers; (B, N, H, D) inputs are copied, (B, H, N, D) storage is read in place."""
    B, N, H, D, segs, rates = 1, 1024, 8, 128, [256, 1024], [1, 4]
    q, k, v = make_inputs(B, N, H, H, D, torch.float32, seed=5, requires_grad=False)
    if layout == "bhnd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        assert not q.is_contiguous()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert q.numel() * q.element_size() == 4 << 20
    out, lse = dattn(q, k, v, segs, rates, is_causal=True, return_lse=True, backend="native")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference_attention(q64, k64, v64, segs, rates, True)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outl, lsel = reference_attention(ql, kl, vl, segs, rates, True, dtype=torch.float32)
    assert_within_rule("out", out, out64, outl, torch.float32)
    assert_within_rule("lse", lse, lse64, lsel, torch.float32)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = grads(out, lse, (q, k, v), dout, None)
    assert all(g.is_contiguous() and g.shape == (B, N, H, D) for g in got)
    ref = grads(out64, lse64, (q64, k64, v64), dout, None)
    plain = grads(outl, lsel, (ql, kl, vl), dout, None)
    for name, a, e, p in zip(("dq", "dk", "dv"), got, ref, plain, strict=True):
        assert_within_rule(name, a, e, p, torch.float32)


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck(is_causal):
    q, k, v = make_inputs(1, 11, 4, 2, 3, torch.float64, seed=5)

    def f(q, k, v):
        out, lse = dattn(q, k, v, [4, 8], [1, 2], is_causal=is_causal, return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("float64_lse", [False, True], ids=["lse", "float64-lse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_opcheck(dtype, float64_lse):
    q, k, v = make_inputs(2, 19, 4, 2, 8, dtype)
    args = (q, k, v, [4, 8], [1, 2], True, 0.35, float64_lse)
    torch.library.opcheck(torch.ops.dilated_attention.fwd.default, args)
    out, lse = torch.ops.dilated_attention.fwd(*args)
    assert lse.dtype == (torch.float64 if float64_lse or dtype == torch.float64 else torch.float32)
    dout = torch.randn_like(out)
    bargs = (
        dout,
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse.detach(),
        None,
        [4, 8],
        [1, 2],
        True,
        0.35,
    )
    torch.library.opcheck(torch.ops.dilated_attention.bwd.default, bargs)


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = make_inputs(1, 33, 4, 2, 8, torch.float32)

    def f(q, k, v):
        return dattn(q, k, v, [8, 16], [1, 2], is_causal=True, backend="native").square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    gq, gk, gv = torch.autograd.grad(loss, (q, k, v))
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, _ = reference_attention(q2, k2, v2, [8, 16], [1, 2], True)
    loss64 = out64.square().sum()
    r = torch.autograd.grad(loss64, (q2, k2, v2))
    torch.testing.assert_close(loss.double(), loss64, rtol=1e-5, atol=1e-5)
    for a, e in zip((gq, gk, gv), r, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4)


def test_torch_compile_inductor():
    q, k, v = make_inputs(1, 24, 2, 2, 8, torch.float32, requires_grad=False)
    f = torch.compile(lambda q, k, v: dattn(q, k, v, [8], [2]) * 2, fullgraph=True)
    out = f(q, k, v)
    torch.testing.assert_close(
        out.double(), 2 * reference_attention(q, k, v, [8], [2])[0], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("shape", [(0, 8, 2, 4), (2, 0, 2, 4)])
def test_empty_inputs(shape):
    q = torch.randn(shape, requires_grad=True)
    out, lse = dattn(q, q, q, [4], [1], return_lse=True)
    assert out.shape == shape and lse.shape == (shape[0], shape[2], shape[1])
    out.sum().backward()
    assert q.grad.shape == shape
    out, lse = torch.ops.dilated_attention.fwd(q, q, q, [4], [1], False, 1.0)
    assert out.shape == shape


def test_nan_and_inf_propagate_without_crashing():
    q, k, v = make_inputs(1, 16, 2, 2, 4, torch.float32, requires_grad=False)
    q[0, 3, 0, 0] = float("nan")
    k[0, 5, 1, 1] = float("inf")
    out, _ = dattn(q, k, v, [8], [1], return_lse=True)
    assert torch.isnan(out[0, 3, 0]).all()  # its own row
    assert torch.isfinite(out[0, 8:, 0]).all()  # another segment is untouched
    assert not torch.isfinite(out[0, :8, 1]).all()  # the inf key poisons its segment for head 1
    v[0, 9, 0, 0] = float("-inf")
    out = dattn(q, k, v, [8], [1])
    assert not torch.isfinite(out[0, 8:, 0, 0]).all()


def test_multiplicity_counts_repeated_branches():
    """Two identical branches equal one branch (weights cancel) but lse grows by log 2."""
    q, k, v = make_inputs(1, 24, 2, 2, 8, torch.float64, requires_grad=False)
    out1, lse1 = dattn(q, k, v, [8], [2], return_lse=True)
    out2, lse2 = dattn(q, k, v, [8, 8], [2, 2], return_lse=True)
    torch.testing.assert_close(out1, out2)
    covered = torch.isfinite(lse1)
    torch.testing.assert_close(
        lse2[covered], lse1[covered] + torch.log(torch.tensor(2.0, dtype=torch.float64))
    )


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def _qkv(B=1, N=8, Hq=2, Hkv=2, D=4, dtype=torch.float32):
    return (
        torch.randn(B, N, Hq, D, dtype=dtype),
        torch.randn(B, N, Hkv, D, dtype=dtype),
        torch.randn(B, N, Hkv, D, dtype=dtype),
    )


BAD_ARGS = [
    ("q ndim", lambda q, k, v: (q[0], k, v, [4], [1]), {}, "4-D"),
    ("k shape", lambda q, k, v: (q, k[:, :4], v[:, :4], [4], [1]), {}, "agree"),
    ("v shape", lambda q, k, v: (q, k, v[..., :2], [4], [1]), {}, "same shape"),
    ("dtype mismatch", lambda q, k, v: (q, k.double(), v, [4], [1]), {}, "dtype"),
    ("int dtype", lambda q, k, v: (q.long(), k.long(), v.long(), [4], [1]), {}, "float16"),
    ("Hq % Hkv", lambda q, k, v: (torch.randn(1, 8, 3, 4), k, v, [4], [1]), {}, "multiple"),
    ("empty segments", lambda q, k, v: (q, k, v, [], []), {}, "must not be empty"),
    ("unequal lengths", lambda q, k, v: (q, k, v, [4, 8], [1]), {}, "same length"),
    ("w < 1", lambda q, k, v: (q, k, v, [0], [1]), {}, "segment_lengths[0] must be >= 1, got 0"),
    ("r < 1", lambda q, k, v: (q, k, v, [4], [0]), {}, "dilation_rates[0] must be >= 1, got 0"),
    ("r > w", lambda q, k, v: (q, k, v, [4], [5]), {}, "dilation_rates[0] = 5 must not exceed"),
    ("float segment", lambda q, k, v: (q, k, v, [4.0], [1]), {}, "must be an integer, got 4.0"),
    ("bool rate", lambda q, k, v: (q, k, v, [4], [True]), {}, "must be an integer, got True"),
    ("string segments", lambda q, k, v: (q, k, v, "4", [1]), {}, "sequence of integers"),
    ("set segments", lambda q, k, v: (q, k, v, {4, 8}, [1, 2]), {}, "got a set, .*: it has no order"),
    ("dict rates", lambda q, k, v: (q, k, v, [4], {1: 1}), {}, "dilation_rates must be a sequence"),
    ("head dim", lambda q, k, v: (torch.randn(1, 8, 2, 257),) * 3 + ([4], [1]), {}, "head dim"),
    ("scale nan", lambda q, k, v: (q, k, v, [4], [1]), {"softmax_scale": float("nan")}, "finite"),
    ("dropout", lambda q, k, v: (q, k, v, [4], [1]), {"dropout_p": 1.5}, "dropout_p"),
    ("causal type", lambda q, k, v: (q, k, v, [4], [1]), {"is_causal": "yes"}, "is_causal"),
    ("too many branches", lambda q, k, v: (q, k, v, [4] * 17, [1] * 17), {}, "at most"),
]


@pytest.mark.parametrize("name,make,kwargs,match", BAD_ARGS, ids=[a[0] for a in BAD_ARGS])
def test_bad_input_python(name, make, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match.replace("[", r"\[").replace("]", r"\]")):
        dattn(*make(*_qkv()), **kwargs)


def test_not_a_tensor():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor"):
        dattn(q.tolist(), k, v, [4], [1])


def test_devices_disagree():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="same device"):
        dattn(q, k.to("meta"), v, [4], [1])


BAD_OP_ARGS = [
    (lambda q, k, v: (q[0], k, v, [4], [1], False, 1.0), "q must be 4-D"),
    (lambda q, k, v: (q, k[:, :4], v[:, :4], [4], [1], False, 1.0), "must agree"),
    (lambda q, k, v: (q, k, v, [], [], False, 1.0), "must not be empty"),
    (lambda q, k, v: (q, k, v, [4, 2], [1], False, 1.0), "same length"),
    (lambda q, k, v: (q, k, v, [-3], [1], False, 1.0), "segment_lengths\\[0\\] must be >= 1, got -3"),
    (lambda q, k, v: (q, k, v, [4], [9], False, 1.0), "must not exceed"),
    (lambda q, k, v: (q.half(), k, v, [4], [1], False, 1.0), "same dtype"),
]


@pytest.mark.parametrize("make,match", BAD_OP_ARGS)
def test_bad_input_op(make, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.dilated_attention.fwd(*make(*_qkv()))


# (dtype, softmax_scale): beyond max / 2 of the compute dtype (float32, or float64 for float64).
BAD_SCALES = [
    (torch.float32, 1e39),
    (torch.bfloat16, -1e39),
    (torch.float16, 3e38),
    (torch.float64, 1e308),
    (torch.float32, float("inf")),
    (torch.float32, float("nan")),
]


def _raw_forwards(q, k, v, scale):
    """Every forward entry of the op, called on q, k, v with ``scale``."""
    cu = torch.tensor([0, q.shape[1]], dtype=torch.int32)
    n = q.shape[1]
    return {
        "fwd": lambda: torch.ops.dilated_attention.fwd(q, k, v, [4], [1], False, scale),
        "varlen_fwd": lambda: torch.ops.dilated_attention.varlen_fwd(
            q[0], k[0], v[0], cu, n, [4], [1], False, scale
        ),
        "piece_fwd": lambda: torch.ops.dilated_attention.piece_fwd(q, k, v, True, 0, scale),
        "bwd": lambda: torch.ops.dilated_attention.bwd(
            q, q, k, v, q, q.new_zeros((1, q.shape[2], n), dtype=torch.float32), None, [4], [1], False, scale
        ),
    }


@pytest.mark.parametrize("dtype,scale", BAD_SCALES, ids=str)
def test_raw_ops_refuse_a_scale_the_scores_cannot_hold(dtype, scale):
    """A softmax_scale whose scaled queries overflow the compute dtype gave NaN out of the raw ops
    (float32 piece_fwd with 1e39); now a ValueError naming it, with the functional API's rule."""
    q, k, v = (t.to(dtype) for t in _qkv())
    compute = "float64" if dtype == torch.float64 else "float32"
    name = str(dtype).replace("torch.", "")
    for call in _raw_forwards(q, k, v, scale).values():
        want = rf"softmax_scale must be finite in the compute dtype {compute} of {name} inputs .*got "
        with pytest.raises(ValueError, match=want + re.escape(repr(scale))):
            call()


def test_raw_ops_take_a_large_finite_scale():
    """A scale just inside the rule is accepted (zero queries: every score is 0)."""
    q, k, v = _qkv()
    out, lse = torch.ops.dilated_attention.piece_fwd(q * 0, k, v, False, 0, 1.7e38)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_bad_backward_inputs():
    q, k, v = _qkv()
    out, lse = torch.ops.dilated_attention.fwd(q, k, v, [4], [1], False, 1.0)
    with pytest.raises(RuntimeError, match="lse must have shape"):
        torch.ops.dilated_attention.bwd(out, q, k, v, out, lse[:, :1], None, [4], [1], False, 1.0)
    with pytest.raises(RuntimeError, match="lse must be float32 or float64, got float16"):
        torch.ops.dilated_attention.bwd(out, q, k, v, out, lse.half(), None, [4], [1], False, 1.0)
    with pytest.raises(RuntimeError, match="dout must have"):
        torch.ops.dilated_attention.bwd(out[:, :4], q, k, v, out, lse, None, [4], [1], False, 1.0)


def test_randomized_bad_inputs_never_crash():
    """Random shapes, branch lists and values: either a correct result or a clean error."""
    rng = random.Random(1234)
    for _ in range(300):
        B, N = rng.choice([0, 1, 2]), rng.choice([0, 1, 5, 17])
        Hq, Hkv = rng.choice([0, 1, 2, 4, 6]), rng.choice([0, 1, 2, 3])
        D = rng.choice([0, 1, 4, 300])
        ndim = rng.choice([4, 4, 4, 3, 5])
        n_br = rng.choice([0, 1, 2, 3])
        segs = [rng.choice([-2, 0, 1, 3, 8, 100]) for _ in range(n_br)]
        rates = [rng.choice([-1, 0, 1, 2, 5]) for _ in range(n_br + rng.choice([0, 0, 1]))]
        dtype = rng.choice([torch.float32, torch.float64, torch.int32])
        try:
            shape_q = (B, N, Hq, D)[:ndim] + (2,) * max(0, ndim - 4)
            q = torch.randn(shape_q).to(dtype)
            k = torch.randn(B, N, Hkv, D).to(dtype)
            v = torch.randn(B, N, Hkv, D).to(dtype)
        except RuntimeError:
            continue
        for call in (
            lambda q=q, k=k, v=v, segs=segs, rates=rates: dattn(q, k, v, segs, rates),
            lambda q=q, k=k, v=v, segs=segs, rates=rates: torch.ops.dilated_attention.fwd(
                q, k, v, segs, rates, False, 0.5
            ),
        ):
            try:
                out = call()
            except (ValueError, TypeError, RuntimeError):
                continue
            out = out[0] if isinstance(out, tuple) else out
            ok = (
                q.dim() == 4
                and q.is_floating_point()
                and D in range(1, 257)
                and Hkv > 0
                and Hq % Hkv == 0
                and segs
                and len(segs) == len(rates)
                and all(1 <= r <= w for w, r in zip(segs, rates, strict=True))
            )
            assert ok or (q.numel() == 0 and B * N == 0), (q.shape, k.shape, segs, rates, dtype)
            if B * N and ok:
                torch.testing.assert_close(
                    out.double(), reference_attention(q, k, v, segs, rates)[0], rtol=1e-4, atol=1e-4
                )


def test_version_and_kernels():
    assert dilated_attention.__version__
    assert dilated_attention.op.has_kernel("cpu")
