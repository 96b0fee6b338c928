"""Hilbert-curve token order for image-like (2-D) inputs.

Dilated attention splits the sequence into contiguous segments. When the sequence is an image
flattened row by row, a segment of ``w`` tokens is a thin strip of ``w / width`` rows, and its
dilated sub-sequences sample that strip unevenly. Ordering the tokens along a Hilbert curve
instead makes every contiguous run of tokens a compact 2-D region, so a segment is a blob of the
image and dilation thins it out evenly.

The curve is a *generalized* Hilbert curve, defined for every ``height x width`` (not only powers
of two), after the recursive construction of Jakub Červený's "gilbert" (generalized Hilbert)
algorithm: a rectangle is filled by a path that starts at one corner and ends at the adjacent
corner along its longer ("major") side. A long rectangle is cut in two along its major side; any
other into three: the first half of the minor side over the first half of the major side (axes
swapped), the rest of the minor side over the whole major side, then the first half of the minor
side over the rest of the major side, walked back (axes swapped). Cuts move by one cell where
needed so that the parts join by unit steps.

Unit steps everywhere. The published algorithm makes exactly one diagonal step when the longer
side of the grid is odd and the shorter side even and at least 4 (e.g. 5 x 4, 4 x 7, 9 x 8):
its sub-rectangles must end at the corner adjacent to their start along the major side, and a path of unit steps between those corners does not exist when that side is odd and the
other even (colour the board as a chess board: a path of unit steps alternates colours, so on a
board with an even number of cells its two ends differ in colour, but these two corners do not).
The top-level curve needs no fixed end, so this module leaves it free where the major side is odd
and the minor side even: it cuts off halves with an even major side (as the algorithm does) while
the rest is long, then fills the last, nearly square, part starting along its even side. Other
sizes get the published curve unchanged.

Every step of the resulting curve is a unit move between 4-neighbours. This was checked
exhaustively for every size up to 128 x 128 (``tests/modules/test_hilbert.py`` checks all sizes up to
48 x 48 and many larger ones, and all up to 128 x 128 with ``DILATED_ATTENTION_SLOW=1``), and
:func:`hilbert_permutation` verifies it for every size it computes: a failure would raise a
``RuntimeError``, never give a silently worse curve.

Conventions: a (B, N, ...) token sequence with ``N = height * width`` is in row-major order,
token ``row * width + col``. ``perm, inv = hilbert_permutation(height, width)`` gives
``x_curve = x[:, perm]`` in curve order (``perm[i]`` is the row-major index of the ``i``-th cell
along the curve) and ``x == x_curve[:, inv]``.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from typing import Any

import torch

__all__ = ["from_curve_order", "hilbert_permutation", "segment_locality", "to_curve_order"]

logger = logging.getLogger(__name__)

# A leaf of the recursion: a straight run of ``n`` cells from column ``x``, row ``y`` in steps
# of ``(dx, dy)``.
_Run = tuple[int, int, int, int, int]


def _sign(v: int) -> int:
    return (v > 0) - (v < 0)


def _check_size(value: Any, name: str) -> int:
    """An int >= 1 (bools are refused), returned as a Python int."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int >= 1, got the bool {name}={value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an int >= 1, got {name}={value!r} of type {type(value).__name__}"
        ) from None
    if as_int < 1:
        raise ValueError(f"{name} must be >= 1, got {name}={as_int}")
    return as_int


def _fill(x: int, y: int, ax: int, ay: int, bx: int, by: int, runs: list[_Run]) -> None:
    """Appends to ``runs`` a path through the rectangle spanned by the vectors ``a = (ax, ay)``
    (the major side, along which the path travels) and ``b = (bx, by)`` from the corner cell
    ``(x, y)``; exactly one of ``ax, ay`` and one of ``bx, by`` is non-zero.

    The path is meant to end at the corner ``(x, y) + a - sign(a)``, next to where the caller
    continues. With unit steps that is impossible when ``|a|`` is odd and ``|b|`` even (see the
    module doc), and this construction then makes one diagonal step; it also cannot when
    ``|a| == 1 < |b|`` (a single column). Linear in the number of cells, recursion depth
    logarithmic.
    """
    w, h = abs(ax + ay), abs(bx + by)
    dax, day = _sign(ax), _sign(ay)  # unit vector along a
    dbx, dby = _sign(bx), _sign(by)  # unit vector along b
    if h == 1:  # a single row along a
        runs.append((x, y, dax, day, w))
        return
    if w == 1:  # a single column along b
        runs.append((x, y, dbx, dby, h))
        return
    # Halves, rounded towards -inf as the published construction does (this matters for the
    # sub-rectangles walked backwards, whose vectors are negative).
    ax2, ay2 = ax // 2, ay // 2
    bx2, by2 = bx // 2, by // 2
    w2, h2 = abs(ax2 + ay2), abs(bx2 + by2)
    if 2 * w > 3 * h:
        # Long rectangle: cut it in two along a, the first half of even length so that it ends
        # next to where the second one starts.
        if w2 % 2 and w > 2:
            ax2, ay2 = ax2 + dax, ay2 + day
        _fill(x, y, ax2, ay2, bx, by, runs)
        _fill(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by, runs)
    else:
        # Three parts: up the first (even) half of b with the axes swapped, across the whole of
        # a over the rest of b, then back down the first half of b beside the first part.
        if h2 % 2 and h > 2:
            bx2, by2 = bx2 + dbx, by2 + dby
        _fill(x, y, bx2, by2, ax2, ay2, runs)
        _fill(x + bx2, y + by2, ax, ay, bx - bx2, by - by2, runs)
        _fill(
            x + (ax - dax) + (bx2 - dbx),
            y + (ay - day) + (by2 - dby),
            -bx2,
            -by2,
            -(ax - ax2),
            -(ay - ay2),
            runs,
        )


