"""LongNet dilated attention as a fused PyTorch custom op.

``dilated_attention(q, k, v, segment_lengths, dilation_rates)`` computes, for q (B, N, Hq, D) and
k, v (B, N, Hkv, D), attention in which every branch ``(w, r)`` splits the sequence into segments
of ``w`` positions, keeps every ``r``-th position of each segment (head ``h`` at phase ``h % r``)
and attends within it; all branches of a query share one softmax (LongNet, Ding et al. 2023).
``dilated_attention_decode`` and ``DilatedKVCache`` generate with a key/value cache; the optional
``dilated_attention.transformers`` runs it inside HuggingFace transformers models.
"""

from __future__ import annotations

import logging
from typing import Any

from . import (
    backends,
    hardware,
    op,  # noqa: F401  (importing it registers the ops' fake kernels and autograd formulas)
)
from ._validation import normalize_branches
from ._warnings import (
    BackendFallbackWarning,
    CacheUsageWarning,
    DenseWeightsWarning,
    DilatedAttentionWarning,
    ExtensionWarning,
    LayoutWarning,
    SequenceSplitWarning,
    SlowPathWarning,
    UncoveredPositionsWarning,
    VersionWarning,
)
from .backends import BACKEND_CHOICES, BACKEND_NAMES, get_pattern_cache, select_backend
from .decode import BoundedDilatedKVCache, DilatedKVCache, dilated_attention_decode
from .functional import dilated_attention, dilated_attention_varlen
from .hardware import recommended_backends, recommended_dtype
from .hilbert import hilbert_permutation
from .modules import DilatedAttention, DropInMultiheadAttention, MultiheadDilatedAttention

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

# The sequence-parallel modules load on first use (they pull in torch.distributed), and with them
# the compatibility aliases (ring.compat).
_LAZY = {
    "RingDilatedAttention": "ring",
    "RingDilatedAttentionV2Collective": "ring",  # an alias of RingDilatedAttention
    "RingMultiheadDilatedAttention": "ring",
    "StandardizedRingConfig": "ring",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKEND_CHOICES",
    "BACKEND_NAMES",
    "BackendFallbackWarning",
    "BoundedDilatedKVCache",
    "CacheUsageWarning",
    "DenseWeightsWarning",
    "DilatedAttention",
    "DilatedAttentionWarning",
    "DilatedKVCache",
    "DropInMultiheadAttention",
    "ExtensionWarning",
    "LayoutWarning",
    "MultiheadDilatedAttention",
    "RingDilatedAttention",
    "RingDilatedAttentionV2Collective",
    "RingMultiheadDilatedAttention",
    "SequenceSplitWarning",
    "SlowPathWarning",
    "StandardizedRingConfig",
    "UncoveredPositionsWarning",
    "VersionWarning",
    "__version__",
    "backends",
    "dilated_attention",
    "dilated_attention_decode",
    "dilated_attention_varlen",
    "get_pattern_cache",
    "hardware",
    "hilbert_permutation",
    "normalize_branches",
    "recommended_backends",
    "recommended_dtype",
    "select_backend",
]
