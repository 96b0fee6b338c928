"""Static checks of the public types, run by mypy (`make typecheck`), never executed.

``assert_type`` fails the type check when the inferred type differs: these pin what a user's
type checker sees for the return_lse overloads and the modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dilated_attention import (
    DilatedAttention,
    MultiheadDilatedAttention,
    dilated_attention,
    dilated_attention_decode,
    dilated_attention_varlen,
)

if TYPE_CHECKING:
    from typing_extensions import assert_type

    def _overloads(q: torch.Tensor, flag: bool) -> None:
        assert_type(dilated_attention(q, q, q, [4], [1]), torch.Tensor)
        assert_type(dilated_attention(q, q, q, [4], [1], return_lse=False), torch.Tensor)
        assert_type(dilated_attention(q, q, q, [4], [1], return_lse=True), tuple[torch.Tensor, torch.Tensor])
        assert_type(
            dilated_attention(q, q, q, [4], [1], return_lse=flag),
            torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        )
        _out, lse = dilated_attention(q, q, q, [4], [1], return_lse=True)
        assert_type(lse, torch.Tensor)

    def _varlen_overloads(q: torch.Tensor, cu: torch.Tensor, flag: bool) -> None:
        assert_type(dilated_attention_varlen(q, q, q, cu, 8, [4], [1]), torch.Tensor)
        assert_type(
            dilated_attention_varlen(q, q, q, cu, 8, [4], [1], return_lse=True),
            tuple[torch.Tensor, torch.Tensor],
        )
        assert_type(
            dilated_attention_varlen(q, q, q, cu, 8, [4], [1], return_lse=flag),
            torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        )

    def _decode_overloads(q: torch.Tensor, cache: torch.Tensor, flag: bool) -> None:
        assert_type(dilated_attention_decode(q, cache, cache, 4, [4], [1]), torch.Tensor)
        assert_type(
            dilated_attention_decode(q, cache, cache, 4, [4], [1], k=q, v=q, return_lse=True),
            tuple[torch.Tensor, torch.Tensor],
        )
        assert_type(
            dilated_attention_decode(q, cache, cache, 4, [4], [1], return_lse=flag),
            torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        )

    def _modules(x: torch.Tensor) -> None:
        assert_type(DilatedAttention([4], [1])(x, x, x), torch.Tensor)
        mha = MultiheadDilatedAttention(8, 2, [4], [1])
        assert_type(mha(x), tuple[torch.Tensor, None])
        assert_type(
            MultiheadDilatedAttention.from_torch(torch.nn.MultiheadAttention(8, 2), [4], [1]),
            MultiheadDilatedAttention,
        )
