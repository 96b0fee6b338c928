"""The op's fake kernels refuse what its CPU kernels refuse, with the same exception type, and the
Python API refuses the same inputs with a ValueError; every error names the bad value.

Under FakeTensorMode (torch.compile, torch.export) and on meta tensors the op runs its fake kernels
(dilated_attention/op/checks.py, with the rules of dilated_attention/_validation.py), not the C++
checks of csrc/checks.h. Each bad call below runs three ways: on real CPU tensors, on fake tensors
and on meta tensors; all three must raise the same exception type, each with a message that names
the value (the case's pattern), or all three succeed with the same output shapes. The C++ kernels
are the reference: the test fails when either side stops refusing, changes its exception type or
stops naming the value. The words of the messages may differ.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from dilated_attention import dilated_attention, dilated_attention_varlen
from dilated_attention.op.decode import has_decode_kernel
from dilated_attention.op.slots import branch_slots

ops = torch.ops.dilated_attention

B, N, HQ, HKV, D = 1, 8, 4, 2, 16


def qkv(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, HQ, D, generator=g).to(dtype)
    k, v = (torch.randn(B, N, HKV, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def fwd_case(q=None, k=None, v=None, segs=(4,), rates=(1,), scale=0.25, dropout_p=0.0):
    dq, dk, dv = qkv()
    return ops.fwd, (
        dq if q is None else q,
        dk if k is None else k,
        dv if v is None else v,
        list(segs),
        list(rates),
        False,
        scale,
        False,
        dropout_p,
    )


def bwd_case(dout=None, out=None, lse=None, dlse=None, dropout_p=0.0, **fwd_kwargs):
    _, (q, k, v, segs, rates, causal, scale, _, _) = fwd_case(**fwd_kwargs)
    real_out, real_lse = ops.fwd(*qkv(), [4], [1], False, 0.25)
    return ops.bwd, (
        real_out if dout is None else dout,
        q,
        k,
        v,
        real_out if out is None else out,
        real_lse if lse is None else lse,
        dlse,
        segs,
        rates,
        causal,
        scale,
        dropout_p,
    )


def varlen_case(
    q=None, k=None, v=None, cu=None, max_seqlen=N, segs=(4,), rates=(1,), scale=0.25, dropout_p=0.0
):
    dq, dk, dv = (t[0] for t in qkv())
    return ops.varlen_fwd, (
        dq if q is None else q,
        dk if k is None else k,
        dv if v is None else v,
        torch.tensor([0, 3, N], dtype=torch.int32) if cu is None else cu,
        max_seqlen,
        list(segs),
        list(rates),
        False,
        scale,
        False,
        dropout_p,
    )


def varlen_bwd_case(dout=None, out=None, lse=None, dlse=None, **kwargs):
    _, (q, k, v, cu, max_seqlen, segs, rates, causal, scale, _, dropout_p) = varlen_case(**kwargs)
    real_out, real_lse = ops.varlen_fwd(*(t[0] for t in qkv()), cu, N, [4], [1], False, 0.25)
    return ops.varlen_bwd, (
        real_out if dout is None else dout,
        q,
        k,
        v,
        real_out if out is None else out,
        real_lse if lse is None else lse,
        dlse,
        cu,
        max_seqlen,
        segs,
        rates,
        causal,
        scale,
        dropout_p,
    )


def piece_case(q=None, k=None, v=None, scale=0.25):
    dq, dk, dv = qkv()
    return ops.piece_fwd, (
        dq if q is None else q,
        dk[:, :5] if k is None else k,
        dv[:, :5] if v is None else v,
        True,
        2,
        scale,
    )


def piece_bwd_case(dout=None, lse=None, dlse=None, **kwargs):
    _, (q, k, v, causal, offset, scale) = piece_case(**kwargs)
    real_out, real_lse = ops.piece_fwd(*piece_case()[1])
    return ops.piece_bwd, (
        real_out if dout is None else dout,
        q,
        k,
        v,
        real_out,
        real_lse if lse is None else lse,
        dlse,
        causal,
        offset,
        scale,
    )


def decode_case(
    q=None, k=None, v=None, kc=None, vc=None, pos=None, segs=(8, 32), rates=(1, 4), slots=None, scale=0.25
):
    g = torch.Generator().manual_seed(0)
    layout = branch_slots((8, 32), (1, 4), HQ // HKV, None)
    T = sum(br.rows * br.length for br in layout)
    cache = torch.randn(2, HKV, T, D, generator=g)
    dflt = {
        "q": torch.randn(2, HQ, D, generator=g),
        "k": torch.randn(2, HKV, D, generator=g),
        "v": torch.randn(2, HKV, D, generator=g),
    }
    return ops.decode_step, (
        dflt["q"] if q is None else q,
        dflt["k"] if k is None else k,
        dflt["v"] if v is None else v,
        cache.clone() if kc is None else kc,
        cache.clone() if vc is None else vc,
        torch.tensor([3, 9]) if pos is None else pos,
        list(segs),
        list(rates),
        [br.length for br in layout] if slots is None else list(slots),
        scale,
    )


def dropout_mask_case(B=1, H=2, Nq=3, Nk=4, dropout_p=0.5):
    return ops.dropout_mask, (B, H, Nq, Nk, dropout_p, 1, 2)


q0, k0, v0 = qkv()
_HEAD_DIM_300 = {"q": torch.zeros(2, HQ, 300), "k": torch.zeros(2, HKV, 300), "v": torch.zeros(2, HKV, 300)}
_HEAD_DIM_0 = {"q": torch.zeros(2, HQ, 0), "k": torch.zeros(2, HKV, 0), "v": torch.zeros(2, HKV, 0)}

# name: (the call, a pattern every message of it must contain: the bad value; None: a valid call)
CASES: dict[str, tuple[Callable[[], tuple[Any, tuple[Any, ...]]], str | None]] = {
    # fwd: every check of check_inputs and dropout_params, in order
    "fwd-valid": (lambda: fwd_case(), None),
    "fwd-q-3d": (lambda: fwd_case(q=q0[0]), r"8, 4, 16"),
    "fwd-k-3d": (lambda: fwd_case(k=k0[0]), r"8, 2, 16"),
    "fwd-v-5d": (lambda: fwd_case(v=v0[None]), r"1, 1, 8, 2, 16"),
    "fwd-k-dtype": (lambda: fwd_case(k=k0.double()), r"float64"),
    "fwd-v-dtype": (lambda: fwd_case(v=v0.half()), r"float16"),
    "fwd-int-inputs": (lambda: fwd_case(*(t.int() for t in qkv())), r"int32"),
    "fwd-bool-inputs": (lambda: fwd_case(*(t > 0 for t in qkv())), r"bool"),
    "fwd-kv-shapes": (lambda: fwd_case(v=v0[:, :, :1]), r"1, 8, 1, 16"),
    "fwd-n-mismatch": (lambda: fwd_case(k=k0[:, :4], v=v0[:, :4]), r"1, 4, 2, 16"),
    "fwd-d-mismatch": (lambda: fwd_case(k=k0[..., :8], v=v0[..., :8]), r"1, 8, 2, 8"),
    "fwd-heads-not-multiple": (lambda: fwd_case(q=torch.randn(B, N, 3, D)), r"query heads \(3\)"),
    "fwd-no-kv-heads": (lambda: fwd_case(k=k0[:, :, :0], v=v0[:, :, :0]), r"key/value heads \(0\)"),
    "fwd-head-dim-257": (lambda: fwd_case(*(torch.randn(B, N, h, 257) for h in (HQ, HKV, HKV))), r"got 257"),
    "fwd-head-dim-0": (lambda: fwd_case(*(torch.randn(B, N, h, 0) for h in (HQ, HKV, HKV))), r"got 0$"),
    "fwd-scale-1e39": (lambda: fwd_case(scale=1e39), r"got 1e\+39"),
    "fwd-scale-nan": (lambda: fwd_case(scale=float("nan")), r"got nan"),
    "fwd-scale-minus-inf": (lambda: fwd_case(scale=float("-inf")), r"got -inf"),
    "fwd-scale-f64-limit": (lambda: fwd_case(*qkv(torch.float64), scale=1e308), r"got 1e\+308"),
    "fwd-scale-f64-large-ok": (lambda: fwd_case(*qkv(torch.float64), scale=1e300), None),
    "fwd-scale-bf16": (lambda: fwd_case(*qkv(torch.bfloat16), scale=-3e38), r"got -3e\+38"),
    "fwd-no-branch": (lambda: fwd_case(segs=(), rates=()), r"segment_lengths must not be empty"),
    "fwd-branch-count": (lambda: fwd_case(segs=(4, 8), rates=(1,)), r"\[4, 8\]"),
    "fwd-17-branches": (lambda: fwd_case(segs=(4,) * 17, rates=(1,) * 17), r"got 17"),
    "fwd-w-0": (lambda: fwd_case(segs=(4, 0), rates=(1, 1)), r"segment_lengths\[1\] must be >= 1, got 0"),
    "fwd-r-0": (lambda: fwd_case(segs=(4,), rates=(0,)), r"dilation_rates\[0\] must be >= 1, got 0"),
    "fwd-r-above-w": (lambda: fwd_case(segs=(4,), rates=(5,)), r"dilation_rates\[0\] = 5"),
    "fwd-w-above-2-40": (
        lambda: fwd_case(segs=(2**41,), rates=(1,)),
        r"segment_lengths\[0\] = 2199023255552",
    ),
    "fwd-dropout-negative": (lambda: fwd_case(dropout_p=-0.1), r"got -0\.1"),
    "fwd-dropout-one": (lambda: fwd_case(dropout_p=1.0), r"got 1(\.0)?$"),
    "fwd-dropout-nan": (lambda: fwd_case(dropout_p=float("nan")), r"got nan"),
    # bwd: check_inputs, then check_backward_inputs, then dropout_params
    "bwd-valid": (lambda: bwd_case(), None),
    "bwd-scale-before-backward-checks": (lambda: bwd_case(scale=1e39, lse=torch.zeros(1)), r"got 1e\+39"),
    "bwd-dout-shape": (lambda: bwd_case(dout=torch.zeros(B, N, HQ, 8)), r"got .1, 8, 4, 8"),
    "bwd-out-shape": (lambda: bwd_case(out=torch.zeros(B, N - 1, HQ, D)), r"got .1, 7, 4, 16"),
    "bwd-dout-dtype": (lambda: bwd_case(dout=torch.zeros(B, N, HQ, D, dtype=torch.float64)), r"float64"),
    "bwd-lse-shape": (lambda: bwd_case(lse=torch.zeros(B, N, HQ)), r"got .1, 8, 4\W"),
    "bwd-lse-dtype": (
        lambda: bwd_case(lse=torch.zeros(B, HQ, N, dtype=torch.float16)),
        r"got (torch\.)?float16",
    ),
    "bwd-lse-float64-ok": (lambda: bwd_case(lse=torch.zeros(B, HQ, N, dtype=torch.float64)), None),
    "bwd-dlse-shape": (lambda: bwd_case(dlse=torch.zeros(B, HQ, N + 1)), r"got .1, 4, 9"),
    "bwd-dropout": (lambda: bwd_case(dropout_p=2.0), r"got 2(\.0)?$"),
    # varlen_fwd: check_varlen_inputs (not cu_seqlens' values), then check_inputs on the views
    "varlen-valid": (lambda: varlen_case(), None),
    "varlen-q-4d": (lambda: varlen_case(q=q0), r"1, 8, 4, 16"),
    "varlen-v-2d": (lambda: varlen_case(v=v0[0, :, 0]), r"\W8, 16\W"),
    "varlen-cu-int64": (lambda: varlen_case(cu=torch.tensor([0, N])), r"got (torch\.)?int64"),
    "varlen-cu-2d": (lambda: varlen_case(cu=torch.tensor([[0, N]], dtype=torch.int32)), r"1, 2"),
    "varlen-cu-empty": (lambda: varlen_case(cu=torch.zeros(0, dtype=torch.int32)), r"got shape .0,?\W"),
    "varlen-max-seqlen": (lambda: varlen_case(max_seqlen=-1), r"got -1"),
    "varlen-head-dim": (lambda: varlen_case(*(torch.randn(N, h, 300) for h in (HQ, HKV, HKV))), r"got 300"),
    "varlen-kv-rows": (lambda: varlen_case(k=k0[0, :3], v=v0[0, :3]), r"1, 3, 2, 16"),
    "varlen-scale": (lambda: varlen_case(scale=float("inf")), r"got inf"),
    "varlen-branches": (lambda: varlen_case(segs=(4,), rates=(8,)), r"dilation_rates\[0\] = 8"),
    "varlen-dropout": (lambda: varlen_case(dropout_p=1.5), r"got 1\.5"),
    # varlen_bwd
    "varlen-bwd-valid": (lambda: varlen_bwd_case(), None),
    "varlen-bwd-dout-2d": (lambda: varlen_bwd_case(dout=torch.zeros(N, HQ)), r"\W8, 4\W"),
    "varlen-bwd-lse-shape": (lambda: varlen_bwd_case(lse=torch.zeros(N, HQ)), r"got .(1, )?8, 4\W"),
    "varlen-bwd-dlse-shape": (lambda: varlen_bwd_case(dlse=torch.zeros(HQ, N - 1)), r"got .(1, )?4, 7\W"),
    "varlen-bwd-out-shape": (lambda: varlen_bwd_case(out=torch.zeros(N, HQ, D + 1)), r"8, 4, 17"),
    "varlen-bwd-lse-dtype": (
        lambda: varlen_bwd_case(lse=torch.zeros(HQ, N, dtype=torch.bfloat16)),
        r"got (torch\.)?bfloat16",
    ),
    # pieces
    "piece-valid": (lambda: piece_case(), None),
    "piece-q-3d": (lambda: piece_case(q=q0[0]), r"8, 4, 16"),
    "piece-k-2d": (lambda: piece_case(k=k0[0, 0]), r"\W2, 16\W"),
    "piece-kv-shapes": (lambda: piece_case(v=v0[:, :4]), r"1, 4, 2, 16"),
    "piece-dtype": (lambda: piece_case(k=k0[:, :5].bfloat16(), v=v0[:, :5].bfloat16()), r"bfloat16"),
    "piece-int": (lambda: piece_case(*(t.long() for t in qkv())), r"int64"),
    "piece-batch": (lambda: piece_case(q=torch.randn(2, N, HQ, D)), r"2, 8, 4, 16"),
    "piece-heads": (lambda: piece_case(q=torch.randn(B, N, 5, D)), r"query heads \(5\)"),
    "piece-head-dim": (lambda: piece_case(*(torch.randn(B, N, h, 512) for h in (HQ, HKV, HKV))), r"got 512"),
    "piece-scale": (lambda: piece_case(scale=-1e39), r"got -1e\+39"),
    "piece-bwd-valid": (lambda: piece_bwd_case(), None),
    "piece-bwd-lse-shape": (lambda: piece_bwd_case(lse=torch.zeros(B, HQ, N + 2)), r"got .1, 4, 10"),
    "piece-bwd-dout-shape": (lambda: piece_bwd_case(dout=torch.zeros(B, N, HQ, 2)), r"got .1, 8, 4, 2"),
    # decode_step: check_decode_step (not the positions' values)
    "decode-valid": (lambda: decode_case(), None),
    "decode-q-2d": (lambda: decode_case(q=torch.zeros(2, HQ)), r"\W2, 4\W"),
    "decode-cache-3d": (lambda: decode_case(kc=torch.zeros(2, HKV, D)), r"2, 2, 16"),
    "decode-cache-shapes": (lambda: decode_case(vc=torch.zeros(2, HKV, 1, D)), r"2, 2, 1, 16"),
    "decode-heads": (lambda: decode_case(q=torch.zeros(2, 5, D)), r"2, 5, 16|heads \(5\)"),
    "decode-batch": (lambda: decode_case(k=torch.zeros(3, HKV, D)), r"3, 2, 16"),
    "decode-int": (lambda: decode_case(q=torch.zeros(2, HQ, D, dtype=torch.int32)), r"int32"),
    "decode-dtype": (lambda: decode_case(v=torch.zeros(2, HKV, D, dtype=torch.float64)), r"float64"),
    "decode-cache-not-contiguous": (
        lambda: decode_case(kc=torch.zeros(2, 24, HKV, D).transpose(1, 2)),
        r"768, 16, 32, 1",
    ),
    "decode-pos-dtype": (lambda: decode_case(pos=torch.tensor([3, 9], dtype=torch.int32)), r"int32"),
    "decode-pos-shape": (lambda: decode_case(pos=torch.tensor([3])), r"\W1,?\W"),
    "decode-branch-lists": (
        lambda: decode_case(segs=(8,), rates=(1,)),
        r"[\[(]8,?[\])]",
    ),
    "decode-branch": (lambda: decode_case(rates=(1, 64)), r"r=64"),
    "decode-slots": (lambda: decode_case(slots=(8, 9)), r"slots=9"),
    "decode-cache-size": (lambda: decode_case(slots=(7, 8)), r"got 24"),
    "decode-scale-nan": (lambda: decode_case(scale=float("nan")), r"got nan"),
    "decode-scale-1e39": (lambda: decode_case(scale=1e39), r"got 1e\+39"),
    "decode-head-dim-300": (
        lambda: decode_case(
            **_HEAD_DIM_300, kc=torch.zeros(2, HKV, 40, 300), vc=torch.zeros(2, HKV, 40, 300)
        ),
        r"got 300",
    ),
    "decode-head-dim-0": (
        lambda: decode_case(**_HEAD_DIM_0, kc=torch.zeros(2, HKV, 40, 0), vc=torch.zeros(2, HKV, 40, 0)),
        r"got 0$",
    ),
    # dropout_mask: its sizes and dropout_p
    "dropout-mask-valid": (lambda: dropout_mask_case(), None),
    "dropout-mask-negative-size": (lambda: dropout_mask_case(Nq=-3), r"Nq=-3"),
    "dropout-mask-p": (lambda: dropout_mask_case(dropout_p=1.0), r"got 1(\.0)?$"),
}


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """("ok", output shapes) or (exception type, message)."""
    try:
        result = fn()
    except Exception as e:  # the type is what is compared
        return type(e).__name__, str(e)
    shapes = [tuple(int(s) for s in t.shape) for t in (result if isinstance(result, tuple) else (result,))]
    return "ok", repr(shapes)


def _map_tensors(args: tuple[Any, ...], f: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, ...]:
    return tuple(f(a) if isinstance(a, torch.Tensor) else a for a in args)


def _fake_call(op: Any, args: tuple[Any, ...]) -> Any:
    with FakeTensorMode() as mode:
        fake = _map_tensors(args, mode.from_tensor)
        return op(*fake)


def _meta_call(op: Any, args: tuple[Any, ...]) -> Any:
    return op(*_map_tensors(args, lambda t: t.to("meta")))


def _names(value: str | None, outcome: tuple[str, str], where: str) -> None:
    if value is None:
        assert outcome[0] == "ok", f"{where}: {outcome}"
    else:
        assert re.search(value, outcome[1]), f"{where}: {outcome} does not name the value /{value}/"


@pytest.mark.parametrize("name", list(CASES))
def test_fake_and_meta_kernels_refuse_what_the_cpu_kernels_refuse(name):
    call, value = CASES[name]
    op, args = call()
    if op is ops.decode_step and not has_decode_kernel("cpu"):
        pytest.skip("the extension has no decode_step kernel")
    real = _outcome(lambda: op(*_map_tensors(args, torch.clone)))
    fake = _outcome(lambda: _fake_call(op, args))
    meta = _outcome(lambda: _meta_call(op, args))
    _names(value, real, "CPU kernel")
    assert real[0] in ("ok", "RuntimeError", "ValueError"), real
    for where, got in (("fake kernel", fake), ("meta kernel", meta)):
        assert got[0] == real[0], f"{where}: {got}\nCPU kernel:  {real}"
        _names(value, got, where)
        if value is None:
            assert got == real, f"{where}: {got}\nCPU kernel:  {real}"


def test_every_check_is_reached():
    """The cases reach distinct checks of the C++ op: one message per bad case, except where a case
    checks the order of two checks (bwd-scale-before-backward-checks) and dropout_mask's dropout_p,
    the rule of every op's."""
    calls = [call() for call, value in CASES.values() if value is not None]
    messages = [_outcome(lambda op=op, args=args: op(*args))[1] for op, args in calls]
    assert len(set(messages)) >= len(messages) - 2


