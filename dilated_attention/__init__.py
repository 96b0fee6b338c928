"""LongNet dilated attention as a fused PyTorch custom op.

``dilated_attention(q, k, v, segment_lengths, dilation_rates)`` computes, for q (B, N, Hq, D) and
k, v (B, N, Hkv, D), attention in which every branch ``(w, r)`` splits the sequence into segments
of ``w`` positions, keeps every ``r``-th position of each segment (head ``h`` at phase ``h % r``)
and attends within it; all branches of a query share one softmax (LongNet, Ding et al. 2023).
"""

from __future__ import annotations

import logging

from . import _ops  # noqa: F401  (registers the op, its fake and its autograd)
from .functional import dilated_attention

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["dilated_attention", "__version__"]
