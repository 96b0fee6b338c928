"""Argument checks of the Python API, and the dtype rules they and the ops share. Every error names
the value it got and what it expected.

Each rule is stated once, here, and serves two callers: the Python API, which raises ``ValueError``
(``TypeError`` for what is not a tensor), and the op's fake kernels (:mod:`.op.checks`), which pass
``error=RuntimeError`` where the C++ op's ``TORCH_CHECK`` raises that. Sizes may be symbolic
(torch.compile, torch.export): :func:`require` records a symbolic condition in a fake kernel as
``torch._check`` does, and lets Dynamo guard on it where Dynamo traces the API."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

MAX_HEAD_DIM = 256
MAX_BRANCHES = 16
_HUGE_SEGMENT = 2**40  # above any sequence length; below it, index arithmetic cannot overflow int64
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


Error = type[Exception]


def require(cond: Any, error: Error, message: Callable[..., str]) -> None:
    """``error(message())`` unless ``cond``. A symbolic ``cond`` (a SymBool of symbolic sizes) is
    recorded as ``torch._check_with`` records it (a fake kernel under torch.compile or torch.export
    then fails while tracing, or at run time for a size known only then); where Dynamo traces the
    caller it guards on ``cond`` as on any ``if``."""
    if isinstance(cond, torch.SymBool) and not torch.compiler.is_dynamo_compiling():
        torch._check_with(error, cond, message)
    elif not cond:
        raise error(message())


def require_shape(t: torch.Tensor, sizes: Sequence[Any], error: Error, message: Callable[..., str]) -> None:
    """``t`` has exactly ``sizes``: its rank, then each size (a symbolic condition per size, where
    comparing whole shapes would guard on every one)."""
    require(t.dim() == len(sizes), error, message)
    for have, want in zip(t.shape, sizes, strict=True):
        require(have == want, error, message)


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if (
            isinstance(value, torch.Tensor)
            and value.numel() == 1
            and not value.is_floating_point()
            and value.dtype != torch.bool
        ):
            return int(value.item())
        raise ValueError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def normalize_branches(segment_lengths: Any, dilation_rates: Any) -> tuple[list[int], list[int]]:
    """Return ``(segment_lengths, dilation_rates)`` as equal-length lists of checked ints.

    A single int is taken as one branch. Requires ``w >= 1`` and ``1 <= r <= w``.
    """

    def as_list(x: Any, name: str) -> list[int]:
        if isinstance(x, (str, bytes)) or x is None:
            raise ValueError(f"{name} must be a sequence of integers, got {x!r}")
        if isinstance(x, (AbstractSet, Mapping)):
            raise ValueError(
                f"{name} must be a sequence of integers (a list or tuple), got a {type(x).__name__}, "
                f"{x!r}: it has no order by which to pair segment lengths with dilation rates"
            )
        if isinstance(x, numbers.Integral) and not isinstance(x, bool):
            x = [x]
        try:
            items = list(x)
        except TypeError:
            raise ValueError(f"{name} must be a sequence of integers, got {x!r}") from None
        return [_as_int(v, f"{name}[{i}]") for i, v in enumerate(items)]

    segs = as_list(segment_lengths, "segment_lengths")
    rates = as_list(dilation_rates, "dilation_rates")
    check_branches(segs, rates)
    return segs, rates


def check_branches(segs: list[Any], rates: list[Any], error: Error = ValueError) -> None:
    """The branches' rules: at least one and at most :data:`MAX_BRANCHES`, as many rates as
    segment lengths, ``w >= 1`` and ``1 <= r <= w``."""
    require(len(segs) >= 1, error, lambda: f"segment_lengths must not be empty, got {segs!r}")
    require(
        len(segs) == len(rates),
        error,
        lambda: (
            f"segment_lengths and dilation_rates must have the same length, got {segs} ({len(segs)}) "
            f"and {rates} ({len(rates)})"
        ),
    )
    require(
        len(segs) <= MAX_BRANCHES,
        error,
        lambda: f"at most {MAX_BRANCHES} branches are supported, got {len(segs)}",
    )
    for i, (w, r) in enumerate(zip(segs, rates, strict=True)):
        require(
            w >= 1,
            error,
            lambda i=i, w=w: f"segment_lengths[{i}] must be >= 1, got {w} (segment_lengths={segs})",
        )
        require(
            r >= 1,
            error,
            lambda i=i, r=r: f"dilation_rates[{i}] must be >= 1, got {r} (dilation_rates={rates})",
        )
        require(
            r <= w,
            error,
            lambda i=i, w=w, r=r: (
                f"dilation_rates[{i}] = {r} must not exceed segment_lengths[{i}] = {w} "
                f"(segment_lengths={segs}, dilation_rates={rates})"
            ),
        )


_RAGGED_HINT = "for sequences of different lengths use dilated_attention_varlen or key_padding_mask"


def check_tensor(t: Any, name: str, ragged_hint: str = _RAGGED_HINT) -> None:
    """``t`` is a dense (strided) tensor (``TypeError``); ``ragged_hint`` ends the error for a
    nested one: what the caller takes for sequences of different lengths."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise TypeError(f"{name} must be a dense (strided) tensor, got {kind}; {ragged_hint}")