# The public API's counterparts of the raw calls: the same inputs, with the arguments the API takes.
def _api_fixed(q, k, v, segs, rates, causal, scale, _float64_lse, dropout_p):
    return dilated_attention(q, k, v, segs, rates, softmax_scale=scale, dropout_p=dropout_p)


def _api_varlen(q, k, v, cu, max_seqlen, segs, rates, causal, scale, _float64_lse, dropout_p):
    return dilated_attention_varlen(
        q, k, v, cu, max_seqlen, segs, rates, softmax_scale=scale, dropout_p=dropout_p
    )


# What only the op refuses: the API brings a segment length above 2^40 down to an equivalent one.
_OP_ONLY = {"fwd-w-above-2-40"}


@pytest.mark.parametrize(
    "name", [n for n in CASES if n.startswith(("fwd-", "varlen-")) and not n.startswith("varlen-bwd")]
)
def test_public_api_refuses_the_same_inputs_with_a_value_error(name):
    """The Python API checks with the same rules before any backend runs: a ValueError naming the
    value (the raw op raises RuntimeError for the same shapes: TORCH_CHECK)."""
    call, value = CASES[name]
    op, args = call()
    api = _api_fixed if op is ops.fwd else _api_varlen
    got = _outcome(lambda: api(*args))
    if value is None or name in _OP_ONLY:
        assert got[0] == "ok", got
    else:
        assert got[0] == "ValueError", got
        _names(value, got, "API")


