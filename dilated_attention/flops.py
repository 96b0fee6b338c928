"""The counting and dtype rules that the package, the benchmarks and the example share.

* :func:`accumulation_dtype`: float64 for float64 inputs, float32 for everything else (the dtype
  of ``lse`` and of every accumulation, SPEC section 1); stated with the package's other dtype
  rules in :mod:`dilated_attention._validation`, and offered here to the benchmarks and the example.
* :func:`attention_pairs` / :func:`attention_flops`: (query, key) pairs with multiplicity and the
  FLOPs every TFLOP/s figure of the project is computed from (SPEC section 3).
* :func:`matmul_flops`: the rate of a dense matmul on a device, the yardstick the benchmarks and
  the example's MFU compare against.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ._validation import accumulation_dtype

__all__ = ["accumulation_dtype", "attention_flops", "attention_pairs", "matmul_flops"]


def _covered(length: int, o: int, r: int) -> int:
    """Positions ``t`` in ``[0, length)`` with ``t % r == o``."""
    return (length - o + r - 1) // r if o < length else 0


def attention_pairs(
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool = False,
) -> int:
    """(query, key) pairs with multiplicity, summed over ``num_heads`` heads, of one sequence.

    Counted exactly from the branches (SPEC sections 2-3): in branch ``(w, r)`` head ``h`` keeps
    ``c`` positions of a segment of length ``L`` (``c = #{t < L : t % r == h % r}``), which form
    ``c * (c + 1) / 2`` causal pairs (``c * c`` not causal). O(branches * min(r, heads)).
    """
    total = 0
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        full, rest = divmod(seq_len, w)
        for o in range(min(r, num_heads)):
            heads = len(range(o, num_heads, r))
            for count, length in ((full, w), (1, rest)):
                c = _covered(length, o, r)
                total += heads * count * (c * (c + 1) // 2 if is_causal else c * c)
    return total


def attention_flops(pairs: int, head_dim: int, backward: bool = False) -> float:
    """SPEC section 3: forward ``4 * head_dim`` per pair; forward + backward 3.5 x that."""
    fwd = 4.0 * head_dim * pairs
    return 3.5 * fwd if backward else fwd


def matmul_flops(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    n: int = 2048,
    repeats: int = 10,
) -> float:
    """FLOP/s of ``torch.mm`` on two ``n x n`` matrices in ``dtype``: the median of ``repeats``
    timed calls after two warm-up calls."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        torch.mm(a, b)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2.0 * n**3 / times[len(times) // 2]
