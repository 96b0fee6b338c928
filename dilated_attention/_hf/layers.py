"""What one call of the attention function may run: cross-attention is refused naming the layer
(or runs dense where the config opts in), and the values the function cannot honour are named in short (a tensor by its shape, not its
entries)."""

from __future__ import annotations

from typing import Any

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


def cross_attention_reason(module: Any, causal: bool, q_len: int, kv_len: int) -> str | None:
    """Why this call looks like cross-attention (queries of one sequence against the keys of
    another), or None. Dilated attention is defined over one sequence, so such a call is refused.

    The signals, from the module (transformers marks its cross-attention layers in one of these
    ways) and from the shapes:

    * ``module.is_cross_attention`` is True (GPT-2, BERT-style, CLIP-style layers);
    * the class name says so (``BertCrossAttention``, ``MllamaTextCrossAttention``);
    * a decoder layer that is not causal (``is_decoder=True, is_causal=False``: the ``encoder_attn``
      of BART, Whisper, Marian, T5, ...);
    * bidirectional attention of ``q_len`` queries against ``kv_len != q_len`` keys (no cache of
      self-attention is bidirectional), or more queries than keys.
    """
    if getattr(module, "is_cross_attention", False) is True:
        return "the layer is marked is_cross_attention=True"
    if "crossattention" in type(module).__name__.lower().replace("_", ""):
        return "the layer's class is a cross-attention class"
    if getattr(module, "is_decoder", False) is True and getattr(module, "is_causal", None) is False:
        return "the layer is a decoder's non-causal attention (is_decoder=True, is_causal=False)"
    if not causal and q_len != kv_len:
        return f"{q_len} queries attend bidirectionally to {kv_len} keys"
    if q_len > kv_len:
        return f"{q_len} queries attend to {kv_len} keys"
    return None


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
) -> torch.Tensor:
    """Dense attention of query (B, Hq, nq, D) over every key of key, value (B, Hkv, nk, D), for the
    cross-attention layers a user opted into (``cross_attention='dense'``): ``mask`` None or the
    (B, nk) bool padding mask of the keys (True = a real key). Returns (B, nq, Hq, D)."""
    if mask is not None and (mask.dim() != 2 or mask.dtype != torch.bool or mask.shape[1] != key.shape[2]):
        raise ValueError(
            f"cross-attention takes a (B, {key.shape[2]}) bool padding mask of the keys, got "
            f"{tuple(mask.shape)} {mask.dtype}"
        )
    attn_mask = None if mask is None else mask[:, None, None, :]
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
