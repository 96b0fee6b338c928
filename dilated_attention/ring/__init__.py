"""Sequence parallelism for dilated attention (SPEC section 5, LongNet section 3.1).

A process group of ``P`` ranks splits the sequence; each rank passes its positions (B, N/P, H, D)
of q, k and v to :class:`RingDilatedAttention` and gets the same positions of the output, which
equal :func:`dilated_attention.dilated_attention` on the whole sequence, forward and backward.

The package, by role (read in this order):

* :mod:`.geometry`: which positions each rank holds (``layout``: contiguous, or zigzag for
  balanced causal work), which branches are local, and which keys each spanning piece reads from
  which rank. Plain arithmetic, testable without processes.
* :mod:`.groups`: the process group (or ``DeviceMesh``) and who is in it; the error under a
  launcher without a process group.
* :mod:`.transport`: all-to-all and point-to-point transfers with byte counting
  (:func:`comm_stats`) and clear errors.
* :mod:`.pieces`: the attention of one piece, the one place that calls a kernel (``native``'s
  piece op, or a gather-based backend's kernel).
* :mod:`.mode_all_gather` and :mod:`.mode_ring`: the two exchange modes, each forward then
  backward.
* :mod:`.node`: the spanning pieces as one autograd node, and the helpers both modes share.
* :mod:`.consistency`: the check that every rank was called with the same configuration.
* :mod:`.modules`: :class:`RingDilatedAttention`; :mod:`.multihead`:
  :class:`RingMultiheadDilatedAttention`, :class:`StandardizedRingConfig`; :mod:`.sharding`:
  :func:`shard_sequence`, :func:`gather_sequence`.

Partial results are merged by log-sum-exp with :mod:`dilated_attention.merge`, as the
gather-based backends merge their branches. ``RingDilatedAttentionV2Collective`` is a
compatibility alias of :class:`RingDilatedAttention`, defined in :mod:`dilated_attention.ring.compat`.
"""

from __future__ import annotations

from .compat import RingDilatedAttentionV2Collective
from .consistency import call_key
from .geometry import LAYOUTS
from .groups import SequenceSplitWarning
from .modules import COMM_MODES, RingDilatedAttention
from .multihead import RingMultiheadDilatedAttention, StandardizedRingConfig
from .sharding import gather_sequence, shard_sequence
from .transport import comm_stats, reset_comm_stats

__all__ = [
    "COMM_MODES",
    "LAYOUTS",
    "RingDilatedAttention",
    "RingDilatedAttentionV2Collective",
    "RingMultiheadDilatedAttention",
    "SequenceSplitWarning",
    "StandardizedRingConfig",
    "call_key",
    "comm_stats",
    "gather_sequence",
    "reset_comm_stats",
    "shard_sequence",
]
