"""A GPT-2 language model whose attention is one config key (nanoGPT's ``model.py``, reshaped).

``GPTConfig.attention_backend`` picks how the causal self-attention is computed:

* any backend of the project (``"auto"``, ``"native"``, ``"flash_attn_3"``, ``"flash_attn_2"``,
  ``"xformers"``, ``"sdpa"``, ``"manual"``): LongNet dilated attention over the branches
  ``segment_lengths`` / ``dilation_rates`` by ``dilated_attention.dilated_attention``; a backend
  that cannot run here falls back as the project's backend layer decides, with a warning;
* ``"dense"``: plain causal attention by ``torch.nn.functional.scaled_dot_product_attention``,
  for comparison.

Generation uses the library's key/value cache (``dilated_attention.DilatedKVCache``, SPEC
section 8): a new token reads, per branch, only the cached keys of its segment and head phase, so
the cached result equals a full recompute. ``"dense"`` decodes as one branch that covers the
whole block.

Packed documents: ``GPT.forward(idx, targets, doc_starts=...)`` takes a (B, T) mask of the
positions where a new document begins in a row. Each document is then a sequence of its own:
positions restart at 0 and attention never crosses a document boundary (the rows go to
``dilated_attention.dilated_attention_varlen`` as packed sequences; ``"dense"`` uses a
block-diagonal causal mask).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from attention import CausalSelfAttention, PackedDocuments
from torch import nn

from dilated_attention import DilatedKVCache, flops, normalize_branches

logger = logging.getLogger(__name__)

# Backend names of the project, plus "dense" (plain causal attention) for comparison.
DILATED_BACKENDS = ("auto", "native", "flash_attn_3", "flash_attn_2", "xformers", "sdpa", "manual")
ATTENTION_BACKENDS = (*DILATED_BACKENDS, "dense")


@dataclass
class GPTConfig:
    """Shape of the model and the attention it uses.

    ``n_kv_head`` (0 means ``n_head``) gives grouped-query attention. ``segment_lengths`` and
    ``dilation_rates`` are the dilated-attention branches; they are ignored by ``"dense"``.
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 0
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    attention_backend: str = "auto"
    segment_lengths: Sequence[int] = field(default_factory=lambda: (256, 512, 1024))
    dilation_rates: Sequence[int] = field(default_factory=lambda: (1, 2, 4))
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.n_kv_head, bool) or not isinstance(self.n_kv_head, int) or self.n_kv_head < 0:
            raise ValueError(f"GPTConfig.n_kv_head must be an int >= 0 (0 = n_head), got {self.n_kv_head!r}")
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"GPTConfig.n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})"
            )
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"GPTConfig.attention_backend must be one of {list(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        segs, rates = normalize_branches(self.segment_lengths, self.dilation_rates)
        self.segment_lengths, self.dilation_rates = tuple(segs), tuple(rates)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["segment_lengths"] = list(self.segment_lengths)
        d["dilation_rates"] = list(self.dilation_rates)
        return d


# ---------------------------------------------------------------------------------------------
# Counting: how many pairs (the FLOPs).
# ---------------------------------------------------------------------------------------------


