"""The ranks that share the sequence: a process group, a ``DeviceMesh``, or none.

Wherever the ring package takes a process group it also takes a
:class:`torch.distributed.device_mesh.DeviceMesh`, as PyTorch's context-parallel and
tensor-parallel APIs do: a 1-D mesh, or a mesh of more dimensions with ``mesh_dim`` naming the
dimension that splits the sequence (``mesh_dim="cp"`` of a ``("dp", "cp")`` mesh).

Without a process group the sequence is not split: each process runs the op on the tensor it was
given. Under a launcher (``WORLD_SIZE`` above 1: torchrun sets it) that is almost always a
missing ``torch.distributed.init_process_group(...)``, so it is an error unless the caller asked
for a local run explicitly with ``ring_size=1``. A ``ring_size`` above 1 without a process group
and without a launcher warns (:class:`SequenceSplitWarning`).
"""

from __future__ import annotations

import copy
import os
from typing import Any, cast

import torch.distributed as dist

from .._warnings import SequenceSplitWarning, warn_once

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # torch built without distributed support
    DeviceMesh = None  # type: ignore[assignment,misc]

__all__ = [
    "GroupCopies",
    "GroupLike",
    "NeedsGroup",
    "SequenceSplitWarning",
    "as_process_group",
    "communicator_key",
    "resolve_group",
    "saved_group",
]

# A process group, a DeviceMesh, or GroupMember.NON_GROUP_MEMBER (what dist.new_group returns
# on a process outside the group).
GroupLike = Any


def as_process_group(
    group: GroupLike, mesh_dim: str | int | None = None, who: str = "RingDilatedAttention"
) -> dist.ProcessGroup | int | None:
    """The process group that ``group`` names: ``None``, a ``ProcessGroup`` (returned as is),
    ``GroupMember.NON_GROUP_MEMBER`` (returned as is; forward refuses it), or a ``DeviceMesh``
    (1-D, or with ``mesh_dim`` naming one of its dimensions). Raises TypeError or ValueError with
    the value otherwise."""
    if DeviceMesh is not None and isinstance(group, DeviceMesh):
        names = group.mesh_dim_names
        if mesh_dim is None:
            if group.ndim != 1:
                example = f"mesh_dim={names[-1]!r}" if names else "mesh_dim=1"
                raise ValueError(
                    f"{who}: process_group is a {group.ndim}-D DeviceMesh (dims {names}); pass mesh_dim= "
                    f"naming the dimension that splits the sequence (e.g. {example}), or the 1-D mesh of "
                    "that dimension (mesh['cp'])"
                )
            return group.get_group()
        if isinstance(mesh_dim, str):
            if not names or mesh_dim not in names:
                raise ValueError(f"{who}: mesh_dim={mesh_dim!r} is not a dimension of the DeviceMesh {names}")
        elif isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int) or not 0 <= mesh_dim < group.ndim:
            raise ValueError(
                f"{who}: mesh_dim must be a dimension name or an int in [0, {group.ndim}), got {mesh_dim!r}"
            )
        return group.get_group(mesh_dim)
    if mesh_dim is not None:
        raise TypeError(
            f"{who}: mesh_dim={mesh_dim!r} is given but process_group is not a DeviceMesh "
            f"({type(group).__name__})"
        )
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return group
    if isinstance(group, int) and dist.is_available() and group == dist.GroupMember.NON_GROUP_MEMBER:
        return group  # a process outside the group: forward says so, in its own words
    raise TypeError(
        f"{who}: process_group must be a torch.distributed.ProcessGroup, a DeviceMesh or None, got "
        f"{type(group).__name__}"
    )


