"""``nn.MultiheadAttention``'s masks, read for :class:`DropInMultiheadAttention`, and the masks of
:class:`MultiheadDilatedAttention` (its float ``key_padding_mask`` and ``attn_mask`` in torch's
convention, its bool and integer ones in this library's, refused where torch's layers pass theirs).

torch's conventions: ``key_padding_mask`` (B, S) bool, **True = padding** (a key to ignore), or
float, added to the scores (``-inf`` = padding, 0 = a real key: what ``nn.TransformerEncoderLayer``
passes after ``F._canonical_mask``); ``attn_mask`` (L, S) or (B * num_heads, L, S), bool (True =
not allowed) or float (added). Dilated attention chooses the keys of a query by its pattern, so of
the dense masks only the causal one (and the mask that masks nothing) has a meaning here.
"""

from __future__ import annotations

from typing import Any

import torch

from .._padding import has_no_data

__all__ = [
    "causal_from_attn_mask",
    "multihead_real_tokens",
    "real_tokens_from_torch_mask",
    "refuse_torch_layer_mask",
]


def real_tokens_from_torch_mask(mask: Any, B: int, S: int, batched: bool) -> torch.Tensor | None:
    """torch's ``key_padding_mask`` (True / -inf = padding) as this library's (B, S) bool mask,
    **True = a real token**; None when ``mask`` is None. A float mask must hold only 0 and -inf
    (other values are a bias per key, which dilated attention does not add); the real keys of each
    row must be one contiguous run (right or left padding)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    want = (B, S) if batched else (S,)
    if tuple(mask.shape) != want:
        raise ValueError(
            f"key_padding_mask must have shape {'(B, S)' if batched else '(S,)'} = {want} "
            f"(True or -inf = padding, as in nn.MultiheadAttention), got {tuple(mask.shape)}"
        )
    mask = mask.reshape(B, S)
    readable = not has_no_data(mask)
    if mask.dtype == torch.bool:
        real = mask.logical_not()
    elif mask.is_floating_point():
        real = mask == 0
        allowed = real | (mask == float("-inf"))
        if readable and not bool(allowed.all()):
            bad = mask[~allowed][0].item()
            raise ValueError(
                f"key_padding_mask (float) must hold only 0 (a real key) and -inf (padding), got {bad!r}: "
                "a float mask with other values is a bias added to the scores of a key, which dilated "
                "attention does not add"
            )
        if not readable:
            torch._assert_async(allowed.all(), "key_padding_mask (float) must hold only 0 and -inf")
    else:
        raise TypeError(
            f"key_padding_mask must be bool (True = padding) or floating (-inf = padding), as in "
            f"nn.MultiheadAttention, got {mask.dtype}"
        )
    if readable and S:
        ar = torch.arange(S, device=real.device)
        count = real.sum(1)
        first = torch.where(real, ar, S).amin(1)
        last = torch.where(real, ar, -1).amax(1)
        gaps = ((count > 0) & (last - first + 1 != count)).nonzero()
        if gaps.numel():
            b = int(gaps[0, 0])
            row = "".join("0" if x else "1" for x in real[b, : min(S, 64)].tolist())
            raise ValueError(
                f"key_padding_mask row {b}: its real keys (False, or 0) are not one contiguous run "
                f"(padding on the right or on the left only); row {b} starts {row}"
                f"{'...' if S > 64 else ''} (1 = padding)"
            )
    return real


def causal_from_attn_mask(mask: Any, is_causal: bool, batch_heads: int, L: int, S: int) -> bool:
    """Whether attention is causal, given ``nn.MultiheadAttention``'s ``attn_mask`` and ``is_causal``.

    ``attn_mask`` may be None, the causal mask (bool: True exactly above the diagonal; float: -inf
    exactly above it and 0 elsewhere), or a mask that masks nothing (all False, or all 0), in the
    (L, S) or (B * num_heads, L, S) form; any other mask is a ValueError. ``is_causal=True`` with a
    mask that is not causal is an error too (torch takes the hint on trust; here it is checked
    where the values can be read, and under ``torch.compile`` by a device-side assertion)."""
    if mask is None:
        return is_causal
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) not in ((L, S), (batch_heads, L, S)):
        raise ValueError(
            f"attn_mask must be (L, S) = ({L}, {S}) or (B * num_heads, L, S) = ({batch_heads}, {L}, {S}), "
            f"got shape {tuple(mask.shape)}"
        )
    future = torch.ones(L, S, dtype=torch.bool, device=mask.device).triu_(1)
    if mask.dtype == torch.bool:
        masked = mask
    elif mask.is_floating_point():
        masked = mask == float("-inf")
        if not has_no_data(mask) and not bool(((mask == 0) | masked).all()):
            raise ValueError(
                "attn_mask (float) must hold only 0 and -inf: other values are a bias added to the "
                "scores, which dilated attention does not add"
            )
    else:
        raise ValueError(f"attn_mask must be a bool or floating tensor, got {mask.dtype}")
    if has_no_data(mask):  # under torch.compile: the causal mask only, checked on the device
        ok = (masked == future).all()
        if mask.is_floating_point():
            ok = ok & ((mask == 0) | masked).all()
        torch._assert_async(ok, "attn_mask is not the causal mask (-inf or True exactly above the diagonal)")
        return True
    if bool(torch.equal(masked, future.expand_as(masked))):
        return True
    if not is_causal and not bool(masked.any()):
        return False  # masks nothing
    raise ValueError(
        "attn_mask is not the causal mask (True, or -inf, exactly above the diagonal)"
        + (" although is_causal=True" if is_causal else "")
        + ": a dilated pattern decides which keys a query sees, so an arbitrary dense mask has no "
        "meaning here; the causal mask (is_causal=True alone is enough) and a mask "
        "that masks nothing are accepted. For padding, give key_padding_mask."
    )


def refuse_torch_layer_mask(mask: Any) -> None:
    """A bool or integer ``key_padding_mask`` in a call that names ``need_weights`` is refused.

    That is how torch's transformer layers call their ``self_attn`` (``nn.TransformerDecoderLayer``
    passes ``need_weights=False`` and its ``tgt_key_padding_mask`` as given, True or nonzero =
    padding), and this module reads a bool or integer mask the other way round (True, or 1, = a
    real token): every real token would be taken for padding and every padded one for a real
    token, without an error. An integer mask is refused as ``nn.MultiheadAttention`` refuses it
    (only bool and floating masks), a bool one with the way out.
    """
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"key_padding_mask has dtype {mask.dtype} in a call that passes need_weights, the way "
            "torch's transformer layers (nn.TransformerDecoderLayer) call their self_attn: "
            "nn.MultiheadAttention refuses it (only bool and floating types of key_padding_mask are "
            "supported; True, or -inf, = padding), and MultiheadDilatedAttention would read it the "
            "other way round (1 = a real token, SPEC section 7). Inside torch's layers use "
            "dilated_attention.DropInMultiheadAttention with a bool mask (True = padding), or give the "
            "mask as floats (0 = a real key, -inf = padding); called directly, leave need_weights out "
            "to use this module's convention"
        )
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        raise ValueError(
            "key_padding_mask is a bool mask in a call that passes need_weights, as torch's "
            "transformer layers (nn.TransformerDecoderLayer) call nn.MultiheadAttention with torch's "
            "mask (True = padding); MultiheadDilatedAttention reads a bool mask the other way round "
            "(True = a real token, SPEC section 7). Inside torch's layers use "
            "dilated_attention.DropInMultiheadAttention, which takes torch's masks as they are; "
            "called directly, leave need_weights out (its only allowed value is False) or give the "
            "mask as floats (0 = a real key, -inf = padding)"
        )


def multihead_real_tokens(mask: Any, B: int, N: int) -> Any:
    """The ``key_padding_mask`` of :class:`MultiheadDilatedAttention` as :class:`DilatedAttention`
    takes it (True = a real token).

    A bool or integer mask is this library's (True, or 1, = a real token) and passes through. A
    floating mask is read as ``nn.MultiheadAttention`` reads it, added to the scores: 0 = a real
    key, -inf = padding. That is what ``nn.TransformerEncoderLayer`` passes after converting its
    ``src_key_padding_mask`` (bool, True = padding) to the input's dtype, so a layer's "no padding"
    arrives as all zeros. Any other float value (a per-key bias, or a 0/1 mask meant as this
    library's) is a ValueError naming it."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return mask
    if not has_no_data(mask):
        bad = mask[(mask != 0) & (mask != float("-inf"))]
        if bad.numel():
            raise ValueError(
                f"key_padding_mask is a float mask, which MultiheadDilatedAttention reads as "
                f"nn.MultiheadAttention does (added to the scores: 0 = a real key, -inf = padding), and "
                f"it holds {bad[0].item()!r}: other values are a bias per key, which dilated attention "
                f"does not add. For this module's own convention (True = a real token) pass a bool "
                f"mask (e.g. mask.bool() for a 0/1 mask)"
            )
    return real_tokens_from_torch_mask(mask, B, N, batched=True)