def attention_pairs(
    seq_len: int,
    n_head: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    is_causal: bool = True,
    dense: bool = False,
) -> int:
    """Number of (query, key) pairs, with multiplicity, summed over heads, for one sequence:
    counted exactly from the branches (SPEC section 3); ``dense=True`` counts plain attention over
    the whole sequence (one branch that covers it)."""
    if dense:
        segment_lengths, dilation_rates = [max(seq_len, 1)], [1]
    return flops.attention_pairs(seq_len, n_head, segment_lengths, dilation_rates, is_causal)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no ``bias=False`` before 2.1)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, kv_cache: DilatedKVCache | None = None, docs: PackedDocuments | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, docs)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2: token and position embeddings, ``n_layer`` pre-norm blocks, a tied output layer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                "ln_f": LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.cp_rank = 0  # which chunk of the sequence this rank holds (context_parallel.enable)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):  # GPT-2's scaled init of the residual projections
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        logger.info("number of parameters: %.2fM", self.get_num_params() / 1e6)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameters; without the position embeddings by default (the token embeddings are tied
        to the output layer, so they count as that layer's weights)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: DilatedKVCache | None = None,
        doc_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and the loss.

        idx (B, T) token ids. With ``targets`` (B, T) (``-1`` = ignored) the logits of every
        position and the mean cross-entropy are returned; without, only the last position's
        logits (B, 1, V). With a ``kv_cache`` (``dilated_attention.DilatedKVCache``), ``idx`` are
        the tokens after each sequence's cached positions: their keys and values are appended, they
        attend to the cache, and the cache is advanced by ``T``.
        ``doc_starts`` (B, T) bool: True where a new document begins in a row (packed documents,
        see the module docstring; not with a ``kv_cache``).
        """
        device = idx.device
        B, T = idx.shape
        # Sequence parallelism (context_parallel.enable): idx is chunk ``cp_rank`` of the sequence.
        # Without a cache every row starts at the same position, known here: no read of a device
        # tensor (a host synchronisation every step on a GPU, and a graph break under compile).
        start: int | torch.Tensor = self.cp_rank * T
        end = self.cp_rank * T + T
        if kv_cache is not None:
            start = kv_cache.seqlens[:, None].to(device)
            end = int(start.max()) + T
        if end > self.config.block_size:
            raise ValueError(
                f"cannot forward a sequence of length {end}: block size is only {self.config.block_size}"
            )
        docs = None
        if doc_starts is not None:
            if kv_cache is not None:
                raise ValueError("doc_starts (packed documents) cannot be combined with a kv_cache")
            if doc_starts.shape != idx.shape:
                raise ValueError(
                    f"doc_starts must have idx's shape {tuple(idx.shape)}, got {tuple(doc_starts.shape)}"
                )
            docs = PackedDocuments.from_starts(doc_starts)
            pos = docs.positions  # (B, T): positions restart in every document
        else:
            pos = (start + torch.arange(T, dtype=torch.long, device=device)).expand(B, T)  # (B, T)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        use_ckpt = self.config.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            if use_ckpt and kv_cache is None:
                x = torch.utils.checkpoint.checkpoint(block, x, None, docs, use_reentrant=False)
            else:
                x = block(x, kv_cache, docs)
        if kv_cache is not None:
            kv_cache.advance(T)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)  # (B, T, V)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])  # (B, 1, V)
            loss = None
        return logits, loss

    def forward_all(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of every position, (B, T, V), without a loss."""
        _, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the block size (e.g. to sample a model with a shorter context)."""
        if not 1 <= block_size <= self.config.block_size:
            raise ValueError(f"block_size must be in [1, {self.config.block_size}], got {block_size}")
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float], device_type: str
    ) -> torch.optim.AdamW:
        """AdamW; weight decay on the 2-D weights (matmuls, embeddings), none on biases and norms."""
        params = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        logger.info(
            "decayed parameter tensors: %d (%d parameters); not decayed: %d (%d parameters)",
            len(decay),
            sum(p.numel() for p in decay),
            len(no_decay),
            sum(p.numel() for p in no_decay),
        )
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        extra = {"fused": True} if fused else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)

    def flops_per_sequence(self, seq_len: int) -> float:
        """FLOPs of forward + backward for one sequence of ``seq_len`` tokens.

        Matmuls: ``6 * N`` per token (N = parameters without position embeddings). Attention
        (SPEC section 3): forward ``4 * D * pairs`` per layer, pairs counted with multiplicity
        from the branches (not as dense), backward ``2.5 x`` forward.
        """
        cfg = self.config
        pairs = attention_pairs(
            seq_len,
            cfg.n_head,
            cfg.segment_lengths,
            cfg.dilation_rates,
            is_causal=True,
            dense=cfg.attention_backend == "dense",
        )
        attn = flops.attention_flops(pairs, cfg.head_dim, backward=True) * cfg.n_layer
        return 6 * self.get_num_params() * seq_len + attn

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); returns (B, T + max_new_tokens).

        With ``use_cache`` the keys and values are cached; when the context reaches the block
        size, the cache is rebuilt from the last ``block_size // 2`` tokens (one full forward).
        Without it, every step recomputes the last ``block_size`` tokens, as nanoGPT does.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        bs = self.config.block_size
        p = next(self.parameters())
        cache: DilatedKVCache | None = None
        for _ in range(max_new_tokens):
            if use_cache:
                if cache is None or int(cache.seqlens.max()) >= bs:
                    ctx = idx[:, -(bs // 2 if cache is not None else bs) :]
                    c = self.config
                    cache = DilatedKVCache(
                        c.n_layer, idx.shape[0], bs, c.n_kv_head, c.head_dim, dtype=p.dtype, device=p.device
                    )
                    logits, _ = self(ctx, kv_cache=cache)
                else:
                    logits, _ = self(idx[:, -1:], kv_cache=cache)
            else:
                logits, _ = self(idx if idx.size(1) <= bs else idx[:, -bs:])
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