def resolve_group(
    process_group: dist.ProcessGroup | int | None,
    ring_size: int | None = None,
    who: str = "RingDilatedAttention",
    strict: bool = True,
) -> tuple[dist.ProcessGroup | None, int, int]:
    """``(group, size, rank)`` of this process; size 1 when torch.distributed is not initialised.

    Without a process group: under a launcher (``WORLD_SIZE`` above 1) raises RuntimeError saying
    what to call, unless ``ring_size == 1`` (a local run asked for explicitly) or ``strict`` is
    False (then it warns); a ``ring_size`` above 1 warns, as it does with a group of one rank. A
    process that is not a member of ``process_group`` raises.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError(
                f"{who}: a process_group was given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first"
            )
        world = os.environ.get("WORLD_SIZE", "1")
        launched = world.isdigit() and int(world) > 1
        if launched and ring_size != 1 and strict:
            raise RuntimeError(
                f"{who}: WORLD_SIZE={world} (a launcher such as torchrun started {world} processes) but no "
                "process group is initialised, so the sequence would not be split and every process would "
                "treat its chunk as the whole sequence. Call torch.distributed.init_process_group(...) "
                "before the first forward (or pass process_group= a group or DeviceMesh); to run each "
                "process on its own whole sequence, pass ring_size=1"
            )
        if (launched and ring_size != 1) or (ring_size is not None and ring_size > 1):
            warn_once(
                ("ring-no-group", who, ring_size, world),
                f"{who}: ring_size={ring_size}, WORLD_SIZE={world}, but no process group is initialised: "
                "each process computes the tensor it was given as the whole sequence. Call "
                "torch.distributed.init_process_group(...) first to split the sequence across the processes.",
                SequenceSplitWarning,
            )
        return None, 1, 0
    group: dist.ProcessGroup | None
    if process_group is None:
        group, size, rank = None, dist.get_world_size(), dist.get_rank()
    else:
        group, size, rank = _member(process_group, who)
    if size == 1 and ring_size is not None and ring_size > 1:
        warn_once(
            ("ring-one-rank", who, ring_size),
            f"{who}: ring_size={ring_size} but the process group has 1 rank: the sequence is not split, "
            "each process computes the tensor it was given as the whole sequence",
            SequenceSplitWarning,
        )
    return group, size, rank


def _member(process_group: dist.ProcessGroup | int, who: str) -> tuple[dist.ProcessGroup, int, int]:
    """``(group, size, rank)`` of a process group this process is a member of; RuntimeError
    otherwise."""
    if isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise RuntimeError(
            f"{who}: this process (global rank {dist.get_rank()}) is not a member of the process_group "
            "it was given (dist.new_group returned NON_GROUP_MEMBER here); call forward only on the "
            "group's members"
        )
    # The one int a group argument can be is NON_GROUP_MEMBER, refused above.
    group = cast(dist.ProcessGroup, process_group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError(
            f"{who}: this process (global rank {dist.get_rank()}) is not a member of the process_group given"
        )
    return group, dist.get_world_size(group), rank


class NeedsGroup:
    """In place of the process group of a module loaded with ``torch.load`` (or unpickled) that was
    saved with an explicit process group, which cannot be saved: its forward raises until
    ``set_process_group`` gives it one. ``ranks``: the global ranks of the saved group (None where
    they could not be read)."""

    def __init__(self, ranks: tuple[int, ...] | None) -> None:
        self.ranks = ranks

    def __repr__(self) -> str:
        return f"NeedsGroup(ranks={self.ranks})"

    def error(self, who: str) -> RuntimeError:
        ranks = "ranks unknown" if self.ranks is None else f"global ranks {list(self.ranks)}"
        return RuntimeError(
            f"{who} was saved with an explicit process_group ({ranks}), which cannot be saved with it: "
            "call module.set_process_group(group) with the process group (or DeviceMesh, with mesh_dim=) "
            "that splits the sequence in this process, or module.set_process_group(None) for the default "
            "group (a local run where torch.distributed is not initialised)"
        )


def communicator_key(group: Any) -> Any:
    """What identifies the communicator behind ``group`` in this process, whatever object names it:
    ``"default"`` for None, ``dist.group.WORLD`` and a group that is the default group (a 1-D
    ``DeviceMesh`` over the world hands out the default group); a process group's registered name
    otherwise (two groups made by ``new_group`` are two communicators even with the same ranks)."""
    if group is None:
        return "default"
    if isinstance(group, NeedsGroup):
        return ("unset", group.ranks)
    if isinstance(group, int):  # GroupMember.NON_GROUP_MEMBER: never exchanges
        return ("not a member",)
    if dist.is_available() and dist.is_initialized() and group is dist.group.WORLD:
        return "default"
    try:
        return ("group", group.group_name)
    except (AttributeError, RuntimeError, ValueError):
        return ("group", id(group))


def saved_group(group: Any) -> NeedsGroup | None:
    """What ``torch.save`` keeps of a module's process group: None for the default group."""
    if group is None or isinstance(group, NeedsGroup):
        return group
    try:
        ranks: tuple[int, ...] | None = tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError):
        ranks = None
    return NeedsGroup(ranks)


class GroupCopies:
    """What copies and saves of a module keep of its process group (mixed into the ring module,
    before ``nn.Module``): ``copy.copy`` and ``copy.deepcopy`` share the group; ``torch.save`` and
    ``pickle`` keep the configuration, the default group as None (the loading process's default
    group) and an explicit one as :class:`NeedsGroup`. Either way the copy's per-group state
    (``_per_group``) is renewed by ``_reset_per_group_state``, as a module built now, and its caches
    (``_caches``) start empty."""

    process_group: Any
    _per_group: tuple[str, ...] = ()
    _caches: tuple[str, ...] = ()

    def _reset_per_group_state(self) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state["process_group"] = saved_group(self.process_group)
        for name in self._caches:
            state[name] = {}
        for name in self._per_group:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "check_consistency" in state:  # saved before the setting became a validated property
            state["_check_consistency"] = state.pop("check_consistency")
        super().__setstate__(state)  # type: ignore[misc]
        self._reset_per_group_state()

    def _copy(self, memo: dict[int, Any] | None) -> Any:
        """The copy: the other attributes shared (``memo`` None: ``copy.copy``) or deep-copied."""
        new = type(self).__new__(type(self))
        if memo is not None:
            memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name == "process_group":
                new.__dict__[name] = value
            elif name in self._caches:
                new.__dict__[name] = {}
            elif name not in self._per_group:
                new.__dict__[name] = value if memo is None else copy.deepcopy(value, memo)
        new._reset_per_group_state()
        return new

    def __copy__(self) -> Any:
        return self._copy(None)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self._copy(memo)