def _fill_free_end(x: int, y: int, ax: int, ay: int, bx: int, by: int, runs: list[_Run]) -> None:
    """Like :func:`_fill`, but the path may end anywhere. That lets it keep unit steps when
    ``|a|`` is odd and ``|b|`` even, where a path ending at the adjacent corner cannot."""
    w, h = abs(ax + ay), abs(bx + by)
    if not (w % 2 == 1 and h % 2 == 0):
        _fill(x, y, ax, ay, bx, by, runs)
        return
    if 2 * w > 3 * h:
        # Long: an even first half ending next to the rest (as in _fill), the rest with a free end.
        ax2, ay2 = ax // 2, ay // 2
        if abs(ax2 + ay2) % 2:
            ax2, ay2 = ax2 + _sign(ax), ay2 + _sign(ay)
        _fill(x, y, ax2, ay2, bx, by, runs)
        _fill_free_end(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by, runs)
    else:
        # Nearly square: start along the even side b instead.
        _fill(x, y, bx, by, ax, ay, runs)


def _curve_cells(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of the cells in curve order, each (height * width,) int64."""
    runs: list[_Run] = []
    if width >= height:
        _fill_free_end(0, 0, width, 0, 0, height, runs)  # major side along the columns
    else:
        _fill_free_end(0, 0, 0, height, width, 0, runs)  # major side along the rows
    table = torch.tensor(runs, dtype=torch.int64)  # (R, 5): x, y, dx, dy, n
    x0, y0, dx, dy, n = table.unbind(1)
    first = torch.cumsum(n, 0) - n  # (R,) curve index of each run's first cell (runs are non-empty)
    starts = torch.zeros(height * width, dtype=torch.int64)
    starts[first[1:]] = 1
    leaf = torch.cumsum(starts, 0)  # (N,) run of each cell (cheaper than repeat_interleave on CPU)
    step = torch.arange(height * width) - first[leaf]  # (N,) position inside its run
    cols = x0[leaf] + dx[leaf] * step
    rows = y0[leaf] + dy[leaf] * step
    return rows, cols


@functools.lru_cache(maxsize=64)
def _cached_permutation(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):  # cached: never inference tensors, whatever mode the caller is in
        return _permutation(height, width)


def _permutation(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    start = time.perf_counter()
    rows, cols = _curve_cells(height, width)
    n = height * width
    # Cheap self-checks (linear): a bijection onto the grid whose steps are all unit moves.
    in_grid = bool(((rows >= 0) & (rows < height) & (cols >= 0) & (cols < width)).all())
    perm = rows * width + cols  # (N,) row-major index of the i-th cell along the curve
    if rows.numel() != n or not in_grid or not bool((torch.bincount(perm, minlength=n) == 1).all()):
        raise RuntimeError(
            f"internal error: the Hilbert curve for height={height}, width={width} is not a permutation"
        )
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    steps = (rows.diff().abs() + cols.diff().abs()) if n > 1 else rows.new_ones(0)
    if not bool((steps == 1).all()):
        bad = int((steps != 1).sum())
        raise RuntimeError(
            f"internal error: the Hilbert curve for height={height}, width={width} has {bad} non-unit steps"
        )
    logger.debug("Hilbert curve %dx%d computed in %.3f s", height, width, time.perf_counter() - start)
    return perm, inv


def hilbert_permutation(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The generalized Hilbert curve through a ``height x width`` grid, as a token permutation.

    Args:
        height: number of rows, an int >= 1.
        width: number of columns, an int >= 1.

    Returns:
        ``(perm, inv)``, CPU int64 tensors of length ``height * width``. ``perm[i]`` is the
        row-major index ``row * width + col`` of the ``i``-th cell along the curve, so for a
        row-major sequence ``x`` of shape (B, height * width, ...), ``x[:, perm]`` is in curve
        order, and ``inv`` undoes it: ``x[:, perm][:, inv] == x``. Consecutive cells of the curve
        are 4-neighbours (unit moves) for every size; the curve starts at cell (0, 0).

    The result is cached (64 sizes); each call returns fresh copies, so a caller may modify them.
    Computing a curve costs time and memory linear in ``height * width``.

    Raises:
        TypeError: ``height`` or ``width`` is not an int (or is a bool).
        ValueError: ``height`` or ``width`` is below 1.
    """
    h = _check_size(height, "height")
    w = _check_size(width, "width")
    perm, inv = _cached_permutation(h, w)
    return perm.clone(), inv.clone()


def _check_reorder(x: torch.Tensor, index: torch.Tensor, dim: int, what: str) -> tuple[torch.Tensor, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype != torch.int64:
        got = (
            f"{index.dtype} tensor of shape {tuple(index.shape)}"
            if isinstance(index, torch.Tensor)
            else type(index).__name__
        )
        raise TypeError(f"{what} must be a 1-D int64 tensor (from hilbert_permutation), got {got}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got dim={dim!r}"
        )
    dim = dim % x.dim()
    if x.shape[dim] != index.numel():
        raise ValueError(
            f"sequence length {x.shape[dim]} (x.shape[{dim}] of x with shape {tuple(x.shape)}) does not match "
            f"the {index.numel()} cells of the grid ({what} has length {index.numel()})"
        )
    return index.to(x.device, non_blocking=True), dim


def to_curve_order(x: torch.Tensor, perm: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Reorders a row-major token sequence into curve order along ``dim``: ``x.index_select(dim,
    perm)`` (differentiable), e.g. (B, N, H, D) -> (B, N, H, D) with ``dim=1``.

    Raises ValueError when ``x.shape[dim]`` is not ``len(perm)``."""
    perm, dim = _check_reorder(x, perm, dim, "perm")
    return x.index_select(dim, perm)


def from_curve_order(x: torch.Tensor, inv: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Puts a curve-ordered sequence back into row-major order along ``dim``: ``x.index_select(
    dim, inv)`` (differentiable), the inverse of :func:`to_curve_order`.

    Raises ValueError when ``x.shape[dim]`` is not ``len(inv)``."""
    inv, dim = _check_reorder(x, inv, dim, "inv")
    return x.index_select(dim, inv)


def segment_locality(perm: torch.Tensor, height: int, width: int, segment_length: int) -> float:
    """How compact the segments of a token order are on the grid (lower is more compact).

    The tokens, in the order ``perm`` gives them (``perm[i]`` = row-major index of the ``i``-th
    token, e.g. ``torch.arange(height * width)`` for row-major order), are cut into consecutive
    segments of ``segment_length`` tokens (the last one may be shorter), as dilated attention cuts
    them. The measure is the mean, over all tokens, of the Euclidean distance in cells from the
    token's ``(row, col)`` to the centroid of its segment.

    Raises:
        TypeError / ValueError: a size that is not an int >= 1, or ``perm`` that is not a
            permutation of ``range(height * width)``.
    """
    h = _check_size(height, "height")
    w = _check_size(width, "width")
    seg = _check_size(segment_length, "segment_length")
    n = h * w
    if not isinstance(perm, torch.Tensor) or perm.dim() != 1 or perm.dtype not in (torch.int32, torch.int64):
        got = (
            f"{perm.dtype} tensor of shape {tuple(perm.shape)}"
            if isinstance(perm, torch.Tensor)
            else type(perm).__name__
        )
        raise TypeError(f"perm must be a 1-D integer tensor, got {got}")
    perm = perm.detach().to("cpu", torch.int64)
    if perm.numel() != n or not torch.equal(torch.sort(perm).values, torch.arange(n)):
        raise ValueError(
            f"perm must be a permutation of range({n}) for height={h}, width={w}, "
            f"got a tensor of length {perm.numel()} that is not"
        )
    pts = torch.stack([perm // w, perm % w], dim=1).to(torch.float64)  # (N, 2): row, col
    segment = torch.arange(n) // seg  # (N,)
    count = torch.bincount(segment).to(torch.float64)  # (S,)
    centroid = torch.zeros(count.numel(), 2, dtype=torch.float64).index_add_(0, segment, pts) / count[:, None]
    return float((pts - centroid[segment]).norm(dim=1).mean())
