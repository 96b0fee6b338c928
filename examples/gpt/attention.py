"""The causal self-attention of the example GPT, and the packed documents it reads.

``CausalSelfAttention`` computes LongNet dilated attention with ``dilated_attention`` (or dense
attention for comparison), packed documents with ``dilated_attention_varlen``, decode steps with
the key/value cache; with ``ring`` set (:func:`context_parallel.enable`), the sequence is split
across the ranks of a process group and ``ring`` (a ``RingDilatedAttention``) computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dilated_attention import DilatedKVCache, dilated_attention, dilated_attention_varlen

if TYPE_CHECKING:
    from model import GPTConfig

__all__ = ["CausalSelfAttention", "PackedDocuments"]


@dataclass(frozen=True)
class PackedDocuments:
    """Documents packed into the rows of a (B, T) batch.

    ``cu_seqlens`` int32 (S + 1,): the documents as packed sequences of the B * T flattened tokens;
    ``max_seqlen``: a bound on their length (T); ``positions`` (B, T): each token's position in its
    document; ``doc_ids`` (B, T): each token's document, numbered over the whole batch.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    doc_ids: torch.Tensor

    @classmethod
    def from_starts(cls, doc_starts: torch.Tensor) -> PackedDocuments:
        """From a (B, T) bool mask, True where a document begins (every row begins one)."""
        B, T = doc_starts.shape
        starts = doc_starts.to(torch.bool).clone()
        starts[:, 0] = True
        flat = starts.reshape(-1)
        first = flat.nonzero().squeeze(1)  # (S,) first token of each document
        cu = torch.cat([first, first.new_full((1,), B * T)]).to(torch.int32)
        ar = torch.arange(T, device=doc_starts.device)
        begin = torch.where(starts, ar, 0).cummax(dim=1).values  # (B, T) first token of its document
        doc_ids = (flat.long().cumsum(0) - 1).view(B, T)
        return cls(cu, T, ar - begin, doc_ids)


class CausalSelfAttention(nn.Module):
    """Causal self-attention by dilated attention (or dense attention, for comparison)."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.ring: nn.Module | None = None  # sequence parallelism: set by context_parallel.enable
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        kv_dim = self.n_kv_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * kv_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout

    def forward(
        self, x: torch.Tensor, kv_cache: DilatedKVCache | None = None, docs: PackedDocuments | None = None
    ) -> torch.Tensor:
        B, T, C = x.shape  # (B, T, C)
        kv_dim = self.n_kv_head * self.head_dim
        q, k, v = self.c_attn(x).split([C, kv_dim, kv_dim], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim)  # (B, T, H, D)
        k = k.view(B, T, self.n_kv_head, self.head_dim)  # (B, T, Hkv, D)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        if docs is not None:
            y = self._attend_packed(q, k, v, docs)
        elif kv_cache is not None:
            y = self._attend_cached(q, k, v, kv_cache)
        else:
            y = self._attend(q, k, v)
        y = y.reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over the whole sequence: q (B, T, H, D), k, v (B, T, Hkv, D)."""
        if self.ring is not None:  # this rank's positions of a sequence split across ranks
            return self.ring(q, k, v, is_causal=True)
        dropout_p = self.dropout if self.training else 0.0
        cfg = self.config
        if cfg.attention_backend == "dense":
            G = self.n_head // self.n_kv_head
            qt = q.transpose(1, 2)  # (B, H, T, D)
            kt = k.repeat_interleave(G, dim=2).transpose(1, 2)
            vt = v.repeat_interleave(G, dim=2).transpose(1, 2)
            y = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=dropout_p, is_causal=True)
            return y.transpose(1, 2)  # (B, T, H, D)
        return dilated_attention(
            q,
            k,
            v,
            cfg.segment_lengths,
            cfg.dilation_rates,
            is_causal=True,
            dropout_p=dropout_p,
            backend=cfg.attention_backend,
        )

    def _attend_cached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: DilatedKVCache
    ) -> torch.Tensor:
        """The new tokens after each sequence's cached ones (prefill, or decode steps)."""
        cfg = self.config
        if cfg.attention_backend == "dense":  # dense causal attention is one branch over the block
            segs, rates, backend = [cfg.block_size], [1], "auto"
        else:
            segs, rates, backend = cfg.segment_lengths, cfg.dilation_rates, cfg.attention_backend
        return kv_cache.attend(self.layer_idx, q, k, v, segs, rates, backend=backend)

    def _attend_packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: PackedDocuments
    ) -> torch.Tensor:
        """Causal attention inside each document only: q (B, T, H, D), k, v (B, T, Hkv, D)."""
        dropout_p = self.dropout if self.training else 0.0
        cfg = self.config
        B, T = q.shape[:2]
        if cfg.attention_backend == "dense":
            G = self.n_head // self.n_kv_head
            same = docs.doc_ids[:, :, None] == docs.doc_ids[:, None, :]  # (B, T, T)
            mask = same & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            qt = q.transpose(1, 2)  # (B, H, T, D)
            kt = k.repeat_interleave(G, dim=2).transpose(1, 2)
            vt = v.repeat_interleave(G, dim=2).transpose(1, 2)
            y = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None], dropout_p=dropout_p)
            return y.transpose(1, 2)  # (B, T, H, D)
        y = dilated_attention_varlen(
            q.reshape(B * T, *q.shape[2:]),
            k.reshape(B * T, *k.shape[2:]),
            v.reshape(B * T, *v.shape[2:]),
            docs.cu_seqlens,
            docs.max_seqlen,
            cfg.segment_lengths,
            cfg.dilation_rates,
            is_causal=True,
            dropout_p=dropout_p,
            backend=cfg.attention_backend,
        )  # (B * T, H, D)
        return y.view(B, T, *y.shape[1:])
