"""Sequence (context) parallelism for the example GPT: a ("dp", "cp") device mesh.

Under ``torchrun`` with ``--context_parallel=C``, the ``W`` processes form a mesh of
``W / C`` data-parallel replicas by ``C`` sequence ranks. The ``C`` ranks of one replica draw the
same global batch, and each takes its replica's rows and its chunk of ``block_size / C``
positions (:func:`select`); every
attention layer computes its chunk's causal dilated attention with
``dilated_attention.ring.RingDilatedAttention`` over the "cp" dimension, and the position
embeddings read the chunk's global positions. The weights are wrapped over the whole mesh: DDP
over all ranks, or FSDP2 (``fully_shard`` on the 2-D mesh: replicated over "dp", sharded over
"cp"). Both average the gradients over all ranks, and each rank's loss is the mean over its own
tokens (equal chunks), so the gradients are those of one process on the mean over every token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._pytree import tree_map

from dilated_attention.ring import RingDilatedAttention

__all__ = [
    "PARALLEL",
    "Mesh",
    "check_launched",
    "data_config",
    "describe",
    "enable",
    "full_state",
    "make_mesh",
    "select",
    "wrap",
]

PARALLEL = ("ddp", "fsdp2")


@dataclass
class Mesh:
    """The ("dp", "cp") mesh and this rank's coordinates in it."""

    mesh: DeviceMesh
    dp_rank: int
    dp: int
    cp_rank: int
    cp: int


def check_launched(cfg: Any) -> None:
    """Refuse ``context_parallel > 1`` in a single process (it needs a launcher)."""
    if cfg.context_parallel > 1:
        raise ValueError(
            f"context_parallel={cfg.context_parallel} splits each sequence over that many processes: start "
            f"the run with torchrun (e.g. torchrun --standalone --nproc_per_node={cfg.context_parallel} train.py ...)"
        )


def make_mesh(device: torch.device, world: int, cfg: Any) -> Mesh:
    """The mesh of ``world`` processes, ``cfg.context_parallel`` of them per sequence."""
    C = cfg.context_parallel
    if world % C:
        raise ValueError(f"context_parallel ({C}) must divide the number of processes ({world})")
    if cfg.block_size % C:
        raise ValueError(f"block_size ({cfg.block_size}) must be divisible by context_parallel ({C})")
    dp = world // C
    mesh = init_device_mesh(device.type, (dp, C), mesh_dim_names=("dp", "cp"))
    return Mesh(mesh, mesh.get_local_rank("dp"), dp, mesh.get_local_rank("cp"), C)


def data_config(cfg: Any, replicas: int, mesh: Mesh | None) -> Any:
    """The config the batches are drawn with: with context parallelism, the global batch
    (``replicas * batch_size`` rows, the same on every rank)."""
    return cfg if mesh is None else dataclasses.replace(cfg, batch_size=cfg.batch_size * replicas)


def select(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's part of a global (replicas * B, T) batch: its replica's rows, its chunk of positions."""
    rows, n = t.shape[0] // mesh.dp, t.shape[1] // mesh.cp
    return t[mesh.dp_rank * rows : (mesh.dp_rank + 1) * rows, mesh.cp_rank * n : (mesh.cp_rank + 1) * n]


def describe(mesh: Mesh | None, cfg: Any) -> str:
    """The log's note on the mesh."""
    return "" if mesh is None else f" (dp {mesh.dp} x cp {mesh.cp}, {cfg.parallel})"


def full_state(state: Any) -> Any:
    """``state`` (a state dict, nested) with every sharded tensor (FSDP2's DTensors) gathered whole;
    a collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    return tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, state)


def enable(model: nn.Module, mesh: Mesh) -> None:
    """Make every attention layer of ``model`` (a ``GPT``) split the sequence over the "cp" ranks."""
    cfg = model.config
    if cfg.attention_backend == "dense":
        raise ValueError(
            "context_parallel splits dilated attention; attention_backend='dense' is not supported"
        )
    if cfg.dropout:
        raise ValueError(
            f"context_parallel needs dropout=0.0 (no attention dropout across ranks), got {cfg.dropout}"
        )
    for block in model.transformer.h:
        block.attn.ring = RingDilatedAttention(
            cfg.segment_lengths,
            cfg.dilation_rates,
            process_group=mesh.mesh,
            mesh_dim="cp",
            attention_backend=cfg.attention_backend,
        )
    model.cp_rank = mesh.cp_rank


def wrap(model: nn.Module, mesh: Mesh, parallel: str, device: torch.device) -> nn.Module:
    """DDP over all ranks, or FSDP2 on the whole mesh."""
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block, mesh=mesh.mesh)
        fully_shard(model, mesh=mesh.mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
