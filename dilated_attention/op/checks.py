"""The argument checks of the op's C++ entries (``csrc/checks.h``), run by its fake kernels.

Under ``FakeTensorMode``, ``torch.compile``, ``torch.export`` and on meta tensors the op runs its
fake kernels, not the C++ ones. Without these checks a call that the kernels refuse (a head dim of
257, ``softmax_scale=1e39``, mismatched shapes) would trace into a graph that fails only when it
runs. Each check here raises what the C++ check raises: the same exception type and the same
message, in the same order (``tests/op/test_op_checks.py`` holds them to that on every case).

What the fake kernels cannot check stays with the kernels: the values of ``cu_seqlens`` and of a
decode step's positions (data), and the device of the tensors (a meta tensor is on no device).
Shapes may be symbolic: every check goes through ``torch._check`` / ``torch._check_value``, which
record a symbolic condition instead of failing on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Grads", "check_fixed", "check_piece", "check_varlen"]

DA_MAX_BRANCHES = 16  # csrc/dilated_attention.h
DA_MAX_HEAD_DIM = 256
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _require(cond: Any, message: str) -> None:
    """RuntimeError(message) unless cond (TORCH_CHECK)."""
    torch._check(cond, lambda: message)


def _require_value(cond: Any, message: str) -> None:
    """ValueError(message) unless cond (TORCH_CHECK_VALUE)."""
    torch._check_value(cond, lambda: message)


def _shape(t: torch.Tensor | Sequence[Any]) -> str:
    """Sizes as C++ prints an IntArrayRef: ``[2, 8, 4, 32]``."""
    sizes = t.shape if isinstance(t, torch.Tensor) else t
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def _dtype(dtype: torch.dtype) -> str:
    """A dtype as Python names it, as checks.h's dtype_name does: ``float32``."""
    return str(dtype).removeprefix("torch.")


def _device(t: torch.Tensor) -> str:
    return str(t.device)


def _num(x: float) -> str:
    """A double as a C++ stream prints it (six significant digits, %g)."""
    return f"{x:g}"


def _all(*conds: Any) -> Any:
    """The conjunction of conditions, plain bools or symbolic ones (SymBool); False at the first
    plain False."""
    out: Any = True
    for c in conds:
        if c is False:
            return False
        out = c if out is True else out & c
    return out


def _shape_is(t: torch.Tensor, sizes: Sequence[Any]) -> Any:
    """Whether t has these sizes (a symbolic condition for symbolic sizes)."""
    if t.dim() != len(sizes):
        return False
    return _all(*(x == y for x, y in zip(t.shape, sizes, strict=True)))


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> Any:
    return _shape_is(a, tuple(b.shape))