def check_rank(t: torch.Tensor, name: str, layout: str, error: Error = ValueError) -> None:
    """``t`` has as many dimensions as ``layout`` names, e.g. ``"(B, N, H, D)"``."""
    dims = layout.count(",") + 1
    require(t.dim() == dims, error, lambda: f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")


def check_float(t: torch.Tensor, name: str, error: Error = ValueError) -> None:
    """``t`` has one of the dtypes the kernels take, :data:`FLOAT_DTYPES`."""
    require(
        t.dtype in FLOAT_DTYPES,
        error,
        lambda: f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}",
    )


def check_like_q(q: torch.Tensor, t: torch.Tensor, name: str, error: Error = ValueError) -> None:
    """``t`` has q's dtype and is on q's device."""
    require(
        t.dtype == q.dtype,
        error,
        lambda: f"q and {name} must have the same dtype, got {q.dtype} and {t.dtype}",
    )
    require(
        t.device == q.device,
        error,
        lambda: f"q and {name} must be on the same device, got {q.device} and {t.device}",
    )


def check_heads(Hq: Any, Hkv: Any, D: Any, error: Error = ValueError) -> None:
    """Hq query heads, a positive multiple of the Hkv key/value heads, of head dim D in
    ``[1, MAX_HEAD_DIM]``."""

    def heads() -> str:
        return (
            f"the number of query heads ({Hq}) must be a positive multiple of the number of key/value "
            f"heads ({Hkv})"
        )

    require(Hq >= 1, error, heads)
    require(Hkv >= 1, error, heads)
    require(Hq % Hkv == 0, error, heads)
    for cond in (D >= 1, D <= MAX_HEAD_DIM):
        require(cond, error, lambda: f"head dim must be in [1, {MAX_HEAD_DIM}], got {D}")


def check_qkv(
    q: Any,
    k: Any,
    v: Any,
    ragged_hint: str = _RAGGED_HINT,
    *,
    error: Error = ValueError,
    same_length: bool = True,
) -> None:
    """Check that q (B, N, Hq, D), k and v (B, N, Hkv, D) agree in type, dtype, device and shape
    (``error`` for what is not a type error). ``same_length=False``: k and v may have another
    length than q (B, Nk, Hkv, D).

    ``ragged_hint`` ends the error for a nested (or otherwise non-strided) tensor: what the caller
    takes for sequences of different lengths."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ragged_hint)
        check_rank(t, name, "(B, N, H, D)", error)
        check_float(t, name, error)
    check_like_q(q, k, "k", error)
    check_like_q(q, v, "v", error)
    require_shape(
        v,
        k.shape,
        error,
        lambda: f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}",
    )
    dims = (0, 1, 3) if same_length else (0, 3)
    for i in dims:
        require(
            k.shape[i] == q.shape[i],
            error,
            lambda: (
                f"q (B, N, Hq, D) and k (B, {'N' if same_length else 'Nk'}, Hkv, D) must agree in "
                f"{'B, N and D' if same_length else 'B and D'}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            ),
        )
    check_heads(q.shape[2], k.shape[2], q.shape[3], error)


def resolve_scale(softmax_scale: Any, head_dim: int) -> float:
    """``1/sqrt(D)`` when ``softmax_scale`` is None, else the finite float given."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise ValueError(f"softmax_scale must be a real number or None, got {softmax_scale!r}")
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return scale


