"""Cutting a whole sequence into this rank's positions, and putting the positions back together."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .geometry import LAYOUTS, make_layout
from .groups import GroupLike, as_process_group, resolve_group

__all__ = ["gather_sequence", "shard_sequence"]


def shard_sequence(
    x: torch.Tensor,
    process_group: GroupLike = None,
    dim: int = 1,
    layout: str = "contiguous",
    *,
    mesh_dim: str | int | None = None,
) -> torch.Tensor:
    """This rank's positions of ``x`` along ``dim`` (the sequence dimension of (B, N, H, D)).

    ``layout="contiguous"``: the chunk ``[rank*N/P, (rank+1)*N/P)``. ``layout="zigzag"``: chunks
    ``rank`` and ``2P-1-rank`` of ``2P`` (see :mod:`dilated_attention.ring.geometry`), concatenated.
    ``process_group``: a process group, a DeviceMesh (1-D, or with ``mesh_dim``), or None for the
    default group. Raises ValueError when ``N`` is not divisible by the number of ranks (by ``2P``
    for zigzag).
    """
    group = as_process_group(process_group, mesh_dim, who="shard_sequence")
    _, P, rank = resolve_group(group, who="shard_sequence", strict=False)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    N = x.shape[dim]
    parts = P if layout == "contiguous" else 2 * P
    if N % parts != 0:
        raise ValueError(
            f"the sequence length N = {N} must be divisible by {parts} (P = {P} ranks, layout={layout!r}); "
            f"pad the sequence to a multiple of {parts}"
        )
    L = make_layout(layout, P, N // P)
    return torch.cat([x.narrow(dim, c * L.chunk, L.chunk) for c in L.chunks_of(rank)], dim=dim)


def gather_sequence(
    x: torch.Tensor,
    process_group: GroupLike = None,
    dim: int = 1,
    layout: str = "contiguous",
    *,
    mesh_dim: str | int | None = None,
) -> torch.Tensor:
    """Every rank's positions of ``x`` along ``dim`` in sequence order (the inverse of
    :func:`shard_sequence`). Not differentiable; for checks and inference. Every rank must pass a
    tensor of one shape and dtype: the ranks first compare them (one small all-gather) and all
    raise the same ValueError naming each rank's when they differ."""
    group = as_process_group(process_group, mesh_dim, who="gather_sequence")
    pg, P, _ = resolve_group(group, who="gather_sequence", strict=False)
    if P == 1:
        return x
    _check_same_shapes(x, pg, P)
    parts = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(parts, x.contiguous(), group=pg)
    L = make_layout(layout, P, x.shape[dim])
    chunks = {}
    for rank, part in enumerate(parts):
        for i, c in enumerate(L.chunks_of(rank)):
            chunks[c] = part.narrow(dim, i * L.chunk, L.chunk)
    return torch.cat([chunks[c] for c in range(L.num_chunks)], dim=dim)


_MAX_DIMS = 16
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)


def _check_same_shapes(x: torch.Tensor, group: dist.ProcessGroup | None, P: int) -> None:
    """Raise ValueError on every rank when the ranks' tensors differ in shape or dtype (gathering
    them would abort inside the communication library or return uninitialised memory)."""
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"gather_sequence: x may have at most {_MAX_DIMS} dimensions, got {x.dim()}")
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    mine = torch.tensor([x.dim(), code, *x.shape] + [0] * (_MAX_DIMS - x.dim()), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(P)]
    if x.device.type == "cuda":  # NCCL gathers device tensors
        mine, rows = mine.to(x.device), [r.to(x.device) for r in rows]
    dist.all_gather(rows, mine, group=group)
    table = [r.tolist() for r in rows]
    if all(row == table[0] for row in table):
        return
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(P)]
    shown = ", ".join(
        f"rank {g}: {tuple(row[2 : 2 + row[0]])} {_DTYPES[row[1]] if row[1] < len(_DTYPES) else 'other dtype'}"
        for g, row in zip(ranks, table, strict=True)
    )
    raise ValueError(f"gather_sequence: every rank must pass a tensor of one shape and dtype, got {shown}")
