"""``nn.Module`` classes.

* :class:`DilatedAttention` (:mod:`.dilated`): dilated attention on projected heads, no parameters.
* :class:`MultiheadDilatedAttention` (:mod:`.multihead`): the LongNet/torchscale layer (q, k, v
  projections, dilated attention, sub-layer LayerNorm, output projection), batch-first, with this
  library's padding mask: **True = a real token** (SPEC section 7).
* :class:`DropInMultiheadAttention` (:mod:`.drop_in`): a drop-in for ``nn.MultiheadAttention``
  with torch's conventions exactly: **True = padding** in ``key_padding_mask``, float additive
  masks, ``batch_first=False`` by default, ``need_weights=True`` by default; it runs as the
  ``self_attn`` of ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``.

The two mask conventions are opposite: a mask made for one class is wrong for the other.
"""

from __future__ import annotations

from .dilated import DilatedAttention
from .drop_in import DropInMultiheadAttention
from .multihead import MultiheadDilatedAttention

__all__ = ["DilatedAttention", "DropInMultiheadAttention", "MultiheadDilatedAttention"]
