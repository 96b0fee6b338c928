"""Checks of the modules' constructor options: token ordering, the two spellings of a size,
parameter dtypes given by name, and the ``nn.MultiheadAttention`` a module is converted from."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from .. import _validation as V
from .. import hardware

ORDERINGS = ("sequence", "hilbert")
_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "fp64": torch.float64,
}


def check_ordering(ordering: Any, grid: Any) -> tuple[str, tuple[int, int] | None]:
    """``(ordering, grid)`` checked: ``"sequence"`` without a grid, or ``"hilbert"`` with a
    ``(height, width)`` pair of ints >= 1."""
    if not isinstance(ordering, str) or ordering not in ORDERINGS:
        raise ValueError(f"ordering must be one of {', '.join(map(repr, ORDERINGS))}, got {ordering!r}")
    if ordering == "sequence":
        if grid is not None:
            raise ValueError(f"grid={grid!r} is only used with ordering='hilbert' (ordering is 'sequence')")
        return ordering, None
    if grid is None:
        raise ValueError("ordering='hilbert' needs grid=(height, width), got grid=None")
    try:
        items = list(grid)
    except TypeError:
        raise ValueError(f"grid must be a pair (height, width) of ints >= 1, got {grid!r}") from None
    if len(items) != 2 or any(
        isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1 for x in items
    ):
        raise ValueError(f"grid must be a pair (height, width) of ints >= 1, got {grid!r}")
    return ordering, (int(items[0]), int(items[1]))


def hilbert_permutation(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dilated_attention.hilbert.hilbert_permutation`, imported on first use."""
    try:
        from ..hilbert import hilbert_permutation as permutation
    except ImportError as exc:  # pragma: no cover - the module ships with the package
        raise RuntimeError(
            f"ordering='hilbert' needs dilated_attention.hilbert, which failed to import: {exc}"
        ) from exc
    return permutation(height, width)


def pick(name: str, value: Any, alias: str, alias_value: Any) -> int:
    """One size given under either of two names (``embed_dim``/``dim``), as an int >= 1."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"{name}={value!r} and {alias}={alias_value!r} disagree; give one of them")
    chosen = value if value is not None else alias_value
    if chosen is None:
        raise TypeError(f"{name} (or {alias}) is required")
    if isinstance(chosen, bool) or not isinstance(chosen, numbers.Integral) or chosen < 1:
        raise ValueError(f"{name} must be an int >= 1, got {chosen!r}")
    return int(chosen)


def resolve_dtype(dtype: Any, device: Any) -> torch.dtype | None:
    """A parameter dtype: None, a floating ``torch.dtype``, a name such as ``"bf16"``, or
    ``"auto"`` (:func:`dilated_attention.hardware.recommended_dtype` of ``device``)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype == "auto":
            return hardware.recommended_dtype(device)
        if dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"dtype must be a floating torch.dtype, 'auto' or one of {sorted(_DTYPE_NAMES)}, "
                f"got {dtype!r}"
            )
        return _DTYPE_NAMES[dtype]
    if not isinstance(dtype, torch.dtype) or dtype not in V.FLOAT_DTYPES:
        raise ValueError(f"dtype must be float16, bfloat16, float32, float64 or 'auto', got {dtype!r}")
    return dtype


def check_embed_heads(E: int, H: int) -> None:
    """``E`` a multiple of ``H`` and a head dim ``E // H`` the kernels take."""
    if E % H:
        raise ValueError(f"embed_dim ({E}) must be divisible by num_heads ({H})")
    if E // H > V.MAX_HEAD_DIM:
        raise ValueError(
            f"head dim embed_dim // num_heads = {E // H} exceeds {V.MAX_HEAD_DIM} "
            f"(embed_dim={E}, num_heads={H})"
        )


def check_torch_mha(mha: Any) -> None:
    """What every ``from_torch`` refuses: anything but an ``nn.MultiheadAttention`` (TypeError), or
    one with ``add_bias_kv``/``add_zero_attn`` (ValueError: an appended key has no place in a
    dilated pattern)."""
    if not isinstance(mha, torch.nn.MultiheadAttention):
        raise TypeError(f"mha must be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError(
            "mha was built with add_bias_kv=True or add_zero_attn=True: these append a key to the "
            "sequence, which has no place in a dilated pattern"
        )
