"""The attention function and the mask function that :mod:`dilated_attention.transformers`
registers with transformers, and the configuration they read (``config.dilated_attention``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
)

from .. import _validation as V
from .._padding import pack_padding_mask
from ..backends import check_backend_name
from ..decode import dilated_attention_decode
from ..functional import dilated_attention
from ..modules.dilated import attention_rows
from .layers import (
    cross_attention_reason,
    dense_cross_attention,
    describe,
    refuse_cross_attention,
    refuse_unknown_key_source,
    self_attention_is_causal,
    unknown_key_source,
)

__all__ = [
    "DEFAULT_CONFIG",
    "NAME",
    "cross_attention_mode",
    "dilated_attention_forward",
    "dilated_attention_mask",
    "padded_attention",
    "settings",
]

logger = logging.getLogger(__name__)

NAME = "dilated_attention"
# LongNet's configuration (Ding et al. 2023, section 4.1): used where a config sets none.
DEFAULT_CONFIG: dict[str, Any] = {
    "segment_lengths": [2048, 4096, 8192, 16384, 32768],
    "dilation_rates": [1, 2, 4, 6, 12],
    "backend": "auto",
    # "refuse": a cross-attention layer is a ValueError; "dense": it runs dense (SDPA).
    "cross_attention": "refuse",
}
# Attention arguments of some models that change what is computed and that we cannot honour.
_UNSUPPORTED = ("softcap", "sliding_window", "s_aux", "position_bias")


def refuse_unsupported(kwargs: dict[str, Any]) -> None:
    """ValueError naming the first of the model's attention arguments that dilated attention cannot
    honour (:data:`_UNSUPPORTED`), given as not None."""
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"dilated attention cannot honour the model's {name}={describe(kwargs[name])}")


def settings(config: Any) -> tuple[list[int], list[int], str]:
    """``(segment_lengths, dilation_rates, backend)`` from ``config.dilated_attention`` (a dict),
    each key defaulting to :data:`DEFAULT_CONFIG`'s."""
    raw = getattr(config, "dilated_attention", None)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise TypeError(f"config.dilated_attention must be a dict, got {type(raw).__name__}: {raw!r}")
    unknown = sorted(set(raw) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(
            f"config.dilated_attention has unknown keys {unknown}; expected some of {sorted(DEFAULT_CONFIG)}"
        )
    merged = {**DEFAULT_CONFIG, **raw}
    segs, rates = V.normalize_branches(merged["segment_lengths"], merged["dilation_rates"])
    cross_attention_mode(config)  # checked with the rest, not first when a cross-attention layer runs
    return segs, rates, check_backend_name(merged["backend"])


def cross_attention_mode(config: Any) -> str:
    """``config.dilated_attention['cross_attention']``: ``"refuse"`` (the default) or ``"dense"``."""
    raw = getattr(config, "dilated_attention", None) or {}
    mode = (
        raw.get("cross_attention", DEFAULT_CONFIG["cross_attention"]) if isinstance(raw, dict) else "refuse"
    )
    if mode not in ("refuse", "dense"):
        raise ValueError(
            f"config.dilated_attention['cross_attention'] must be 'refuse' or 'dense', got {mode!r}"
        )
    return mode


def _runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, ends)`` (B,) of each row's run of real tokens in a (B, N) bool mask; an empty
    row gives ``start = end = N``. A row whose real tokens are not contiguous is a ValueError."""
    N = mask.shape[1]
    idx = torch.arange(N, device=mask.device)
    count = mask.sum(dim=1)
    first = torch.where(mask, idx, N).amin(dim=1)
    last = torch.where(mask, idx, -1).amax(dim=1)
    broken = (count > 0) & (last - first + 1 != count)
    if bool(broken.any()):
        row = int(broken.nonzero()[0, 0])
        raise ValueError(
            f"the padding mask's real tokens must be contiguous in every row (left or right padding); "
            f"row {row} is {mask[row].int().tolist()}"
        )
    empty = count == 0
    return torch.where(empty, N, first), torch.where(empty, N, last + 1)


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    *,
    is_causal: bool,
    softmax_scale: float | None,
    dropout_p: float,
    backend: str,
) -> torch.Tensor:
    """Dilated attention of a padded batch (SPEC section 7): q (B, N, Hq, D), k, v (B, N, Hkv, D),
    ``mask`` (B, N) bool, True = a real token. Each row's run of real tokens is a sequence of its
    own starting at position 0; padded positions give 0 (and zero gradients). Returns (B, N, Hq, D).

    The rows' real tokens go to the packed (varlen) form of the functional API in one call: no work
    on padded positions.
    """
    B, N = q.shape[:2]
    kw: dict[str, Any] = {
        "is_causal": is_causal,
        "softmax_scale": softmax_scale,
        "dropout_p": dropout_p,
        "backend": backend,
    }
    rows = pack_padding_mask(mask, B, N, q.device)
    if rows.full:  # nothing is padded
        return dilated_attention(q, k, v, segment_lengths, dilation_rates, **kw)
    return attention_rows(rows, q, k, v, segment_lengths, dilation_rates, lengths=rows.lengths, **kw)


def dilated_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query (B, Hq, q_len, D), key and value
    (B, Hkv, kv_len, D) (the whole cache when generating), ``attention_mask`` as made by
    :func:`dilated_attention_mask`. Returns ``(out, None)``, out (B, q_len, Hq, D)."""
    refuse_unsupported(kwargs)
    if kwargs.get("output_attentions"):
        logger.warning("dilated attention returns no attention weights (output_attentions=True)")
    config = getattr(module, "config", None)
    segs, rates, backend = settings(config)
    if unknown_key_source(module):
        raise refuse_unknown_key_source(module)
    causal = bool(is_causal) if is_causal is not None else self_attention_is_causal(module, config)
    q_len, kv_len = query.shape[2], key.shape[2]
    cross = cross_attention_reason(module, causal, q_len, kv_len)
    if cross is not None:
        if cross_attention_mode(config) != "dense":
            raise refuse_cross_attention(module, cross)
        out = dense_cross_attention(query, key, value, attention_mask, scaling, dropout, is_causal=causal)
        return out, None
    mask = attention_mask
    if mask is not None and (
        not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.dtype != torch.bool
    ):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"dilated attention takes the (B, N) bool padding mask that its mask function makes, got "
            f"{shape}; a ready-made 4-D mask (or another attention implementation's mask) cannot be "
            f"honoured"
        )
    used = kv_len if mask is None else mask.shape[1]  # cache slots in use (a static cache has more)
    if not q_len <= used <= kv_len:
        raise ValueError(f"{q_len} queries and {used} keys in use do not fit {kv_len} keys")
    q = query.transpose(1, 2)  # (B, q_len, Hq, D)
    k = key.transpose(1, 2)[:, :used]  # (B, used, Hkv, D)
    v = value.transpose(1, 2)[:, :used]
    if q_len == used:  # whole sequences: training, a forward, or the prefill of generate()
        kw: dict[str, Any] = {
            "is_causal": causal,
            "softmax_scale": scaling,
            "dropout_p": dropout,
            "backend": backend,
        }
        if mask is None:
            return dilated_attention(q, k, v, segs, rates, **kw), None
        return padded_attention(q, k, v, mask, segs, rates, **kw), None
    if dropout > 0:
        raise ValueError(f"decoding with a cache runs without attention dropout, got dropout={dropout}")
    if mask is None:
        return dilated_attention_decode(q, k, v, used, segs, rates, softmax_scale=scaling), None
    starts, ends = _runs(mask)
    out = dilated_attention_decode(q, k, v, used, segs, rates, cache_leftpad=starts, softmax_scale=scaling)
    slots = used - q_len + torch.arange(q_len, device=q.device)
    real = (slots[None, :] < ends[:, None])[..., None, None]  # right padding among the new tokens
    return out * real, None


