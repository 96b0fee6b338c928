"""Attention backends. Each computes SPEC sections 2-3 and returns ``(out, lse)``.

=============  ==============================================================================
name           what it is
=============  ==============================================================================
native         the project's fused C++/CUDA kernels (a torch custom op)
flash_attn_3   FlashAttention-3 (``flash_attn_interface``) on the dilated sub-sequences
flash_attn_2   FlashAttention-2 (``flash_attn``) on the dilated sub-sequences
xformers       ``xformers.ops`` memory-efficient attention on the dilated sub-sequences
sdpa           PyTorch's fused SDPA kernels (the ATen operators that return the log-sum-exp)
manual         explicit matmul + softmax in PyTorch, autograd end to end
auto           the first of :func:`dilated_attention.hardware.recommended_backends` that can run
=============  ==============================================================================

See :mod:`.registry` for the selection and fallback rules, :mod:`.driver` for how the backends
that run a kernel per call compute and differentiate, and :mod:`.strided` for their views and
the plan cache.
"""

from __future__ import annotations

from .base import Backend, BackendRequest, Capabilities
from .driver import StridedBackend, merge_branches
from .registry import (
    BACKEND_CHOICES,
    BACKEND_NAMES,
    FALLBACKS,
    BackendSelector,
    Selection,
    backend_reasons,
    check_backend_name,
    default_selector,
    get_backend,
    resolve,
    select_backend,
)
from .strided import CacheInfo, PlanCache, get_pattern_cache

__all__ = [
    "BACKEND_CHOICES",
    "BACKEND_NAMES",
    "FALLBACKS",
    "Backend",
    "BackendRequest",
    "BackendSelector",
    "CacheInfo",
    "Capabilities",
    "PlanCache",
    "Selection",
    "StridedBackend",
    "backend_reasons",
    "check_backend_name",
    "default_selector",
    "get_backend",
    "get_pattern_cache",
    "merge_branches",
    "resolve",
    "select_backend",
]
