"""``BoundedDilatedKVCache``: a key/value cache that keeps only what dilated attention will read.

In branch ``(w, r)`` a future query reads only keys of its own segment, at the phases of the
query heads that read each key/value head (SPEC section 2). So per layer, branch and kv head the
cache keeps the current segment's keys at those phases, in slots whose number is fixed by the
branches and heads: ``sum_i min(G, r_i) * ceil(w_i / r_i)`` per kv head (``G = Hq // Hkv``),
however long the generation runs. The layout is described in :mod:`dilated_attention.op.slots`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _validation as V
from .._validation import accumulation_dtype
from ..functional import _attention
from ..op.decode import decode_step
from ..op.slots import attend_slots, branch_slots, write_slots
from ._api import StepGuard, _as_lengths, cache_dtype_device
from ._cache import check_sizes

__all__ = ["BoundedDilatedKVCache"]


class BoundedDilatedKVCache:
    """Keys and values of every layer of a model, bounded by the branches, for a batch of sequences.

    The branches are the model's (every layer the same). Per layer it holds ``k[layer]``,
    ``v[layer]`` of shape (B, Hkv, T, D) with ``T`` fixed by the branches and heads (and by
    ``max_seqlen`` when that is shorter than a segment); ``seqlens`` (B,) int64 counts the positions
    of each sequence. A step of one token per sequence runs the fused op
    ``torch.ops.dilated_attention.decode_step`` where the extension has it for the device
    (``fused=None``; True or False asks for the op or plain PyTorch). Use it as::

        cache = BoundedDilatedKVCache(n_layer, B, n_head, n_kv_head, head_dim, segs, rates, dtype=dtype)
        # in layer i, for the new tokens' q (B, T, Hq, D), k, v (B, T, Hkv, D):
        out = cache.attend(i, q, k, v)  # num_new=(B,) lengths: left-padded new tokens
        # after the last layer:
        cache.advance(T)  # the same counts as num_new (or advance() without them)

    Outputs equal causal dilated attention over each whole sequence (SPEC section 8). A call whose
    rows have different numbers of new tokens passes them left-padded, with ``num_new`` (B,) the
    real tokens at the end of each row; padding queries give ``out = 0`` and are never cached.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        *,
        max_seqlen: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fused: bool | None = None,
    ) -> None:
        check_sizes(num_layers, batch_size, num_kv_heads, head_dim, num_heads=num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads, got {num_heads} and {num_kv_heads}"
            )
        if max_seqlen is not None and V._as_int(max_seqlen, "max_seqlen") < 1:
            raise ValueError(f"max_seqlen must be >= 1 or None, got {max_seqlen}")
        self.segment_lengths, self.dilation_rates = V.normalize_branches(segment_lengths, dilation_rates)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.max_seqlen = max_seqlen
        if fused is not None:
            V.check_bool(fused, "fused")
        self.fused = fused  # the fused step op (None: where the extension has it for the device)
        self.group = num_heads // num_kv_heads
        self.layout = branch_slots(self.segment_lengths, self.dilation_rates, self.group, max_seqlen)
        slots = self.layout[-1].offset + self.layout[-1].rows * self.layout[-1].length
        shape = (batch_size, num_kv_heads, slots, head_dim)
        dtype, device = cache_dtype_device(dtype, device, type(self).__name__)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self._host = [0] * batch_size  # seqlens on the host: no device sync per step
        self._step = StepGuard(num_layers, type(self).__name__, exact=True)

    @property
    def slots(self) -> int:
        """Slots per (sequence, kv head, layer): ``T``."""
        return self.k[0].shape[2]

    def memory_bytes(self) -> int:
        """Bytes of the keys and values held, every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def _new_counts(self, num_new: int | torch.Tensor | None, m: int) -> list[int]:
        B = len(self._host)
        if num_new is None:
            return [m] * B
        counts = _as_lengths(num_new, B, torch.device("cpu"), "num_new").tolist()
        if min(counts) < 0 or max(counts) > m:
            raise ValueError(f"num_new must be in [0, {m}] (the new tokens of the call), got {counts}")
        return counts

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segment_lengths: int | Sequence[int] | None = None,
        dilation_rates: int | Sequence[int] | None = None,
        *,
        num_new: int | torch.Tensor | None = None,
        softmax_scale: float | None = None,
        return_lse: bool = False,
        backend: str = "auto",
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal dilated attention of the new tokens ``q`` (B, m, Hq, D), ``k``, ``v`` (B, m, Hkv, D)
        after each sequence's cached positions, caching what later queries read. Returns out
        (B, m, Hq, D) in q's dtype (and lse (B, Hq, m) when ``return_lse``).

        ``num_new``: None (all ``m`` tokens are real) or an int / (B,) tensor: row ``b``'s real
        tokens are its last ``num_new[b]`` (left padding). ``backend`` runs a prefill (new tokens
        on an empty cache) as in :func:`~dilated_attention.dilated_attention`. ``segment_lengths``,
        ``dilation_rates`` (as :class:`DilatedKVCache` takes them) may be given: they must be the
        cache's. q, k and v are computed on in the cache's dtype (k and v stored as it) and the
        result is cast back to q's dtype: a cache narrower than q rounds them."""
        if segment_lengths is not None or dilation_rates is not None:
            given = V.normalize_branches(segment_lengths, dilation_rates)
            if given != (self.segment_lengths, self.dilation_rates):
                raise ValueError(
                    f"this cache holds the branches segment_lengths={self.segment_lengths}, "
                    f"dilation_rates={self.dilation_rates}; got {given[0]}, {given[1]}"
                )
        if not 0 <= V._as_int(layer, "layer") < len(self.k):
            raise ValueError(f"layer must be in [0, {len(self.k)}), got {layer}")
        V.check_qkv(q, k, v)
        B, m, Hq, D = q.shape
        want = (len(self._host), self.num_heads, self.num_kv_heads, self.head_dim)
        if (B, Hq, k.shape[2], D) != want:
            raise ValueError(
                f"q (B, m, Hq, D) and k (B, m, Hkv, D) must match the cache's (B, Hq, Hkv, D) = {want}, "
                f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        return_lse = V.check_bool(return_lse, "return_lse")
        kbuf, vbuf = self.k[layer], self.v[layer]
        if q.device != kbuf.device:
            raise ValueError(
                f"q, k and v must be on the cache's device {kbuf.device}, got {q.device}"
                + (
                    " (a meta tensor holds no values; a cache built with device='meta' takes them)"
                    if q.device.type == "meta"
                    else ""
                )
            )
        dtype = kbuf.dtype
        scale = V.check_scale_for_dtype(V.resolve_scale(softmax_scale, D), dtype)
        counts = self._new_counts(num_new, m)
        ends = [n + c for n, c in zip(self._host, counts, strict=True)]
        if self.max_seqlen is not None and max(ends) > self.max_seqlen:
            raise ValueError(f"sequence lengths would reach {ends}, beyond max_seqlen={self.max_seqlen}")
        self._step.attend(layer, counts)
        if kbuf.device.type == "meta":  # shape propagation, as the op's fake kernel: nothing to read
            out = q.new_empty(q.shape)
            lse = q.new_empty((B, Hq, m), dtype=accumulation_dtype(dtype))
            return (out, lse) if return_lse else out
        if m == 0:
            out = q.new_zeros(q.shape)
            lse = torch.full((B, Hq, 0), float("-inf"), dtype=accumulation_dtype(dtype), device=q.device)
            return (out, lse) if return_lse else out
        q_dtype = q.dtype
        if q.dtype != dtype or k.dtype != dtype or v.dtype != dtype:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        dev = kbuf.device
        lengths = self.seqlens
        if num_new is None:
            pos = lengths[:, None] if m == 1 else lengths[:, None] + torch.arange(m, device=dev)
        else:
            pad = torch.tensor([m - c for c in counts], device=dev)[:, None]
            c = torch.arange(m, device=dev)
            pos = torch.where(c >= pad, lengths[:, None] + c - pad, -1)
        if m == 1:  # the fused step writes the token, then reads the slots in place
            o, s = decode_step(
                q[:, 0], k[:, 0], v[:, 0], kbuf, vbuf, pos[:, 0], self.layout, scale, fused=self.fused
            )
            out, lse = o[:, None], s[..., None]
        else:
            if max(self._host) == 0:
                out, lse = self._prefill(q, k, v, counts, scale, backend)
            else:
                out, lse = attend_slots(q, k, v, kbuf, vbuf, lengths, pos, self.layout, scale)
            ends_t = torch.tensor(ends, device=dev)[:, None]
            write_slots(kbuf, vbuf, k, v, pos, ends_t, self.layout, self.group)
        out = out.to(q_dtype)
        return (out, lse) if return_lse else out

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: list[int], scale: float, backend: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens on an empty cache: the causal forward of each row's real tokens."""
        segs, rates = self.segment_lengths, self.dilation_rates
        B, m = q.shape[:2]
        if all(n == m for n in counts):
            return _attention(q, k, v, segs, rates, is_causal=True, softmax_scale=scale, backend=backend)
        out = torch.zeros_like(q)
        lse = torch.full(
            (B, q.shape[2], m), float("-inf"), dtype=accumulation_dtype(q.dtype), device=q.device
        )
        for b, n in enumerate(counts):
            if n:
                o, s = _attention(
                    q[b : b + 1, m - n :],
                    k[b : b + 1, m - n :],
                    v[b : b + 1, m - n :],
                    segs,
                    rates,
                    is_causal=True,
                    softmax_scale=scale,
                    backend=backend,
                )
                out[b, m - n :], lse[b, :, m - n :] = o[0], s[0]
        return out, lse

    def advance(self, n: int | torch.Tensor | None = None) -> None:
        """Count ``n`` (an int, or a (B,) tensor) more positions as cached, after every layer.

        ``n`` must be the tokens the layers took since the last ``advance`` (``num_new``, or every
        token of the call), else a ValueError naming both; None advances by them. With no layer
        attended since the last ``advance``, ``n`` counts positions written into the slots
        directly and is not checked against them."""
        counts = None if n is None else _as_lengths(n, len(self._host), torch.device("cpu"), "n").tolist()
        if counts is not None and min(counts) < 0:
            raise ValueError(f"cache lengths must grow: n must be >= 0 per row, got {counts}")
        counts = self._step.counts(counts, n)
        new = [a + b for a, b in zip(self._host, counts, strict=True)]
        if self.max_seqlen is not None and max(new) > self.max_seqlen:
            raise ValueError(f"cache lengths must grow and stay in [0, {self.max_seqlen}], got {new}")
        self._host = new
        self._step.advance()
        self.seqlens = torch.tensor(new, dtype=torch.int64, device=self.seqlens.device)

    def reset(self) -> None:
        """Forget every cached position."""
        self._host = [0] * len(self._host)
        self.seqlens = torch.zeros_like(self.seqlens)
        self._step.advance()
