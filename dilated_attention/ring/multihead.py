"""The multi-head module of sequence parallelism and its configuration.

:class:`RingMultiheadDilatedAttention` is :class:`dilated_attention.MultiheadDilatedAttention`
whose attention is a :class:`~dilated_attention.ring.RingDilatedAttention`;
:class:`StandardizedRingConfig` describes one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import _validation as V
from ..modules import MultiheadDilatedAttention
from ..modules._options import pick
from .groups import GroupLike
from .modules import COMM_MODES, RingDilatedAttention

__all__ = ["RingMultiheadDilatedAttention", "StandardizedRingConfig"]


@dataclass
class StandardizedRingConfig:
    """Configuration of :class:`RingMultiheadDilatedAttention`.

    ``dim`` is the model width (an alias of ``embed_dim``) and ``heads`` the number of heads (an
    alias of ``num_heads``); the head dim is ``dim // heads``. ``ring_size`` is the number of
    ranks expected (checked against the process group when there is one with more than one rank).
    ``dtype`` and ``device`` are those of the projection weights. Attention dropout is not
    supported across ranks: ``dropout`` must be 0.0.

    Example: ``StandardizedRingConfig(dim=768, heads=12, segment_lengths=[2048, 4096],
    dilation_rates=[1, 2], ring_size=2, dtype=torch.float32)``.
    """

    dim: int | None = None
    heads: int | None = None
    segment_lengths: Sequence[int] | None = None
    dilation_rates: Sequence[int] | None = None
    ring_size: int | None = None
    dtype: torch.dtype | None = None
    device: str | torch.device | None = None
    embed_dim: int | None = None
    num_heads: int | None = None
    dropout: float = 0.0
    bias: bool = True
    layer_norm: bool = True
    comm: str = "all_gather"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        who = "StandardizedRingConfig: "
        try:
            self.embed_dim = self.dim = pick("embed_dim", self.embed_dim, "dim", self.dim)
            self.num_heads = self.heads = pick("num_heads", self.num_heads, "heads", self.heads)
        except (TypeError, ValueError) as err:
            raise type(err)(who + str(err)) from None
        if self.embed_dim % self.num_heads:
            raise ValueError(f"dim ({self.embed_dim}) must be divisible by heads ({self.num_heads})")
        if self.segment_lengths is None or self.dilation_rates is None:
            raise TypeError("StandardizedRingConfig needs segment_lengths and dilation_rates")
        self.segment_lengths, self.dilation_rates = V.normalize_branches(
            self.segment_lengths, self.dilation_rates
        )
        if self.ring_size is not None:
            self.ring_size = pick("ring_size", self.ring_size, "ring_size", None)
        if V.check_dropout(self.dropout) != 0.0:
            raise ValueError(
                f"attention dropout is not supported across ranks, got dropout={self.dropout!r}; use 0.0"
            )
        if self.comm not in COMM_MODES:
            raise ValueError(f"comm must be one of {COMM_MODES}, got {self.comm!r}")

    @property
    def head_dim(self) -> int:
        assert self.embed_dim is not None and self.num_heads is not None  # set by __post_init__
        return self.embed_dim // self.num_heads


class RingMultiheadDilatedAttention(MultiheadDilatedAttention):
    """:class:`dilated_attention.MultiheadDilatedAttention` whose attention is a
    :class:`RingDilatedAttention`: each rank passes its chunk (B, N/P, E) of the sequence and gets
    its chunk of the output. The projections and the sub-layer LayerNorm act per position, so
    they run on the chunk unchanged; keep the weights equal on every rank (as DDP or FSDP do).

    Args: those of :class:`~dilated_attention.MultiheadDilatedAttention` (``embed_dim``/``dim``,
    ``num_heads``/``heads``, ``segment_lengths``, ``dilation_rates``, ``bias``, ``layer_norm``,
    ``gamma_init``, ``device``, ``dtype``, ``attention_backend``, ``layer_norm_eps``), with
    ``dropout`` 0.0 only, and those of :class:`RingDilatedAttention` (``process_group``, ``mesh_dim``,
    ``comm``, ``ring_size``, ``use_pattern_cache``, ``enable_memory_pool``,
    ``memory_pool_threshold_mb``, ``check_consistency``).

    ``forward(query, key=None, value=None, is_causal=False) -> (out, None)``.
    """

    # The ring module takes the place of the base class's DilatedAttention (same attributes and
    # forward(q, k, v, is_causal); no key_padding_mask, which the base's forward checks for).
    attention: RingDilatedAttention  # type: ignore[assignment]
    _ragged_hint: ClassVar[str] = (
        "RingMultiheadDilatedAttention takes no key_padding_mask and no packed sequences: give every "
        "rank its (B, N/P, E) shard of sequences of one length N"
    )

    def __init__(
        self,
        embed_dim: int | None = None,
        num_heads: int | None = None,
        segment_lengths: int | Sequence[int] | None = None,
        dilation_rates: int | Sequence[int] | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        layer_norm: bool = True,
        gamma_init: float = 1.0,
        device: str | torch.device | None = None,
        dtype: Any | None = None,
        attention_backend: str = "auto",
        *,
        dim: int | None = None,
        heads: int | None = None,
        layer_norm_eps: float = 1e-5,
        process_group: GroupLike = None,
        mesh_dim: str | int | None = None,
        comm: str = "all_gather",
        ring_size: int | None = None,
        use_pattern_cache: bool = True,
        enable_memory_pool: bool = False,
        memory_pool_threshold_mb: float = 16.0,
        check_consistency: bool | str = True,
        layout: str = "contiguous",
    ) -> None:
        if V.check_dropout(dropout) != 0.0:
            raise ValueError(
                f"RingMultiheadDilatedAttention does not support attention dropout, got "
                f"dropout={dropout!r}; use 0.0"
            )
        super().__init__(
            embed_dim,
            num_heads,
            segment_lengths,
            dilation_rates,
            dropout=0.0,
            bias=bias,
            layer_norm=layer_norm,
            gamma_init=gamma_init,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            dim=dim,
            heads=heads,
            layer_norm_eps=layer_norm_eps,
        )
        self.attention = RingDilatedAttention(
            self.attention.segment_lengths,
            self.attention.dilation_rates,
            process_group=process_group,
            mesh_dim=mesh_dim,
            comm=comm,
            attention_backend=attention_backend,
            use_pattern_cache=use_pattern_cache,
            enable_memory_pool=enable_memory_pool,
            memory_pool_threshold_mb=memory_pool_threshold_mb,
            check_consistency=check_consistency,
            ring_size=ring_size,
            layout=layout,
        )

    @classmethod
    def from_config(
        cls, config: StandardizedRingConfig, process_group: GroupLike = None, **kwargs: Any
    ) -> RingMultiheadDilatedAttention:
        """Build the module of a :class:`StandardizedRingConfig` (``kwargs`` add or override arguments)."""
        if not isinstance(config, StandardizedRingConfig):
            raise TypeError(f"config must be a StandardizedRingConfig, got {type(config).__name__}")
        args: dict[str, Any] = {
            "embed_dim": config.embed_dim,
            "num_heads": config.num_heads,
            "segment_lengths": config.segment_lengths,
            "dilation_rates": config.dilation_rates,
            "dropout": config.dropout,
            "bias": config.bias,
            "layer_norm": config.layer_norm,
            "device": config.device,
            "dtype": config.dtype,
            "attention_backend": config.attention_backend,
            "comm": config.comm,
            "ring_size": config.ring_size,
            "process_group": process_group,
        }
        args.update(kwargs)
        return cls(**args)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """The base class's forward. Where its own checks refuse the inputs before the ring module
        is called, the ring module still takes its place in the calls on the group (its peers raise
        too: :meth:`RingDilatedAttention._refuse`)."""
        entered = self.attention._entered
        try:
            return super().forward(*args, **kwargs)
        except (TypeError, ValueError):
            if self.attention._entered == entered:
                weight = next(self.parameters(), None)
                self.attention._refuse(None if weight is None else weight.device)
            raise

    @property
    def comm(self) -> str:
        return self.attention.comm

    def set_process_group(self, process_group: GroupLike, mesh_dim: str | int | None = None) -> None:
        """Split the sequence over ``process_group`` from the next call on (see
        :meth:`RingDilatedAttention.set_process_group`): needed by a module loaded with ``torch.load``
        that was saved with an explicit process group."""
        self.attention.set_process_group(process_group, mesh_dim)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, comm={self.attention.comm!r}, "
            f"attention_backend={self.attention_backend!r}"
        )
