"""Generation with a key/value cache (SPEC section 8), in the spirit of ``flash_attn_with_kvcache``.

``dilated_attention_decode(q, k_cache, v_cache, cache_seqlens, ...)`` appends the new keys and
values to a preallocated cache and attends the new queries to exactly the keys that causal
dilated attention on the whole sequence gives them. In branch ``(w, r)`` the query at position
``p`` reads the keys ``p, p - r, p - 2r, ...`` down to the first position of its segment
(``p - p % w``), and only when the branch covers ``(p, h)`` (``(p % w) % r == h % r``). So a
query reads at most ``sum_i ceil(w_i / r_i)`` keys however long the cache is: they are gathered
from the cache (one index per slot, a key found by two branches taking two slots, so that it
counts twice as SPEC section 3 says), and one softmax runs over all of them.

:class:`DilatedKVCache` holds the caches of every layer of a model and the length of each
sequence of the batch.
"""

from __future__ import annotations

from ._api import dilated_attention_decode
from ._cache import DilatedKVCache
from ._gather import decode_key_positions
from .bounded import BoundedDilatedKVCache

__all__ = ["BoundedDilatedKVCache", "DilatedKVCache", "decode_key_positions", "dilated_attention_decode"]