def test_fake_checks_keep_the_sequence_length_symbolic():
    """A raw op call compiled with dynamic shapes runs at other sequence lengths without a
    recompile: the fake kernels' checks do not specialise N."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v, cu):
        out, _ = ops.fwd(q, k, v, [4, 8], [1, 2], True, 0.25)
        packed, _ = ops.varlen_fwd(q[0], k[0], v[0], cu, 64, [4], [1], False, 0.25)
        return out.sum() + packed.sum()

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for n in (12, 20, 33):
        q, k, v = (torch.randn(1, n, h, D) for h in (HQ, HKV, HKV))
        cu = torch.tensor([0, 5, n], dtype=torch.int32)
        assert torch.isfinite(compiled(q, k, v, cu))
    assert counter.frame_count == 1
    torch._dynamo.reset()


def _fake_cuda(shape: tuple[int, ...], mode: FakeTensorMode, dtype=torch.bfloat16) -> torch.Tensor:
    return FakeTensor(mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device("cuda", 0))


@pytest.mark.parametrize(
    "shape,want",
    [
        ((65536, 4, 2, 64), "on CUDA the batch size must be at most 65535, got 65536"),
        ((1, 4, 32768, 64), "on CUDA the number of heads must be at most 32767, got 32768"),
        ((1, 2**30, 2, 64), "on CUDA the sequence length must be below 2^30, got 1073741824"),
    ],
)
def test_fake_kernels_apply_the_cuda_limits_to_cuda_tensors(shape, want):
    """The limits of the CUDA entries (csrc/cuda/dilated_attention_cuda.cpp check_sizes) hold for
    fake CUDA tensors too, so that a graph traced for the GPU is refused while tracing."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    q = _fake_cuda(shape, mode)
    with mode, pytest.raises(RuntimeError, match=re.escape(want)):
        ops.fwd(q, q, q, [4], [1], False, 0.125)
    # the same shape on a CPU fake tensor is not refused (the CPU kernels have no such limit)
    with FakeTensorMode() as cpu_mode:
        qc = cpu_mode.from_tensor(torch.empty(shape, dtype=torch.bfloat16, device="meta")).to("cpu")
        out, _ = ops.fwd(qc, qc, qc, [4], [1], False, 0.125)
    assert tuple(out.shape) == shape


def test_compile_refuses_a_bad_raw_call_while_tracing():
    """torch.compile of a raw-op call with a head dim the kernels refuse fails while tracing, with
    the kernels' message."""
    calls = []

    def f(q, k, v):
        calls.append(1)
        return ops.fwd(q, k, v, [4], [1], False, 0.125)

    q, k, v = (torch.randn(B, N, h, 257) for h in (HQ, HKV, HKV))
    with pytest.raises(Exception, match=r"head dim must be in \[1, 256\], got 257"):
        torch.compile(f, backend="eager", fullgraph=True)(q, k, v)


def test_export_refuses_a_scale_the_scores_cannot_hold():
    """torch.export of the raw op with softmax_scale 1e39 fails while exporting."""

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return ops.fwd(q, k, v, [4], [1], False, 1e39)

    with pytest.raises(Exception, match=r"softmax_scale must be finite in the compute dtype float32"):
        torch.export.export(M(), qkv())
