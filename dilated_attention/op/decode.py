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
    def _decode_step_fake(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: torch.Tensor,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        slot_lengths: Sequence[int],
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # check_decode_step of csrc/cpu/decode_cpu.cpp, the same errors; not the positions' values (data)
        checks._require(
            q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
            "decode_step: q (B, Hq, D), k and v (B, Hkv, D) must be 3-D, got "
            f"q {checks._shape(q)}, k {checks._shape(k)}, v {checks._shape(v)}",
        )
        checks._require(
            k_cache.dim() == 4 and checks._same_shape(k_cache, v_cache),
            "decode_step: k_cache and v_cache must be (B, Hkv, T, D) of one shape, got "
            f"{checks._shape(k_cache)} and {checks._shape(v_cache)}",
        )
        B, Hq, D, Hkv = q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1]
        agree = checks._all(
            checks._same_shape(k, v),
            k.shape[0] == B,
            k.shape[1] == Hkv,
            k.shape[2] == D,
            k_cache.shape[0] == B,
            k_cache.shape[3] == D,
        ) and (Hkv > 0 and Hq % Hkv == 0)
        checks._require(
            agree,
            "decode_step: shapes must agree (q (B, Hq, D), k, v (B, Hkv, D), caches (B, Hkv, T, D), Hq a "
            "multiple of Hkv), got q "
            f"{checks._shape(q)}, k {checks._shape(k)}, k_cache {checks._shape(k_cache)}",
        )
        checks._check_dtype(q, "decode_step")
        checks._require(
            checks._all(D >= 1, D <= checks.DA_MAX_HEAD_DIM),
            f"decode_step: head dim must be in [1, {checks.DA_MAX_HEAD_DIM}], got {D}",
        )
        checks._check_scale(softmax_scale, q.dtype, "decode_step")
        for t in (k, v, k_cache, v_cache):
            checks._require(
                t.dtype == q.dtype and t.device == q.device,
                "decode_step: every tensor must have q's dtype and device "
                f"({checks._dtype(q.dtype)}, {checks._device(q)}), "
                f"got {checks._dtype(t.dtype)}, {checks._device(t)}",
            )
        checks._require(
            k_cache.is_contiguous() and v_cache.is_contiguous(),
            "decode_step: k_cache and v_cache must be contiguous",
        )
        checks._require(
            pos.dim() == 1 and pos.shape[0] == B and pos.dtype == torch.int64,
            "decode_step: pos must be an int64 (B,) tensor, got "
            f"{checks._dtype(pos.dtype)} {checks._shape(pos)}",
        )
        checks._require(
            pos.device == q.device,
            f"decode_step: pos must be on q's device {checks._device(q)}, got {checks._device(pos)}",
        )
        segs, rates, lengths = list(segment_lengths), list(dilation_rates), list(slot_lengths)
        checks._require(
            len(segs) == len(rates) == len(lengths) and len(segs) > 0,
            "decode_step: segment_lengths, dilation_rates and slot_lengths must have one entry per branch",
        )
        G = Hq // Hkv
        total: Any = 0
        for i, (w, r, n) in enumerate(zip(segs, rates, lengths, strict=True)):
            checks._require(
                1 <= r <= w and 1 <= n <= (w + r - 1) // r,
                f"decode_step: branch {i} must have 1 <= r <= w and 1 <= slots <= ceil(w / r), got w={w} "
                f"r={r} slots={n}",
            )
            total = total + min(G, r) * n
        checks._require(
            k_cache.shape[2] == total,
            f"decode_step: the caches must have {total} slots for these branches, got {k_cache.shape[2]}",
        )
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
