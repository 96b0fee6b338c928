"""The import path ``dilated_attention.transformers_cache``: :mod:`dilated_attention.transformers.cache`."""

from __future__ import annotations

from .transformers.cache import GENERATE_CACHE_KWARG, BoundedDilatedCache, BoundedDilatedLayer

__all__ = ["GENERATE_CACHE_KWARG", "BoundedDilatedCache", "BoundedDilatedLayer"]
