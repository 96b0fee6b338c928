"""What one call of the attention function may run: cross-attention is refused naming the layer,
and the values the function cannot honour are named in short (a tensor by its shape, not its
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
        f"output). Use dilated attention in decoder-only or encoder-only models; an encoder-decoder "
        f"model's cross-attention layers need a dense implementation (attn_implementation='sdpa')"
    )