def dilated_attention_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int = 0,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Any = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    cache_position: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask-function interface: None when every cache slot in use holds a real
    token, else a (B, q_offset + q_length) bool mask of the slots in use (True = a real token) for
    :func:`dilated_attention_forward`. Only the causal and bidirectional patterns are accepted.
    Releases before 5.4 give the queries' ``cache_position`` instead of ``q_length``/``q_offset``."""
    if q_length is None:
        if cache_position is None:
            raise TypeError("dilated_attention_mask needs q_length (or the cache_position of the queries)")
        q_length = int(cache_position.shape[0])
        q_offset = int(cache_position[0]) if q_length else 0
        device = cache_position.device if device is None else device
    device = "cpu" if device is None else device
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        raise ValueError(
            f"dilated attention runs causal or bidirectional self-attention with a padding mask; this "
            f"model asks for another pattern, {_describe_mask(mask_function)} (a sliding window, chunks, "
            f"packed sequences or a custom overlay), which it cannot honour"
        )
    if int(kv_offset) != 0:
        raise ValueError(
            f"dilated attention needs the whole sequence in the cache, got kv_offset={kv_offset}"
        )
    used = int(q_offset) + q_length
    if mask_function is bidirectional_mask_function and used != kv_length:
        # Cross-attention (the keys are another sequence's): the attention function refuses it by
        # the layer's name. Its padding mask covers the keys, not the queries.
        if attention_mask is None:
            return None
        return prepare_padding_mask(attention_mask.to(device=device, dtype=torch.bool), kv_length, 0)
    if attention_mask is None:
        if used == kv_length:
            return None
        return torch.ones(batch_size, used, dtype=torch.bool, device=device)
    padding = prepare_padding_mask(attention_mask.to(device=device, dtype=torch.bool), kv_length, 0)
    assert padding is not None  # None only for a None mask
    padding = padding[:, :used]
    if padding.shape[1] != used:
        raise ValueError(f"the attention mask covers {padding.shape[1]} positions, the model {used}")
    return None if used == kv_length and bool(padding.all()) else padding


def _describe_mask(fn: Any, depth: int = 0) -> str:
    """A mask function as transformers composes it, with the values it closes over:
    ``and_mask(sliding_window_overlay(sliding_window=8), causal_mask_function)``."""
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    name = qualname.split(".<locals>.")[0] if ".<locals>." in qualname else qualname
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None or not cells or depth > 4:
        return name
    parts = []
    for var, cell in zip(code.co_freevars, cells, strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value):
            parts.append(_describe_mask(value, depth + 1))
        elif isinstance(value, (tuple, list)) and all(callable(v) for v in value):
            parts.extend(_describe_mask(v, depth + 1) for v in value)
        elif isinstance(value, (int, float, str, bool)):
            parts.append(f"{var}={value!r}")
    return f"{name}({', '.join(parts)})" if parts else name
