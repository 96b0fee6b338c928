"""``DilatedKVCache``: the full (preallocated) key/value cache of every layer of a model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _validation as V
from ._api import StepGuard, _as_lengths, cache_dtype_device, dilated_attention_decode


def check_sizes(
    num_layers: object, batch_size: object, num_kv_heads: object, head_dim: object, **more: object
) -> None:
    """A cache's sizes (and ``more`` of them, by name) are ints >= 1: a ValueError names the first
    that is not."""
    sizes = {
        "num_layers": num_layers,
        "batch_size": batch_size,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
    }
    for name, value in {**sizes, **more}.items():
        if V._as_int(value, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class DilatedKVCache:
    """Keys and values of every layer of a model for a batch of sequences of different lengths.

    ``k[layer]``, ``v[layer]``: (B, max_seqlen, Hkv, D), preallocated; ``seqlens`` (B,) int64:
    the positions cached per sequence. Use it as::

        cache = DilatedKVCache(n_layer, B, max_seqlen, n_kv_head, head_dim, dtype=dtype, device=device)
        # in layer i of the model, for the new tokens' q (B, T, Hq, D), k, v (B, T, Hkv, D):
        out = cache.attend(i, q, k, v, segment_lengths, dilation_rates)
        # after the last layer:
        cache.advance(T)  # or a (B,) tensor: e.g. the real lengths of right-padded prompts

    A batch of prompts of different lengths can be prefilled right-padded to one length ``T``
    and then advanced by the real lengths: causal attention never lets a real token read the
    padding after it, and the next tokens overwrite it. ``advance`` is checked against what the
    layers appended (at most ``T`` per row); ``advance()`` without ``n`` advances by ``T``.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_seqlen: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_sizes(num_layers, batch_size, num_kv_heads, head_dim, max_seqlen=max_seqlen)
        shape = (batch_size, max_seqlen, num_kv_heads, head_dim)
        dtype, device = cache_dtype_device(dtype, device, type(self).__name__)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.max_seqlen = max_seqlen
        self._step = StepGuard(num_layers, type(self).__name__, exact=False)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        *,
        softmax_scale: float | None = None,
        backend: str = "auto",
    ) -> torch.Tensor:
        """Append ``k``, ``v`` (B, T, Hkv, D) to ``layer`` after each sequence's cached positions
        and return the causal dilated attention of ``q`` (B, T, Hq, D) there, (B, T, Hq, D). q, k and
        v are computed on in the cache's dtype (k and v stored as it) and the result is cast back to
        q's dtype: a cache narrower than q rounds them."""
        if not 0 <= layer < len(self.k):
            raise ValueError(f"layer must be in [0, {len(self.k)}), got {layer}")
        dtype = self.k[layer].dtype
        out = dilated_attention_decode(
            q.to(dtype),
            self.k[layer],
            self.v[layer],
            self.seqlens,
            segment_lengths,
            dilation_rates,
            k=k.to(dtype),
            v=v.to(dtype),
            softmax_scale=softmax_scale,
            backend=backend,
        )
        self._step.attend(layer, [q.shape[1]] * q.shape[0])
        return out.to(q.dtype)

    def advance(self, n: int | torch.Tensor | None = None) -> None:
        """Count ``n`` (an int, or a (B,) tensor) more positions as cached, after every layer.

        ``n`` is at most the tokens the layers appended since the last ``advance`` (fewer: the
        real lengths of right-padded rows), else a ValueError naming both; None advances by what
        they appended. With no layer attended since the last ``advance``, ``n`` counts positions
        written into ``k``, ``v`` directly and is not checked against them."""
        B = self.seqlens.shape[0]
        counts = None if n is None else _as_lengths(n, B, torch.device("cpu"), "n").tolist()
        counts = self._step.counts(counts, n)
        new = self.seqlens + torch.tensor(counts, dtype=torch.int64).to(self.seqlens.device)
        if self.seqlens.device.type == "meta":  # lengths without values: only n can be checked
            if min(counts) < 0:
                raise ValueError(f"cache lengths must grow: n must be >= 0 per row, got {counts}")
        elif int(new.min()) < 0 or int(new.max()) > self.max_seqlen:
            raise ValueError(f"cache lengths must stay in [0, {self.max_seqlen}], got {new.tolist()}")
        self.seqlens = new
        self._step.advance()

    def reset(self) -> None:
        """Forget every cached position."""
        self.seqlens.zero_()
        self._step.advance()
