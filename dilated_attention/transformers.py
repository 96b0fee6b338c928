"""Dilated attention inside HuggingFace ``transformers`` models (the optional extra ``transformers``).

Importing this module registers, under the name ``"dilated_attention"``, an attention function
with transformers' ``AttentionInterface`` and a mask function with its ``AttentionMaskInterface``::

    import dilated_attention.transformers  # noqa: F401  (registers "dilated_attention")
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(..., dilated_attention={"segment_lengths": [2048, 4096], "dilation_rates": [1, 2]})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dilated_attention")

The branches come from ``config.dilated_attention`` (keys ``segment_lengths``, ``dilation_rates``,
``backend``; :data:`DEFAULT_CONFIG` where absent). What the model asks for is honoured or refused,
never dropped:

* causal or bidirectional self-attention, grouped-query attention, ``scaling``, attention dropout;
* padding (SPEC section 7): each row's contiguous run of real tokens, left or right padded, is a
  sequence of its own starting at position 0; padded positions give 0. A mask whose real tokens
  are not contiguous is a ``ValueError`` naming the row;
* the key/value cache of ``generate()``: the new tokens attend to the cache through
  :func:`dilated_attention.dilated_attention_decode`, reading ``O(sum w_i / r_i)`` keys each;
* a pattern it cannot run (sliding window, chunked attention, packed sequences given by
  ``position_ids``, a custom mask overlay or a ready-made 4-D mask, soft-capping, attention sinks,
  a position bias) is a ``ValueError``;
* cross-attention (an encoder-decoder's decoder attending to the encoder, ``add_cross_attention``)
  is a ``ValueError`` naming the layer: dilated attention is defined over one sequence. With
  ``config.dilated_attention["cross_attention"] = "dense"`` those layers run dense (SDPA) instead.
  A call is cross-attention by what it attends to (a layer marked so, or a call given the states of
  its keys, ``key_value_states``), not by the layer's flags: a decoder's self-attention built
  ``is_decoder=True, is_causal=False`` (BigBirdPegasus, NLLB-MoE) runs dilated and causal, as the
  causal mask transformers makes for it says;
* a model whose attention layers do not call transformers' attention interface (BLOOM, CodeGen,
  Falcon, ...), or that has no attention layer (Mamba, RWKV), is a ``ValueError`` naming its
  class when built with or switched to it (:mod:`dilated_attention._hf.dispatch`);
* switching a model with trained (dense) weights warns once (:class:`DenseWeightsWarning`): unlike
  eager/SDPA/FlashAttention, dilated attention computes another function.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ._hf import TESTED_VERSIONS

try:
    import transformers as _transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        prepare_padding_mask,
    )
except ImportError as exc:  # the package imports without transformers; this module needs it
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = f"transformers {version('transformers')} is installed, but "
    except PackageNotFoundError:
        found = ""
    raise ImportError(
        f"dilated_attention.transformers needs the transformers package{TESTED_VERSIONS}: {found}"
        f"pip install 'dilated-attention[transformers]' ({exc})"
    ) from exc

from . import _validation as V
from ._hf import dispatch as _dispatch
from ._hf.dispatch import dispatch_problem
from ._hf.layers import (
    cross_attention_reason,
    dense_cross_attention,
    describe,
    refuse_cross_attention,
    refuse_unknown_key_source,
    self_attention_is_causal,
    unknown_key_source,
)
from ._padding import pack_padding_mask
from ._warnings import DenseWeightsWarning, VersionWarning, warn_once
from .backends import check_backend_name
from .decode import dilated_attention_decode
from .functional import _attention_varlen, dilated_attention

__all__ = [
    "DEFAULT_CONFIG",
    "NAME",
    "TESTED_VERSIONS",
    "DenseWeightsWarning",
    "cross_attention_mode",
    "describe",
    "dilated_attention_forward",
    "dilated_attention_mask",
    "dispatch_problem",
    "padded_attention",
    "register",
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
    out = _attention_varlen(
        rows.gather(q),
        rows.gather(k),
        rows.gather(v),
        rows.cu_seqlens,
        rows.max_seqlen,
        segment_lengths,
        dilation_rates,
        lengths=rows.lengths,
        **kw,
    )  # (T, Hq, D)
    assert isinstance(out, torch.Tensor)  # return_lse is False
    return rows.scatter(out, B, N)


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
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"dilated attention cannot honour the model's {name}={describe(kwargs[name])}")
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


def register(name: str = NAME) -> str:
    """Register the attention function and the mask function under ``name`` (done for
    ``"dilated_attention"`` on import); returns ``name`` for ``attn_implementation=``.

    ``name`` must be a non-empty string that does not name one of transformers' own
    implementations (``"eager"``, ``"sdpa"``, ``"flash_attention_2"``, ...): registering over one
    would make every model that asks for it run dilated attention. ValueError otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register: name must be a non-empty string, got {name!r}")
    builtin = _builtin_implementations()
    if name in builtin:
        raise ValueError(
            f"register: {name!r} is one of transformers' own attention implementations "
            f"({', '.join(sorted(builtin))}); registering over it would make every model that asks for "
            "it run dilated attention. Choose another name"
        )
    AttentionInterface.register(name, dilated_attention_forward)
    AttentionMaskInterface.register(name, dilated_attention_mask)
    _dispatch.NAMES.add(name)
    _dispatch.install(settings)
    return name


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


def _builtin_implementations() -> set[str]:
    """The attention implementations transformers itself defines (before any registration)."""
    names = {"eager", *getattr(AttentionMaskInterface, "_global_mapping", {})}
    names |= set(getattr(AttentionInterface, "_global_mapping", {}))
    names = {part for n in names for part in n.split("|")}  # "paged|eager"
    return names - _dispatch.NAMES


def _check_version() -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(_transformers.__version__) not in SpecifierSet(TESTED_VERSIONS):
        warn_once(
            ("transformers-version", _transformers.__version__),
            f"dilated_attention.transformers is tested with transformers{TESTED_VERSIONS}, found "
            f"{_transformers.__version__}: its attention and mask interfaces may differ",
            VersionWarning,
        )


_check_version()
register()