def _check_same(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    _require(
        a.dtype == b.dtype,
        f"dilated_attention: {a_name} and {b_name} must have the same dtype, got "
        f"{_dtype(a.dtype)} and {_dtype(b.dtype)}",
    )
    _require(
        a.device == b.device,
        f"dilated_attention: {a_name} and {b_name} must be on the same device, got "
        f"{_device(a)} and {_device(b)}",
    )


def _check_dtype(q: torch.Tensor, who: str) -> None:
    _require(
        q.dtype in _FLOATS,
        f"{who}: q, k, v must be float16, bfloat16, float32 or float64, got {_dtype(q.dtype)}",
    )


def _check_scale(softmax_scale: float, dtype: torch.dtype, who: str) -> None:
    f64 = dtype == torch.float64
    limit = (torch.finfo(torch.float64 if f64 else torch.float32).max) / 2
    finite = softmax_scale == softmax_scale and abs(softmax_scale) <= limit
    _require_value(
        finite,
        f"{who}: softmax_scale must be finite in the compute dtype {'float64' if f64 else 'float32'} "
        f"of {_dtype(dtype)} inputs (|softmax_scale| <= {_num(limit)}), got {_num(softmax_scale)}",
    )


def _check_problem(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, who: str) -> None:
    """make_problem: the heads, the head dim and the softmax scale."""
    Hq, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
    _require(
        Hkv >= 1 and Hq >= 1 and Hq % Hkv == 0,
        f"{who}: the number of query heads ({Hq}) must be a positive multiple of the number of "
        f"key/value heads ({Hkv})",
    )
    _require(
        _all(D >= 1, D <= DA_MAX_HEAD_DIM),
        f"{who}: head dim must be in [1, {DA_MAX_HEAD_DIM}], got {D}",
    )
    _check_scale(softmax_scale, q.dtype, who)


def _check_branches(segment_lengths: Sequence[int], dilation_rates: Sequence[int]) -> None:
    segs, rates = list(segment_lengths), list(dilation_rates)
    _require(len(segs) >= 1, "dilated_attention: segment_lengths must not be empty")
    _require(
        len(segs) == len(rates),
        "dilated_attention: segment_lengths and dilation_rates must have the same length, got "
        f"{len(segs)} segment lengths {_shape(segs)} and {len(rates)} dilation rates {_shape(rates)}",
    )
    _require(
        len(segs) <= DA_MAX_BRANCHES,
        f"dilated_attention: at most {DA_MAX_BRANCHES} branches are supported, got {len(segs)}",
    )
    for i, (w, r) in enumerate(zip(segs, rates, strict=True)):
        _require(w >= 1, f"dilated_attention: segment_lengths[{i}] must be >= 1, got {w}")
        _require(r >= 1, f"dilated_attention: dilation_rates[{i}] must be >= 1, got {r}")
        _require(
            r <= w,
            f"dilated_attention: dilation_rates[{i}] = {r} must not exceed segment_lengths[{i}] = {w}",
        )
        _require(
            w <= (1 << 40),
            f"dilated_attention: segment_lengths[{i}] = {w} exceeds 2^40; use an equivalent "
            "w = max(N, r) (the whole sequence is one segment)",
        )


def _check_cuda_rows(q: torch.Tensor, n: Any, what: str, symbol: str) -> None:
    """check_rows of csrc/cuda/dilated_attention_cuda.cpp (CUDA tensors only)."""
    if q.device.type == "cuda":
        _require(
            n <= (2**31 - 1) // 2,
            f"dilated_attention: on CUDA {what} must be below 2^30, got {symbol} = {n}",
        )


def _check_cuda_grid(q: torch.Tensor) -> None:
    """check_grid of csrc/cuda/dilated_attention_cuda.cpp (CUDA tensors only)."""
    if q.device.type == "cuda":
        B, Hq = q.shape[0], q.shape[2]
        _require(B <= 65535, f"dilated_attention: on CUDA the batch size must be at most 65535, got {B}")
        _require(
            Hq <= 32767,
            f"dilated_attention: on CUDA the number of heads must be at most 32767, got {Hq}",
        )


def _check_cuda_sizes(q: torch.Tensor) -> None:
    """check_sizes of csrc/cuda/dilated_attention_cuda.cpp: q (B, N, Hq, D) on CUDA."""
    _check_cuda_rows(q, q.shape[1], "the sequence length", "N")
    _check_cuda_grid(q)


def _check_dropout_p(dropout_p: float) -> None:
    """dropout_params: dropout_p in [0, 1) (ValueError)."""
    _require_value(
        0 <= dropout_p < 1, f"dilated_attention: dropout_p must be in [0, 1), got {_num(dropout_p)}"
    )


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    softmax_scale: float,
) -> None:
    """check_inputs: q (B, N, Hq, D), k and v (B, N, Hkv, D), the branches and the scale."""
    for name, t, layout in (
        ("q", q, "(B, N, Hq, D)"),
        ("k", k, "(B, N, Hkv, D)"),
        ("v", v, "(B, N, Hkv, D)"),
    ):
        _require(t.dim() == 4, f"dilated_attention: {name} must be 4-D {layout}, got shape {_shape(t)}")
    _check_same(q, "q", k, "k")
    _check_same(q, "q", v, "v")
    _check_dtype(q, "dilated_attention")
    _require(
        _same_shape(k, v),
        f"dilated_attention: k and v must have the same shape, got {_shape(k)} and {_shape(v)}",
    )
    _require(
        _all(q.shape[0] == k.shape[0], q.shape[1] == k.shape[1], q.shape[3] == k.shape[3]),
        "dilated_attention: q (B, N, Hq, D) and k (B, N, Hkv, D) must agree in B, N and D, got q "
        f"{_shape(q)} and k {_shape(k)}",
    )
    _check_problem(q, k, softmax_scale, "dilated_attention")
    _check_branches(segment_lengths, dilation_rates)


