"""Attention backends. Each computes SPEC sections 2-3 and returns ``(out, lse)``."""

from __future__ import annotations

import torch

from .. import _ops


class NativeBackend:
    name = "native"

    def forward(self, q, k, v, segment_lengths, dilation_rates, *, is_causal, softmax_scale, dropout_p):
        return _ops.native_forward(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale)


def select_backend(name: str, q: torch.Tensor, k: torch.Tensor, *, dropout_p: float = 0.0):
    if name not in ("auto", "native"):
        raise ValueError(f"unknown backend {name!r}")
    return NativeBackend()
