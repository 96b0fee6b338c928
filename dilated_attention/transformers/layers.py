"""What one call of the attention function may run: cross-attention is refused naming the layer
(or runs dense where the config opts in), and the values the function cannot honour are named in short (a tensor by its shape, not its
entries).

Whether a call is cross-attention is decided by where its keys come from. transformers passes the
attention function only the projected query, key and value, so for the layers that take the
states of their keys as an argument of their own ``forward`` (``key_value_states`` in BART,
Whisper, NLLB-MoE, BigBirdPegasus, ...; ``encoder_hidden_states``), :func:`watch_key_sources` adds
hooks that note, for the duration of each call, whether that argument was given."""

from __future__ import annotations

import functools
import inspect
from typing import Any, cast

import torch


def describe(value: Any) -> str:
    """A short description of ``value`` for an error message: a tensor by its shape and dtype
    (its entries would fill the screen), anything else by its repr, cut to 80 characters."""
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)}, {str(value.dtype).removeprefix('torch.')}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def layer_name(module: Any) -> str:
    """The attention layer's class, with its ``layer_idx`` where it has one."""
    name = type(module).__name__
    idx = getattr(module, "layer_idx", None)
    return name if idx is None else f"{name} (layer_idx={idx})"


# The arguments of an attention layer's forward that carry the states its keys and values come
# from when these are not the layer's own input (an encoder's output).
KEY_SOURCES = ("key_value_states", "encoder_hidden_states")
_SOURCE = "_dilated_attention_keys_from"  # set for the duration of a call by the hooks below
_WATCHED = "_dilated_attention_watched"


@functools.cache
def _source_parameter(cls: Any) -> tuple[str, int | None] | None:
    """``(name, positional index)`` of the argument of ``cls.forward`` named in
    :data:`KEY_SOURCES` (index None where it is keyword-only), or None where it has none."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(params):
        if p.name in KEY_SOURCES:
            return p.name, (i if p.kind in positional else None)
    return None


def _note_key_source(
    name: str, index: int | None, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Forward pre-hook: notes on ``module`` the argument ``name`` when this call was given it
    (the keys come from another sequence), else False (they come from the layer's own input)."""
    given = (
        kwargs.get(name)
        if name in kwargs
        else (args[index] if index is not None and index < len(args) else None)
    )
    module.__dict__[_SOURCE] = name if given is not None else False


