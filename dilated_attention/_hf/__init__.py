"""Helpers of :mod:`dilated_attention.transformers`, split by role: ``layers`` (what one attention
call may run: cross-attention, the values it cannot honour) and ``dispatch`` (which model classes
reach the attention interface at all, and the warning when trained weights change function)."""
