"""Compatibility aliases: the names that code written for earlier versions uses (SPEC section 6).

Each alias is the very object it names, not a subclass or a wrapper, so that ``isinstance``,
pickling and copying behave as for the object itself:

* ``RingDilatedAttentionV2Collective``: an alias of
  :class:`dilated_attention.ring.RingDilatedAttention`.

They are served as ``dilated_attention.<name>`` and, for the ring's, as
``dilated_attention.ring.<name>``; both import this module on first use.
"""

from __future__ import annotations

from .ring.modules import RingDilatedAttention

__all__ = ["RingDilatedAttentionV2Collective"]

RingDilatedAttentionV2Collective = RingDilatedAttention
