"""The kernel calls of the gather-based backends, as strided views of q, k and v (no gathers).

A branch ``(w, r)`` cuts the sequence into segments of ``L = min(w, N)`` positions (and a shorter
last one when ``N % w != 0``). Viewing x (B, N, H, D) as (B * N // L, L, H, D), query head ``h``
of the branch reads the positions ``h % r, h % r + r, ...`` of every segment (SPEC section 2). A
kernel call takes ``n`` heads whose phase and head index both step by a constant:

    element [b, j, t] = seg[b, p0 + t * dp + j * r, c0 + t * dc]

which is a strided view with the last dimension contiguous (the driver first copies an x whose last
dimension is not, :func:`last_dim_contiguous`), built from ordinary view operations
(``unflatten``, slicing, ``unfold``, ``diagonal``) so that autograd and ``torch.func`` see plain
views. Rows of different segment lengths (the shorter last segment, or the sequences of a packed
batch) are separate *parts*.

Which heads and rows share a call is the plan's rule, which lives in C++ only
(``csrc/views/plan.h``/``plan.cpp``), once for every driver: the sdpa backend's C++ driver calls
it there, and :func:`plan_branches` here decodes what the extension's ``plan()`` returns into
:class:`Call` tuples. Its cache is the C++ one (:func:`get_pattern_cache`); without the compiled
extension there is no plan, and :func:`plan_branches` raises a ``RuntimeError`` that names the
extension and how to build it.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..op import library

__all__ = [
    "CacheInfo",
    "Call",
    "Part",
    "PlanCache",
    "Strided",
    "batches",
    "get_pattern_cache",
    "last_dim_contiguous",
    "plan_branches",
    "view",
    "write",
]


@dataclass(frozen=True)
class Part:
    """``rows`` segments of ``length`` positions each, the first at position ``start``."""

    start: int
    rows: int
    length: int


@dataclass(frozen=True)
class Strided:
    """Head ``t < n`` of a call reads phase ``p0 + t * dp`` of head ``c0 + t * dc``."""

    p0: int
    dp: int
    c0: int
    dc: int
    n: int

    @property
    def expanded(self) -> bool:
        """Whether several heads of the call read the same head and phase (a stride-0 view)."""
        return self.n > 1 and self.dc == 0 and self.dp == 0


@dataclass(frozen=True)
class Call:
    """One kernel call: ``m`` rows of every segment of ``part``, query heads ``q``, key/value
    heads ``kv`` (``q.n == kv.n * g``: query head ``t`` reads key/value head ``t // g``)."""

    part: Part
    r: int
    m: int
    q: Strided
    kv: Strided
    g: int


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself where its last dimension is contiguous (stride 1, or at most one element), else a
    contiguous copy. Every kernel under the driver reads the head dim as contiguous; a view such as
    ``x[..., ::2]``, a stride-0 expanded head dim or ``qkv.view(B, N, H, D, 3).unbind(-1)`` is
    copied once here, and the views of every call are then taken of the copy."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def view(x: torch.Tensor, call: Call, s: Strided) -> torch.Tensor:
    """x (B, N, H, E) -> (B * rows, m, n, E): the rows of ``call`` at the heads ``s``. A view where
    x's batch and sequence dims fold (contiguous x); otherwise the segments are copied first."""
    part, r, m = call.part, call.r, call.m
    seg = x.narrow(1, part.start, part.rows * part.length).unflatten(1, (part.rows, part.length))
    seg = seg.flatten(0, 1)  # (Bb, L, H, E)
    if s.dp == 0 or s.n == 1:
        y = seg[:, s.p0 :: r][:, :m]  # (Bb, m, H, E)
        if s.dc == 0 and s.n > 1:
            return y[:, :, s.c0 : s.c0 + 1].expand(-1, -1, s.n, -1)
        return y[:, :, s.c0 : s.c0 + (s.n - 1) * max(s.dc, 1) + 1 : max(s.dc, 1)]
    span = s.p0 + (s.n - 1) * s.dp + 1
    u = seg.unfold(1, span, r)[:, :m, :, :, s.p0 :: s.dp]  # (Bb, m, H, E, n): positions of head t
    if s.dc == 0:
        y = u[:, :, s.c0]  # (Bb, m, E, n)
    else:
        y = u[:, :, s.c0 : s.c0 + (s.n - 1) * s.dc + 1 : s.dc].diagonal(0, 2, 4)  # (Bb, m, E, n)
    return y.movedim(-1, 2)


def write(
    dst: torch.Tensor, sl: slice, call: Call, s: Strided, val: torch.Tensor, *, add: bool = False
) -> torch.Tensor:
    """dst (B, N, H, E) with the elements of ``view(dst[sl], call, s)`` set to ``val`` (``add``:
    increased by it); returns the result.

    In place (returning dst), except while torch.compile or torch.export traces, or under
    ``torch.func.vmap``: there it is computed out of place by ``index_copy``/``index_add`` over
    dst's rows and a new tensor is returned. PyTorch's functionalization writes a mutated
    ``unfold`` view back as if its windows covered the whole dimension, so the positions between
    or after the windows came back zero (wrong outputs of the gather backends under torch.compile,
    for a branch with r >= Hq beside another), and it refuses mutations through an ``as_strided``
    view. Under vmap, ``val`` may be batched where ``dst`` is not (dst built from an unbatched q,
    val computed from a batched k or v), which an in-place write cannot store."""
    if not torch.compiler.is_compiling() and not _under_vmap():
        target = view(dst[sl], call, s)
        if add:
            target.add_(val)
        else:
            target.copy_(val)
        return dst
    B, N, H, E = dst.shape
    rows = torch.arange(B * N * H, device=dst.device).view(B, N, H, 1)
    index = view(rows[sl], call, s).reshape(-1)
    flat, src = dst.reshape(B * N * H, E), val.reshape(-1, E).to(dst.dtype)
    flat = flat.index_add(0, index, src) if add else flat.index_copy(0, index, src)
    return flat.view(B, N, H, E)


def _under_vmap() -> bool:
    """Whether ``torch.func.vmap`` (at any level, also around ``grad`` or ``vjp``) is running."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def batches(call: Call, B: int, N: int) -> list[slice]:
    """The batch slices to run ``call`` on: all of the batch at once where the batch and segment
    dims of a contiguous (B, N, ...) tensor fold into one (one batch, one segment per row, or
    segments that tile the whole sequence), else one batch element at a time."""
    part = call.part
    if B == 1 or part.rows == 1 or (part.start == 0 and part.rows * part.length == N):
        return [slice(None)]
    return [slice(b, b + 1) for b in range(B)]


@torch.compiler.assume_constant_result
def _planned(
    lengths: tuple[int, ...],
    Hq: int,
    Hkv: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    native_gqa: bool,
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The extension's plan (plain ints, 16 a call). torch.compile calls it while tracing and keeps
    the result as a constant of the graph (a call into C would break the graph)."""
    return library._require_extension().plan(lengths, Hq, Hkv, segment_lengths, dilation_rates, native_gqa)


@functools.lru_cache(maxsize=256)
def _decoded(planned: tuple[tuple[tuple[int, ...], ...], ...]) -> tuple[tuple[Call, ...], ...]:
    """The :class:`Call` tuples of a plan of the extension, kept per plan (building the frozen
    dataclasses costs more than planning)."""
    return tuple(
        tuple(
            Call(Part(c[0], c[1], c[2]), c[3], c[4], Strided(*c[5:10]), Strided(*c[10:15]), c[15])
            for c in calls
        )
        for calls in planned
    )


def _ints(xs: Iterable[int]) -> tuple[int, ...]:
    """Plain ints: a symbolic one (torch.compile's dynamic shapes, or an int it made symbolic) is
    specialised to its value, a guard on it."""
    return tuple(operator.index(x) for x in xs)


def plan_branches(
    N: int | tuple[int, ...],
    Hq: int,
    Hkv: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    native_gqa: bool,
) -> tuple[tuple[Call, ...], ...]:
    """The kernel calls of every branch: one tuple of :class:`Call` per branch. ``N`` is the
    sequence length, or the lengths of the sequences of a packed batch. Planned in C++, through
    its cache (module docstring); under torch.compile the plan is a constant of the graph, the
    ints it depends on specialised to their values (:func:`_ints`)."""
    planned = _planned(
        _ints(N if isinstance(N, tuple) else (N,)),
        operator.index(Hq),
        operator.index(Hkv),
        _ints(segment_lengths),
        _ints(dilation_rates),
        bool(native_gqa),
    )
    # Dynamo warns about an lru_cache it would step over: it traces the uncached function
    return (_decoded.__wrapped__ if torch.compiler.is_compiling() else _decoded)(planned)


class CacheInfo(NamedTuple):
    """What :meth:`PlanCache.info` reports."""

    hits: int
    misses: int
    entries: int
    max_entries: int


class PlanCache:
    """The plan cache (``csrc/views/plan.cpp``): the kernel calls of each geometry (sequence length
    or packed lengths, heads, branches), planned once per process and shared by every driver that
    runs a kernel per call (``sdpa``'s C++ and Python drivers, ``manual``, ``flash_attn_*``,
    ``xformers``). ``native`` needs no plan."""

    def info(self) -> CacheInfo:
        if library._C is None:  # without the extension nothing is planned
            return CacheInfo(0, 0, 0, 0)
        return CacheInfo(*library._C.plan_cache_info())

    def clear(self) -> None:
        if library._C is not None:
            library._C.plan_cache_clear()

    def __len__(self) -> int:
        return self.info().entries


_PLAN_CACHE = PlanCache()


def get_pattern_cache() -> PlanCache:
    """The process's plan cache (:class:`PlanCache`): ``.info()`` (hits, misses, entries,
    max_entries) and ``.clear()``."""
    return _PLAN_CACHE
