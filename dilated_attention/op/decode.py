"""The fused decode step over the bounded cache (:class:`~dilated_attention.decode.BoundedDilatedKVCache`).

* ``torch.ops.dilated_attention.decode_step(q, k, v, k_cache, v_cache, pos, segment_lengths,
  dilation_rates, slot_lengths, softmax_scale) -> (out, lse)``

q (B, Hq, D) and k, v (B, Hkv, D): one new token per sequence at position ``pos`` (B,) int64 (a
negative position: no token, ``out = 0``, ``lse = -inf``). The op writes k, v into the caches
(B, Hkv, T, D) in place, then attends the queries to the slots they read (layout in
:mod:`.slots`). out (B, Hq, D) in q's dtype, lse (B, Hq) float32 (float64
for float64). :func:`decode_step` runs it, or the same computation in plain PyTorch where the
extension has no kernel for the device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .._validation import accumulation_dtype
from . import checks
from .library import _C
from .slots import BranchSlots, attend_slots, write_slots

__all__ = ["decode_step", "has_decode_kernel"]

_HAS_DECODE_OP = _C is not None and hasattr(torch.ops.dilated_attention, "decode_step")


@functools.cache
def has_decode_kernel(device_type: str) -> bool:
    """Whether the extension has a fused decode step for ``device_type`` (``"cpu"``, ``"cuda"``)."""
    if not _HAS_DECODE_OP or device_type not in ("cpu", "cuda"):
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
    return torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attention::decode_step", key)


if _HAS_DECODE_OP:

    @torch.library.register_fake("dilated_attention::decode_step")
    def _decode_step_fake(q: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The op's arguments (schema in the module docstring) checked; out (B, Hq, D), lse (B, Hq)."""
        checks.check_decode_step(q, *args)
        return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=accumulation_dtype(q.dtype))


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    layout: Sequence[BranchSlots],
    scale: float,
    *,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: write ``k``, ``v`` (B, Hkv, D) at positions ``pos`` (B,) into the
    slots, then attend ``q`` (B, Hq, D). Returns out (B, Hq, D) and lse (B, Hq).

    ``fused``: None runs the op where the extension has a kernel for the device and plain PyTorch
    elsewhere; True or False asks for one of them."""
    if fused is None:
        fused = has_decode_kernel(q.device.type)
    segs = [br.w for br in layout]
    rates = [br.r for br in layout]
    if fused:
        return torch.ops.dilated_attention.decode_step(
            q, k, v, k_cache, v_cache, pos, segs, rates, [br.length for br in layout], scale
        )
    G = q.shape[1] // k_cache.shape[1]
    lengths = pos.clamp(min=0)  # positions before the token: it is the next one
    out, lse = attend_slots(
        q[:, None], k[:, None], v[:, None], k_cache, v_cache, lengths, pos[:, None], layout, scale
    )
    write_slots(k_cache, v_cache, k[:, None], v[:, None], pos[:, None], pos[:, None] + 1, layout, G)
    return out[:, 0], lse[..., 0]
