"""The transformers package this subpackage needs, imported first: a clear ImportError without it."""

from __future__ import annotations

__all__ = ["TESTED_VERSIONS", "AttentionInterface", "AttentionMaskInterface", "transformers"]

# The range the tests run against (pyproject.toml's extra and the Makefile pin the same): 4.57 has no
# bidirectional mask function; 5.0-5.3 give the mask function cache_position, 5.4 and later
# q_length/q_offset (both are taken); 5.24 is the newest release tested.
TESTED_VERSIONS = ">=5.0,<5.25"

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # the package imports without transformers; this subpackage needs it
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = f"transformers {version('transformers')} is installed, but "
    except PackageNotFoundError:
        found = ""
    raise ImportError(
        f"dilated_attention.transformers needs the transformers package{TESTED_VERSIONS}: {found}"
        f"pip install 'dilated-attention[transformers]' ({exc})"
    ) from exc
