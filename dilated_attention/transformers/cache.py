"""A transformers ``Cache`` on the bounded cache: ``generate()`` in memory fixed by the branches.

:class:`BoundedDilatedCache` is a ``transformers.Cache`` whose layers
(:class:`BoundedDilatedLayer`, transformers' per-layer cache interface) each hold a
:class:`~dilated_attention.decode.BoundedDilatedKVCache`: per branch and kv head only the current
segment at the phases of the heads that read it. Pass it to ``generate()`` of a model made with
``attn_implementation="dilated_attention"``::

    import dilated_attention.transformers_cache as dtc

    out = model.generate(ids, attention_mask=mask, cache=dtc.BoundedDilatedCache(model.config))

``cache=`` is the name transformers 5.24 gives ``generate()``'s cache argument; earlier versions call
it ``past_key_values=`` (which 5.24 still takes, with a ``FutureWarning``).
:data:`GENERATE_CACHE_KWARG` is the name the installed version takes:
``model.generate(ids, **{dtc.GENERATE_CACHE_KWARG: cache})``.

The model's attention layer calls the cache's ``update`` with the new keys and values; the layer
does not return the whole sequence (it does not keep it) but marks the new keys, and the attention
function registered under ``"dilated_attention"`` (this module wraps
:func:`dilated_attention.transformers.dilated_attention_forward`) attends with the bounded cache:
the fused step for one new token, the prefill by the backend of ``config.dilated_attention``.
Left padding (``generate()``'s batches) is honoured; right padding among new tokens, beam search,
cropping and attention implementations other than ``"dilated_attention"`` are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ..decode.bounded import BoundedDilatedKVCache
from . import attention as _attn

__all__ = ["GENERATE_CACHE_KWARG", "BoundedDilatedCache", "BoundedDilatedLayer"]


def _generate_cache_kwarg(version: str) -> str:
    """The name of ``generate()``'s cache argument in transformers ``version``: ``"cache"`` from
    5.24 on (``past_key_values`` is deprecated there), ``"past_key_values"`` before."""
    return "cache" if Version(version).release >= (5, 24) else "past_key_values"


#: The keyword under which the installed transformers' ``generate()`` takes a cache.
GENERATE_CACHE_KWARG: str = _generate_cache_kwarg(transformers.__version__)

_MARK = "_dilated_attention_bounded_layer"


class BoundedDilatedLayer(CacheLayerMixin):
    """One layer of :class:`BoundedDilatedCache` (transformers' ``CacheLayerMixin``)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        num_heads: int,
        segment_lengths: list[int],
        dilation_rates: list[int],
        backend: str,
        max_cache_len: int | None,
    ) -> None:
        super().__init__()
        self.num_heads, self.segment_lengths, self.dilation_rates = num_heads, segment_lengths, dilation_rates
        self.backend, self.max_cache_len = backend, max_cache_len
        self.cache: BoundedDilatedKVCache | None = None
        self.seen = 0  # positions given to the model, padding included: transformers' sequence length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, Hkv, _, D = key_states.shape
        self.cache = BoundedDilatedKVCache(
            1, B, self.num_heads, Hkv, D, self.segment_lengths, self.dilation_rates,
            max_seqlen=self.max_cache_len, dtype=key_states.dtype, device=key_states.device,
        )  # fmt: skip
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = self.cache.k[0], self.cache.v[0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the new keys (marked for the attention function) and values: the layer attends
        and caches them in :meth:`attend`, called by the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        marked = key_states.view_as(key_states)
        setattr(marked, _MARK, self)
        return marked, value_states

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
    ) -> torch.Tensor:
        """q (B, m, Hq, D), k, v (B, m, Hkv, D): the new tokens; ``mask`` the (B, used) padding mask
        of the attention mask function (or None). Returns out (B, m, Hq, D)."""
        assert self.cache is not None  # initialised by update
        m = q.shape[1]
        counts = None
        if mask is not None:
            new = mask[:, -m:]
            counts = new.sum(dim=1)
            left = torch.arange(m, device=new.device) >= (m - counts)[:, None]
            if not torch.equal(new, left):
                bad = int((new != left).any(dim=1).nonzero()[0])
                raise ValueError(
                    f"the bounded cache takes new tokens left-padded (real tokens last); row {bad} of the "
                    f"attention mask has {new[bad].int().tolist()}"
                )
        try:
            out = self.cache.attend(0, q, k, v, num_new=counts, softmax_scale=scaling, backend=self.backend)
        except ValueError as err:  # in the words of this cache's argument
            if "beyond max_seqlen" not in str(err):
                raise
            raise ValueError(
                f"BoundedDilatedCache: this generation would hold more tokens than max_cache_len="
                f"{self.max_cache_len} ({err}); pass a larger max_cache_len, or None"
            ) from None
        assert isinstance(out, torch.Tensor)  # return_lse is False
        self.cache.advance(m if counts is None else counts)
        self.seen += m
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()
        self.seen = 0

    def memory_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.memory_bytes()

    def _refuse(self, what: str) -> None:
        raise ValueError(
            f"the bounded dilated cache cannot {what}: it keeps only the keys later queries read"
        )

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse(f"crop {tokens_to_remove} tokens")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("reorder its rows (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse(f"repeat its rows ({repeats} times)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("select rows")


class BoundedDilatedCache(Cache):
    """A ``transformers.Cache`` of :class:`BoundedDilatedLayer` for a model with
    ``attn_implementation="dilated_attention"``: branches from ``config.dilated_attention``, query
    heads from ``config.num_attention_heads``. ``max_cache_len`` (optional) caps the slots of
    branches whose segments are longer than the generation."""

    def __init__(self, config: Any, max_cache_len: int | None = None) -> None:
        if max_cache_len is not None and (
            isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1
        ):
            raise ValueError(
                f"BoundedDilatedCache: max_cache_len must be an int >= 1 or None, got {max_cache_len!r}"
            )
        impl = getattr(config, "_attn_implementation", None)
        if impl != _attn.NAME:
            raise ValueError(
                f"the bounded dilated cache needs a model with attn_implementation={_attn.NAME!r}, got {impl!r}"
            )
        segs, rates, backend = _attn.settings(config)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads, n = config.num_attention_heads, config.num_hidden_layers
        super().__init__(
            layers=[BoundedDilatedLayer(heads, segs, rates, backend, max_cache_len) for _ in range(n)]
        )

    def memory_bytes(self) -> int:
        """Bytes of keys and values held by every layer."""
        return sum(layer.memory_bytes() for layer in self.layers if isinstance(layer, BoundedDilatedLayer))


def dilated_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`dilated_attention.transformers.dilated_attention_forward`, with the keys of a
    :class:`BoundedDilatedLayer` attended through that layer."""
    layer = getattr(key, _MARK, None)
    if not isinstance(layer, BoundedDilatedLayer):
        return _attn.dilated_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            is_causal=is_causal,
            **kwargs,
        )
    _attn.refuse_unsupported(kwargs)
    if dropout > 0:
        raise ValueError(f"the bounded dilated cache runs without attention dropout, got dropout={dropout}")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError("the bounded dilated cache runs causal self-attention only")
    out = layer.attend(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask, scaling
    )
    return out, None


AttentionInterface.register(_attn.NAME, dilated_attention_forward)
