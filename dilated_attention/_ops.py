"""Loads the compiled op and gives it a fake (meta) implementation and an autograd formula.

The schema lives in ``csrc/dilated_attention.cpp``:

* ``torch.ops.dilated_attention.fwd(q, k, v, segment_lengths, dilation_rates, is_causal,
  softmax_scale) -> (out, lse)``
* ``torch.ops.dilated_attention.bwd(dout, q, k, v, out, lse, dlse, segment_lengths,
  dilation_rates, is_causal, softmax_scale) -> (dq, dk, dv)``
* ``torch.ops.dilated_attention.varlen_fwd(q, k, v, cu_seqlens, max_seqlen, segment_lengths,
  dilation_rates, is_causal, softmax_scale) -> (out, lse)``: packed sequences, q (T, Hq, D), k and
  v (T, Hkv, D), cu_seqlens int32 (S + 1,), out (T, Hq, D), lse (Hq, T)
* ``torch.ops.dilated_attention.varlen_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen,
  segment_lengths, dilation_rates, is_causal, softmax_scale) -> (dq, dk, dv)``
* ``torch.ops.dilated_attention.piece_fwd/piece_bwd``: the pieces of sequence parallelism (see
  the end of this file); CPU only.

Both backward kernels are deterministic (no atomics): the same inputs give the same bits. The
backward has no derivative of its own: a second backward (after ``create_graph=True``) raises a
``RuntimeError`` rather than returning wrong second-order gradients.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from ._autograd import no_double_backward
from ._warnings import ExtensionWarning, warn_once
from .flops import accumulation_dtype

__all__ = [
    "EXTENSION_ERROR",
    "cpu_isa",
    "has_kernel",
    "has_piece_kernel",
    "native_forward",
    "native_varlen_forward",
    "piece_backward",
    "piece_forward",
]

_REBUILD = (
    "Build it against the torch you run: `pip install --no-build-isolation -e .` (or `make install`) "
    "in the source tree, or `pip install --no-build-isolation .` for a copy"
)
_BUILD_HINT = _REBUILD + (
    ". Until then the sdpa and manual backends run (backend='auto' picks them) and native cannot"
)


def _load_extension() -> tuple[ModuleType | None, str | None]:
    """Import ``dilated_attention._C`` (which registers the op): ``(module, None)``, or ``(None, why)``."""
    name = f"{__package__}._C"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        here = os.path.dirname(os.path.abspath(__file__))
        return None, (
            f"the compiled extension {name} is not built: {here} has no _C*.so (an unbuilt source "
            f"checkout?). {_BUILD_HINT}."
        )
    except (ImportError, OSError) as exc:
        return None, (
            f"the compiled extension {name} failed to load ({type(exc).__name__}: {exc}). This usually "
            f"means it was built against another PyTorch or Python than the ones running now (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}). {_BUILD_HINT}."
        )
    built = _build_info(module)
    if built is not None and built.get("torch") != torch.__version__:
        warn_once(
            ("extension-torch", built.get("torch"), torch.__version__),
            f"dilated_attention: the compiled extension {getattr(module, '__file__', name)} was built "
            f"against torch {built.get('torch')} (CUDA {built.get('cuda')}) and runs with torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}); a mismatch can fail or crash in the "
            f"kernels. {_REBUILD}.",
            ExtensionWarning,
        )
    missing = [op for op in ("fwd", "bwd") if not hasattr(torch.ops.dilated_attention, op)]
    if missing:
        return None, (
            f"the compiled extension {getattr(module, '__file__', name)} loaded but does not register "
            f"torch.ops.dilated_attention.{', '.join(missing)} (a stale build?). {_BUILD_HINT}."
        )
    return module, None


def _build_info(module: ModuleType) -> dict[str, Any] | None:
    """What ``setup.py`` recorded beside the extension (torch, CUDA, Python), or None."""
    path = os.path.join(os.path.dirname(getattr(module, "__file__", None) or "."), "_build_info.json")
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


_C, EXTENSION_ERROR = _load_extension()
"""The loaded extension, or None; and why it could not be loaded (None when it was)."""

if EXTENSION_ERROR is not None:
    warn_once(("extension",), f"dilated_attention: {EXTENSION_ERROR}", ExtensionWarning)


def _require_extension() -> ModuleType:
    if _C is None:
        raise RuntimeError(f"dilated_attention: {EXTENSION_ERROR}")
    return _C


def has_kernel(device_type: str) -> bool:
    """Whether the compiled extension has kernels for ``device_type`` ("cpu" or "cuda").

    False for both when the extension is not loaded (see :data:`EXTENSION_ERROR`).
    """
    key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
    if _C is None:
        return False
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attention::fwd", key))


def cpu_isa() -> str:
    """The instruction set the CPU kernels run with in this process: ``"avx512"``, ``"avx2"`` or
    ``"baseline"`` (SSE2 on x86-64, the compiler's default elsewhere). The widest the CPU has, unless
    the environment variable ``DILATED_ATTENTION_CPU_ISA`` names another; a value it does not know,
    or a set the CPU lacks, raises ``ValueError`` naming it. ``RuntimeError`` when the extension is
    not loaded."""
    return str(_require_extension().cpu_isa())


def _fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, N, Hq, D = q.shape
    out = q.new_empty((B, N, Hq, D))
    lse = q.new_empty((B, Hq, N), dtype=accumulation_dtype(q.dtype))
    return out, lse


def _bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    segment_lengths: list[int],
    dilation_rates: list[int],
    is_causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.config = (list(segment_lengths), list(dilation_rates), bool(is_causal), float(softmax_scale))


def _backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    segment_lengths, dilation_rates, is_causal, softmax_scale = ctx.config
    dq, dk, dv = torch.ops.dilated_attention.bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse,
        segment_lengths,
        dilation_rates,
        is_causal,
        softmax_scale,
    )
    dq, dk, dv = no_double_backward("native", (dq, dk, dv), (dout, dlse, q, k, v))
    return dq, dk, dv, None, None, None, None


if _C is not None:
    torch.library.register_fake("dilated_attention::fwd")(_fwd_fake)
    torch.library.register_fake("dilated_attention::bwd")(_bwd_fake)
    torch.library.register_autograd("dilated_attention::fwd", _backward, setup_context=_setup_context)


def native_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused op: ``out`` (B, N, Hq, D) and ``lse`` (B, Hq, N). Differentiable.

    ``RuntimeError`` saying what to run when the extension is not loaded."""
    _require_extension()
    return torch.ops.dilated_attention.fwd(
        q, k, v, list(segment_lengths), list(dilation_rates), bool(is_causal), float(softmax_scale)
    )


# ---------------------------------------------------------------------------------------------
# Pieces of a segment that spans ranks (dilated_attention.ring): dense attention of nq queries
# over nk keys; with is_causal, key j is visible to query i when j <= i + causal_offset.
#   piece_fwd(q, k, v, is_causal, causal_offset, softmax_scale) -> (out, lse)
#   piece_bwd(dout, q, k, v, out, lse, dlse, is_causal, causal_offset, softmax_scale) -> (dq, dk, dv)
# q (B, nq, Hq, D), k and v (B, nk, Hkv, D); out (B, nq, Hq, D), lse (B, Hq, nq). The backward
# takes any out/lse (for the ring: the merged ones of the rows) and is exact for them.
# ---------------------------------------------------------------------------------------------

_HAS_PIECE_OP = _C is not None and hasattr(torch.ops.dilated_attention, "piece_fwd")


def has_piece_kernel(device_type: str) -> bool:
    """Whether the extension has the piece kernels (``piece_fwd``/``piece_bwd``) for ``device_type``.

    ``"cpu"``: true whenever the extension is loaded; ``"cuda"``: true when it was built with its
    CUDA kernels (as :func:`has_kernel`); false for any other device type.
    """
    if not _HAS_PIECE_OP or device_type not in ("cpu", "cuda"):
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
    return torch._C._dispatch_has_kernel_for_dispatch_key("dilated_attention::piece_fwd", key)


if _HAS_PIECE_OP:
    _piece_fwd = torch.ops.dilated_attention.piece_fwd
    _piece_bwd = torch.ops.dilated_attention.piece_bwd

    @torch.library.register_fake("dilated_attention::piece_fwd")
    def _piece_fwd_fake(q, k, v, is_causal, causal_offset, softmax_scale):
        B, nq, Hq, D = q.shape
        return q.new_empty((B, nq, Hq, D)), q.new_empty((B, Hq, nq), dtype=accumulation_dtype(q.dtype))

    @torch.library.register_fake("dilated_attention::piece_bwd")
    def _piece_bwd_fake(dout, q, k, v, out, lse, dlse, is_causal, causal_offset, softmax_scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _piece_setup_context(ctx, inputs, output):
        q, k, v, is_causal, causal_offset, softmax_scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.config = (bool(is_causal), int(causal_offset), float(softmax_scale))

    def _piece_backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _piece_bwd(dout, q, k, v, out, lse, dlse, *ctx.config)
        return dq, dk, dv, None, None, None

    torch.library.register_autograd(
        "dilated_attention::piece_fwd", _piece_backward, setup_context=_piece_setup_context
    )


def piece_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    causal_offset: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of q (B, nq, Hq, D) over k, v (B, nk, Hkv, D): ``out`` (B, nq, Hq, D) and
    ``lse`` (B, Hq, nq); with ``is_causal``, key ``j`` is visible to query ``i`` when
    ``j <= i + causal_offset``. Differentiable."""
    return _piece_fwd(q, k, v, bool(is_causal), int(causal_offset), float(softmax_scale))


def piece_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    is_causal: bool,
    causal_offset: int,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`piece_forward` for the given ``out``/``lse`` (which may be merged
    results over more keys than ``k``: the gradients are then this piece's share)."""
    return _piece_bwd(
        dout, q, k, v, out, lse, dlse, bool(is_causal), int(causal_offset), float(softmax_scale)
    )


def _varlen_fwd_fake(
    q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, is_causal, softmax_scale
):
    T, Hq, D = q.shape
    out = q.new_empty((T, Hq, D))
    lse = q.new_empty((Hq, T), dtype=accumulation_dtype(q.dtype))
    return out, lse


def _varlen_bwd_fake(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    cu_seqlens,
    max_seqlen,
    segment_lengths,
    dilation_rates,
    is_causal,
    softmax_scale,
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, is_causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.config = (
        int(max_seqlen),
        list(segment_lengths),
        list(dilation_rates),
        bool(is_causal),
        float(softmax_scale),
    )


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    max_seqlen, segment_lengths, dilation_rates, is_causal, softmax_scale = ctx.config
    dq, dk, dv = torch.ops.dilated_attention.varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse,
        cu_seqlens,
        max_seqlen,
        segment_lengths,
        dilation_rates,
        is_causal,
        softmax_scale,
    )
    return dq, dk, dv, None, None, None, None, None, None


if _C is not None:
    torch.library.register_fake("dilated_attention::varlen_fwd")(_varlen_fwd_fake)
    torch.library.register_fake("dilated_attention::varlen_bwd")(_varlen_bwd_fake)
    torch.library.register_autograd(
        "dilated_attention::varlen_fwd", _varlen_backward, setup_context=_varlen_setup_context
    )


def native_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused packed op: ``out`` (T, Hq, D) and ``lse`` (Hq, T). Differentiable.

    ``RuntimeError`` saying what to run when the extension is not loaded."""
    _require_extension()
    return torch.ops.dilated_attention.varlen_fwd(
        q,
        k,
        v,
        cu_seqlens,
        int(max_seqlen),
        list(segment_lengths),
        list(dilation_rates),
        bool(is_causal),
        float(softmax_scale),
    )
