"""Compatibility aliases: the names that code written for earlier versions uses (SPEC section 6).
Every alias of the package is here (today only the ring's, hence its place in this package, below
everything that serves it: no import points upward).

Each alias is the very object it names, not a subclass or a wrapper, so that ``isinstance``,
pickling and copying behave as for the object itself:

* ``RingDilatedAttentionV2Collective``: an alias of
  :class:`dilated_attention.ring.RingDilatedAttention`.

They are served as ``dilated_attention.<name>`` (imported on first use) and
``dilated_attention.ring.<name>``.
"""

from __future__ import annotations

from .modules import RingDilatedAttention

__all__ = ["RingDilatedAttentionV2Collective"]

RingDilatedAttentionV2Collective = RingDilatedAttention