def check_scale_for_dtype(scale: float, dtype: torch.dtype) -> float:
    """``scale`` if it is finite in the dtype the scores are computed in (float32 for float16,
    bfloat16 and float32 inputs, float64 for float64), with room for the kernels' base-2 factor
    ``log2(e)``; else a ValueError naming it."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    limit = torch.finfo(compute).max / 2
    if not abs(scale) <= limit:
        raise ValueError(
            f"softmax_scale must be finite in the compute dtype {str(compute).replace('torch.', '')} of "
            f"{str(dtype).replace('torch.', '')} inputs (|softmax_scale| <= {limit:.3g}), got {scale!r}"
        )
    return scale


def effective_branches(
    segment_lengths: list[int], dilation_rates: list[int], N: int, num_heads: int
) -> tuple[list[int], list[int]]:
    """The same branches, with a segment length above ``2**40`` (and its rate) brought down to what
    the sequence and the heads can tell apart, so that no backend does index arithmetic near the
    int64 limit (where it would overflow).

    Such a ``w`` exceeds any ``N``, so it makes the whole sequence one segment, as ``w' = max(N, r')``
    does; a rate ``r >= max(N, num_heads)`` covers, in head ``h``, only the position ``t = h`` of the
    segment (``h % r == h`` and ``t % r == t``), as ``r' = max(N, num_heads)`` does. Other branches
    are returned as they are.
    """
    segs, rates = [], []
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        if w > _HUGE_SEGMENT:
            # only here: max() of a symbolic N (torch.export, dynamic shapes) guards on N
            r = min(r, max(N, num_heads, 1))
            w = max(N, r)
        segs.append(w)
        rates.append(r)
    return segs, rates


def check_dropout(dropout_p: Any) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return p


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def cache_dtype_device(dtype: Any, device: Any) -> tuple[torch.dtype, torch.device | None]:
    """The dtype (None: torch's default) and device (None: torch's default) of a key/value cache,
    checked: a floating dtype of :data:`FLOAT_DTYPES` and a device torch can name."""
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in FLOAT_DTYPES:
        names = ", ".join(str(t) for t in FLOAT_DTYPES)
        raise ValueError(f"dtype must be one of {names} (or None), got {dtype!r}")
    if device is None:
        return dtype, None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device must be a torch.device, a device string or None, got {device!r}: {e}"
        ) from None
    return dtype, dev


def check_packed(q: Any, k: Any, v: Any, cu_seqlens: Any, error: Error = ValueError) -> None:
    """Check a packed batch: q (T, Hq, D), k and v (T, Hkv, D) (as :func:`check_qkv`), cu_seqlens an
    int32 (S + 1,) tensor on q's device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name)
        check_rank(t, name, "(T, H, D)", error)
    check_qkv(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), error=error)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    require(
        cu_seqlens.dtype == torch.int32, error, lambda: f"cu_seqlens must be int32, got {cu_seqlens.dtype}"
    )
    require(
        cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1,
        error,
        lambda: f"cu_seqlens must be 1-D of shape (S + 1,), got shape {tuple(cu_seqlens.shape)}",
    )
    require(
        cu_seqlens.device == q.device,
        error,
        lambda: f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}",
    )


def check_max_seqlen(max_seqlen: Any, error: Error = ValueError) -> None:
    require(max_seqlen >= 0, error, lambda: f"max_seqlen must be >= 0, got {max_seqlen}")


def check_varlen_qkv(q: Any, k: Any, v: Any, cu_seqlens: Any, max_seqlen: Any) -> int:
    """Check a packed batch (:func:`check_packed`) and max_seqlen, an int in [0, 2^40). Returns
    max_seqlen as an int."""
    check_packed(q, k, v, cu_seqlens)
    max_seqlen = _as_int(max_seqlen, "max_seqlen")
    check_max_seqlen(max_seqlen)
    if max_seqlen >= _HUGE_SEGMENT:
        raise ValueError(
            f"max_seqlen must be below 2^40 = {_HUGE_SEGMENT} (longer than any sequence a tensor holds), "
            f"got {max_seqlen}"
        )
    return max_seqlen


def varlen_lengths(cu_seqlens: torch.Tensor, T: int, max_seqlen: int) -> list[int]:
    """The sequence lengths of ``cu_seqlens`` (read on the host), checked in this order (the C++
    op's): ``cu_seqlens[0] = 0``, non-decreasing, ``cu_seqlens[-1] = T``, then no length above
    ``max_seqlen``.

    A ``cu_seqlens`` vmapped by ``torch.func.vmap`` has no values to read: ``ValueError`` naming it
    (q, k and v may be vmapped, the packing is shared)."""
    if torch._C._functorch.is_batchedtensor(cu_seqlens):
        raise ValueError(
            "cu_seqlens cannot be vmapped (torch.func.vmap): the packing is read on the host; vmap q, k "
            "and v and pass one cu_seqlens for every example (in_dims None)"
        )
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {cu[0]}")
    lengths = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}] = {cu[i]} > "
                f"cu_seqlens[{i + 1}] = {cu[i + 1]}"
            )
    if cu[-1] != T:
        raise ValueError(
            f"cu_seqlens[-1] (cu_seqlens[{len(cu) - 1}]) must equal T = {T}, the rows of q, got {cu[-1]}"
        )
    for i, n in enumerate(lengths):
        if n > max_seqlen:
            raise ValueError(f"sequence {i} has length {n} > max_seqlen = {max_seqlen}")
    return lengths


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32: the dtype of ``lse`` and of every sum."""
    return torch.float64 if dtype == torch.float64 else torch.float32
