"""Helpers of :mod:`dilated_attention.transformers`, split by role: ``layers`` (what one attention
call may run: cross-attention, the values it cannot honour) and ``dispatch`` (which model classes
reach the attention interface at all, and the warning when trained weights change function)."""

# The range the tests run against (pyproject.toml's extra and the Makefile pin the same): 4.57 has no
# bidirectional mask function; 5.0-5.3 give the mask function cache_position, 5.4 and later
# q_length/q_offset (both are taken); 5.24 is the newest release tested.
TESTED_VERSIONS = ">=5.0,<5.25"