def _check_backward_inputs(
    q: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None
) -> None:
    """check_backward_inputs: dout and out of q's shape, lse (B, Hq, N), dlse of lse's shape."""
    _require(
        _same_shape(dout, q),
        f"dilated_attention backward: dout must have q's shape {_shape(q)}, got {_shape(dout)}",
    )
    _require(
        _same_shape(out, q),
        f"dilated_attention backward: out must have q's shape {_shape(q)}, got {_shape(out)}",
    )
    _check_same(q, "q", dout, "dout")
    _check_same(q, "q", out, "out")
    want = (q.shape[0], q.shape[2], q.shape[1])
    _require(
        _shape_is(lse, want),
        f"dilated_attention backward: lse must have shape (B, Hq, N) = {_shape(want)}, got {_shape(lse)}",
    )
    accumulate = torch.float64 if q.dtype == torch.float64 else torch.float32
    _require(
        lse.dtype in (accumulate, torch.float64),
        f"dilated_attention backward: lse must be {_dtype(accumulate)} or float64, got {_dtype(lse.dtype)}",
    )
    _require(
        lse.device == q.device,
        f"dilated_attention backward: lse must be on {_device(q)}, got {_device(lse)}",
    )
    if dlse is not None:
        _require(
            _same_shape(dlse, lse),
            f"dilated_attention backward: dlse must have shape {_shape(lse)}, got {_shape(dlse)}",
        )
        _require(
            dlse.device == q.device,
            f"dilated_attention backward: dlse must be on {_device(q)}, got {_device(dlse)}",
        )


def _check_varlen_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    softmax_scale: float,
) -> None:
    """check_varlen_inputs: q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,) on q's
    device, max_seqlen >= 0; then check_inputs on the (1, T, H, D) views. Not the values of
    cu_seqlens (data: the kernels check them)."""
    for name, t, layout in (("q", q, "(T, Hq, D)"), ("k", k, "(T, Hkv, D)"), ("v", v, "(T, Hkv, D)")):
        _require(
            t.dim() == 3,
            f"dilated_attention varlen: {name} must be 3-D {layout}, got shape {_shape(t)}",
        )
    _require(
        cu_seqlens.dtype == torch.int32,
        f"dilated_attention varlen: cu_seqlens must be int32, got {_dtype(cu_seqlens.dtype)}",
    )
    _require(
        cu_seqlens.dim() == 1 and cu_seqlens.shape[0] >= 1,
        f"dilated_attention varlen: cu_seqlens must be 1-D of shape (S + 1,), got shape {_shape(cu_seqlens)}",
    )
    _require(
        cu_seqlens.device == q.device,
        f"dilated_attention varlen: cu_seqlens must be on q's device {_device(q)}, got {_device(cu_seqlens)}",
    )
    _require(max_seqlen >= 0, f"dilated_attention varlen: max_seqlen must be >= 0, got {max_seqlen}")
    T = q.shape[0]
    _require(T <= 2**31 - 1, f"dilated_attention varlen: T must fit in int32 (cu_seqlens), got {T}")
    _check_inputs(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), segment_lengths, dilation_rates, softmax_scale
    )