def _forget_key_source(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook (run even when the call raises): the note holds for one call only."""
    module.__dict__.pop(_SOURCE, None)


def watch_key_sources(model: torch.nn.Module) -> None:
    """Hooks on each attention layer of ``model`` that takes the states of its keys as a
    ``forward`` argument (:data:`KEY_SOURCES`) and does not mark itself ``is_cross_attention``:
    during each call :func:`key_source` says whether the keys come from the layer's own input
    (self-attention) or from the states given (cross-attention). Idempotent."""
    for module in model.modules():
        if module.__dict__.get(_WATCHED) or getattr(module, "is_cross_attention", None) is not None:
            continue
        if "attention" not in type(module).__name__.lower():
            continue
        found = _source_parameter(cast(Any, type(module)))
        if found is None:
            continue
        module.register_forward_pre_hook(functools.partial(_note_key_source, *found), with_kwargs=True)
        module.register_forward_hook(_forget_key_source, always_call=True)
        module.__dict__[_WATCHED] = True


def key_source(module: Any) -> str | bool | None:
    """Where the keys of the current call of ``module`` come from, as noted by
    :func:`watch_key_sources`: the name of the argument that gave them (another sequence's
    states), False (the layer's own input), or None where the call was not seen."""
    return getattr(module, "__dict__", {}).get(_SOURCE)


def cross_attention_reason(module: Any, causal: bool, q_len: int, kv_len: int) -> str | None:
    """Why this call looks like cross-attention (queries of one sequence against the keys of
    another), or None. Dilated attention is defined over one sequence, so such a call is refused.

    The signals, from the module (transformers marks its cross-attention layers in one of these
    ways), from where the call's keys come from and from the shapes:

    * ``module.is_cross_attention`` is True (GPT-2, BERT-style, CLIP-style layers);
    * the class name says so (``BertCrossAttention``, ``MllamaTextCrossAttention``);
    * the call was given the states its keys come from (``key_value_states`` or
      ``encoder_hidden_states``, :func:`key_source`: the ``encoder_attn`` of BART, Whisper,
      Marian, NLLB-MoE, BigBirdPegasus, ...). A call without them is self-attention, whatever the
      layer's flags: a decoder's self-attention may be built ``is_decoder=True, is_causal=False``
      and take its causality from the mask (BigBirdPegasus, NLLB-MoE, Pegasus-X);
    * bidirectional attention of ``q_len`` queries against ``kv_len != q_len`` keys (no cache of
      self-attention is bidirectional), or more queries than keys.
    """
    if getattr(module, "is_cross_attention", False) is True:
        return "the layer is marked is_cross_attention=True"
    if "crossattention" in type(module).__name__.lower().replace("_", ""):
        return "the layer's class is a cross-attention class"
    source = key_source(module)
    if source:
        return f"the call was given {source}, the states of another sequence, for its keys"
    if not causal and q_len != kv_len:
        return f"{q_len} queries attend bidirectionally to {kv_len} keys"
    if q_len > kv_len:
        return f"{q_len} queries attend to {kv_len} keys"
    return None


def unknown_key_source(module: Any) -> bool:
    """True for a decoder's non-causal layer (``is_decoder=True, is_causal=False``) whose call
    :func:`watch_key_sources` did not see: it may be cross-attention or a self-attention that takes
    its causality from the mask, and nothing in the call tells which, so it is refused whatever
    ``cross_attention`` says (built with or switched to the implementation through transformers,
    the model's layers are watched)."""
    return (
        key_source(module) is None
        and getattr(module, "is_decoder", False) is True
        and getattr(module, "is_causal", None) is False
    )


def self_attention_is_causal(module: Any, config: Any) -> bool:
    """Whether a self-attention call of ``module`` (its keys from its own input) is causal when the
    call does not say: ``module.is_causal`` where it is True; for a decoder's layer built
    ``is_decoder=True, is_causal=False`` (BigBirdPegasus, NLLB-MoE, Pegasus-X), whose causality
    comes from the mask, what that mask is: transformers' ``create_causal_mask`` makes it causal
    unless ``config.is_causal`` is False; otherwise ``module.is_causal`` (True where the layer has
    no such attribute)."""
    if getattr(module, "is_causal", None) is True:
        return True
    if getattr(module, "is_decoder", False) is True and key_source(module) is False:
        return getattr(config, "is_causal", True) is not False
    return bool(getattr(module, "is_causal", True))


def refuse_unknown_key_source(module: Any) -> ValueError:
    """The error for a call of a layer that :func:`unknown_key_source` cannot place."""
    if _source_parameter(cast(Any, type(module))) is None:
        why = (
            f"its forward takes no {' or '.join(KEY_SOURCES)} argument that would tell. Use another "
            f"attn_implementation for this model"
        )
    else:
        why = (
            "the integration watches the layers of a model built with this attn_implementation "
            "(from_config, from_pretrained) or switched to it (set_attn_implementation), and this call "
            "was made outside one (a layer added or called on its own, or config._attn_implementation "
            "set by hand). Build or switch the model through transformers"
        )
    return ValueError(
        f"dilated attention cannot tell whether {layer_name(module)}, a decoder's attention built "
        f"is_decoder=True, is_causal=False, attends to its own input (causal self-attention, its "
        f"causality given by the mask) or to another sequence (cross-attention): {why}"
    )


def refuse_cross_attention(module: Any, reason: str) -> ValueError:
    """The error for a cross-attention call, naming the layer and why it was taken for one."""
    return ValueError(
        f"dilated attention cannot run the cross-attention of {layer_name(module)} ({reason}): it is "
        f"defined over one sequence, and the keys of this layer come from another (e.g. an encoder's "
        f"output). Set config.dilated_attention['cross_attention'] = 'dense' to run the "
        f"cross-attention layers as dense attention (the self-attention stays dilated), or use "
        f"another attn_implementation for this model"
    )


def dense_cross_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    is_causal: bool = False,
) -> torch.Tensor:
    """Dense attention of query (B, Hq, nq, D) over every key of key, value (B, Hkv, nk, D), for the
    cross-attention layers a user opted into (``cross_attention='dense'``): ``mask`` None or the
    (B, nk) bool padding mask of the keys (True = a real key). A call that is causal keeps its
    causal mask: query ``i`` sits at position ``nk - nq + i`` and reads the keys up to it (as
    transformers' causal mask places the queries after a cache). Returns (B, nq, Hq, D)."""
    nq, nk = query.shape[2], key.shape[2]
    if mask is not None and (mask.dim() != 2 or mask.dtype != torch.bool or mask.shape[1] != nk):
        raise ValueError(
            f"cross-attention takes a (B, {nk}) bool padding mask of the keys, got "
            f"{tuple(mask.shape)} {mask.dtype}"
        )
    attn_mask = None if mask is None else mask[:, None, None, :]
    if is_causal:
        if nq > nk:
            raise ValueError(
                f"a causal call of {nq} queries over {nk} keys leaves the first queries no key to read"
            )
        pos = torch.arange(nk, device=query.device)
        allowed = pos[None, :] <= (nk - nq + torch.arange(nq, device=query.device))[:, None]  # (nq, nk)
        attn_mask = allowed[None, None] if attn_mask is None else attn_mask & allowed
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2)