def _check_varlen_backward_inputs(
    q: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None
) -> None:
    """check_varlen_backward_inputs: dout and out (T, Hq, D), lse and dlse (Hq, T); then
    check_backward_inputs on the (1, ...) views."""
    _require(
        dout.dim() == 3 and out.dim() == 3,
        "dilated_attention varlen backward: dout and out must be 3-D (T, Hq, D), got shapes "
        f"{_shape(dout)} and {_shape(out)}",
    )
    want = (q.shape[1], q.shape[0])
    _require(
        _shape_is(lse, want),
        f"dilated_attention varlen backward: lse must have shape (Hq, T) = {_shape(want)}, got {_shape(lse)}",
    )
    if dlse is not None:
        _require(
            _same_shape(dlse, lse),
            f"dilated_attention varlen backward: dlse must have shape {_shape(lse)}, got {_shape(dlse)}",
        )
    _check_backward_inputs(
        q.unsqueeze(0),
        dout.unsqueeze(0),
        out.unsqueeze(0),
        lse.unsqueeze(0),
        None if dlse is None else dlse.unsqueeze(0),
    )


def _check_piece_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> None:
    """check_piece_inputs: q (B, nq, Hq, D), k and v (B, nk, Hkv, D); on CUDA also the limits of
    the CUDA entries (check_piece_cuda)."""
    who = "dilated_attention piece"
    _require(q.dim() == 4, f"{who}: q must be 4-D (B, nq, Hq, D), got shape {_shape(q)}")
    _require(k.dim() == 4, f"{who}: k must be 4-D (B, nk, Hkv, D), got shape {_shape(k)}")
    _require(_same_shape(k, v), f"{who}: k and v must have the same shape, got {_shape(k)} and {_shape(v)}")
    _check_same(q, "q", k, "k")
    _check_same(q, "q", v, "v")
    _check_dtype(q, who)
    _require(
        _all(q.shape[0] == k.shape[0], q.shape[3] == k.shape[3]),
        f"{who}: q (B, nq, Hq, D) and k (B, nk, Hkv, D) must agree in B and D, got q {_shape(q)} and "
        f"k {_shape(k)}",
    )
    _check_problem(q, k, softmax_scale, who)
    _check_cuda_rows(q, q.shape[1], "the number of queries of a piece", "nq")
    _check_cuda_rows(q, k.shape[1], "the number of keys of a piece", "nk")
    _check_cuda_grid(q)


# What a backward call adds to its forward's arguments: dout, out, lse, dlse (or None).
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def check_fixed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    softmax_scale: float,
    dropout_p: float,
    grads: Grads | None = None,
) -> None:
    """The checks of ``fwd``, or with ``grads`` of ``bwd``, in the order of their C++ entries."""
    _check_inputs(q, k, v, segment_lengths, dilation_rates, softmax_scale)
    if grads is not None:
        _check_backward_inputs(q, *grads)
    _check_dropout_p(dropout_p)
    _check_cuda_sizes(q)


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    softmax_scale: float,
    dropout_p: float,
    grads: Grads | None = None,
) -> None:
    """The checks of ``varlen_fwd``, or with ``grads`` of ``varlen_bwd``, in the order of their C++
    entries (not cu_seqlens' values)."""
    _check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, softmax_scale)
    if grads is not None:
        _check_varlen_backward_inputs(q, *grads)
    _check_dropout_p(dropout_p)
    _check_cuda_sizes(q.unsqueeze(0))


def check_piece(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, grads: Grads | None = None
) -> None:
    """The checks of ``piece_fwd``, or with ``grads`` of ``piece_bwd``."""
    _check_piece_inputs(q, k, v, softmax_scale)
    if grads is not None:
        _check_backward_inputs(q, *grads)
