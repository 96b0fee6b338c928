"""``DropInMultiheadAttention``: dilated attention behind ``nn.MultiheadAttention``'s interface, with
torch's conventions exactly (**True = padding** in ``key_padding_mask``, the opposite of this
library's other modules)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .. import _validation as V
from ._dense import dense_dilated_attention
from ._options import check_embed_heads, check_torch_mha, pick, resolve_dtype
from ._script import NotScriptable
from ._torch_masks import causal_from_attn_mask, real_tokens_from_torch_mask
from .dilated import BranchesOfInner, DilatedAttention

__all__ = ["DropInMultiheadAttention"]


def _width(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    return int(value)


class DropInMultiheadAttention(NotScriptable, BranchesOfInner, nn.Module):
    """A drop-in for ``nn.MultiheadAttention`` that attends with LongNet's dilated pattern.

    **Masks follow torch, not this library's other modules**: in ``key_padding_mask``, bool
    **True = padding** (a key to ignore) or float ``-inf`` = padding and 0 = a real key, exactly as
    ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` take it.
    :class:`DilatedAttention` and :class:`MultiheadDilatedAttention` take the opposite (True = a
    real token, SPEC section 7): a mask made for one is wrong for the other.

    ``DropInMultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
    add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *,
    segment_lengths, dilation_rates, attention_backend="auto")``: ``nn.MultiheadAttention``'s
    arguments in its order and with its defaults (sequence-first unless ``batch_first=True``), then
    the branches. ``add_bias_kv`` and ``add_zero_attn`` append a key to the sequence, which has no
    place in a dilated pattern: True is a ValueError.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (attn_output, attn_weights)``, as torch:

    * query (L, B, E) or (B, L, E) with ``batch_first``, (L, E) unbatched; key (S, B, kdim), value
      (S, B, vdim). Dilated attention pairs the positions of one sequence, so ``S`` must equal ``L``
      (cross-attention over a memory of another length is a ValueError naming both).
    * ``key_padding_mask`` (B, S) or (S,): bool, True = padding, or float, -inf = padding and 0 = a
      real key (other values are a per-key bias: a ValueError); self-attention only (query, key
      and value one tensor): with cross-attention it is a ValueError, since the padded positions
      are packed out of the queries and the keys together. Each row's real keys must be one
      contiguous run (right or left padding; a gap is a ValueError naming the row) and are attended
      as a sequence of their own from position 0 (SPEC section 7). Outputs at padded query positions
      are ``out_proj`` of zero (its bias), as ``nn.TransformerEncoder``'s nested-tensor path gives
      zeros there; torch's own output at those positions is the attention of a padding token, which
      callers discard.
    * ``attn_mask`` (L, S) or (B * num_heads, L, S), bool or float: the causal mask (True, or -inf,
      exactly above the diagonal; ``nn.Transformer.generate_square_subsequent_mask``) means causal
      attention, a mask that masks nothing means none, any other mask is a ValueError (the dilated
      pattern decides which keys a query reads). ``is_causal=True`` alone is enough; with a mask it
      must be the causal one (checked; under ``torch.compile`` by a device-side assertion).
    * ``need_weights=True`` (torch's default) forms the (L, S) attention weights of the dilated
      pattern, as torch forms its own: memory grows with ``L * S``. The weights are averaged over
      heads, (B, L, S), or per head, (B, num_heads, L, S), with ``average_attn_weights=False``.
      ``need_weights=False`` (what torch's transformer layers pass) never forms them and runs the
      fused kernels.

    Inside ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer`` (as ``self_attn``; or as the
    decoder's ``multihead_attn`` when the memory has the target's length and no
    ``memory_key_padding_mask``), train and eval: the
    q, k and v projections are kept as separate weights (``q_proj_weight``, ``k_proj_weight``,
    ``v_proj_weight``, ``in_proj_bias``), torch's layout for ``kdim``/``vdim`` other than
    ``embed_dim``, so ``_qkv_same_embed_dim`` is False, and that tells torch's layers to skip their
    fused dense fast path (which would compute dense attention). ``in_proj_weight`` gives the three
    stacked, (3E, E), when ``kdim == vdim == embed_dim`` (None otherwise), and ``load_state_dict``
    takes the ``in_proj_weight`` of an ``nn.MultiheadAttention`` checkpoint. An
    ``nn.TransformerEncoder`` built with ``nn.MultiheadAttention`` layers passes nested tensors in
    eval mode without gradients; they are taken (padded, attended, nested again). :meth:`from_torch`
    converts a module with its weights.
    """

    __constants__: ClassVar[list[str]] = ["batch_first"]
    in_proj_bias: nn.Parameter | None
    bias_k: None
    bias_v: None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        E = pick("embed_dim", embed_dim, "embed_dim", None)
        H = pick("num_heads", num_heads, "num_heads", None)
        check_embed_heads(E, H)
        if V.check_bool(add_bias_kv, "add_bias_kv") or V.check_bool(add_zero_attn, "add_zero_attn"):
            raise ValueError(
                f"add_bias_kv={add_bias_kv}, add_zero_attn={add_zero_attn}: these append a key to the "
                "sequence, which has no place in a dilated pattern; DropInMultiheadAttention needs both False"
            )
        factory: dict[str, Any] = {"device": device, "dtype": resolve_dtype(dtype, device)}
        self.embed_dim, self.num_heads, self.head_dim = E, H, E // H
        self.kdim, self.vdim = _width(kdim, "kdim", E), _width(vdim, "vdim", E)
        self._qkv_same_embed_dim = False  # separate q/k/v weights: torch's layers skip their fast path
        self.dropout = V.check_dropout(dropout)
        self.batch_first = V.check_bool(batch_first, "batch_first")
        self.q_proj_weight = nn.Parameter(torch.empty(E, E, **factory))
        self.k_proj_weight = nn.Parameter(torch.empty(E, self.kdim, **factory))
        self.v_proj_weight = nn.Parameter(torch.empty(E, self.vdim, **factory))
        if V.check_bool(bias, "bias"):
            self.in_proj_bias = nn.Parameter(torch.empty(3 * E, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(E, E, bias=bias, **factory)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self.attention = DilatedAttention(
            segment_lengths,
            dilation_rates,
            attention_dropout=self.dropout,
            attention_backend=attention_backend,
        )
        self.attention._selector.owner = type(self).__name__
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform projections (over the stacked (3E, E) weight when
        the widths agree, as torch draws it), zero biases, ``out_proj``'s weight as ``nn.Linear``'s."""
        if self.kdim == self.vdim == self.embed_dim:
            stacked = torch.empty(3 * self.embed_dim, self.embed_dim)
            nn.init.xavier_uniform_(stacked)
            with torch.no_grad():
                for w, part in zip(self._projections(), stacked.chunk(3), strict=True):
                    w.copy_(part)
        else:
            for w in self._projections():
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    def _projections(self) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    @property
    def in_proj_weight(self) -> torch.Tensor | None:
        """The q, k and v projection weights stacked, (3E, E), as ``nn.MultiheadAttention`` holds
        them (a new tensor, not a parameter); None when ``kdim`` or ``vdim`` differ from E."""
        if not self.kdim == self.vdim == self.embed_dim:
            return None
        return torch.cat(self._projections())

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # An nn.MultiheadAttention checkpoint holds the stacked in_proj_weight: split it.
        stacked = state_dict.pop(prefix + "in_proj_weight", None)
        if stacked is not None:
            for name, part in zip(("q", "k", "v"), stacked.chunk(3), strict=True):
                state_dict.setdefault(f"{prefix}{name}_proj_weight", part)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(attn_output, attn_weights)``; see the class docstring."""
        need_weights = V.check_bool(need_weights, "need_weights")
        average = V.check_bool(average_attn_weights, "average_attn_weights")
        is_causal = V.check_bool(is_causal, "is_causal")
        widths = (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim))
        for name, t, width in widths:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.is_nested:
                return self._forward_nested(
                    query, key, value, key_padding_mask, need_weights, attn_mask, average
                )
            if t.dim() not in (2, 3) or t.shape[-1] != width or t.dim() != query.dim():
                layout = "(B, L, E)" if self.batch_first else "(L, B, E)"
                raise ValueError(
                    f"{name} must be {layout} or unbatched (L, E) like query, with E = {width}, "
                    f"got shape {tuple(t.shape)} (query {tuple(query.shape)})"
                )
        self_attention = key is query  # before the transposes below make new tensors
        batched = query.dim() == 3
        if not batched:
            query, key, value = query[None], key[None], value[None]
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, _ = query.shape
        if key.shape[:2] != value.shape[:2] or key.shape[0] != B:
            raise ValueError(
                f"key and value must have query's batch size and one length, got key {tuple(key.shape)} "
                f"and value {tuple(value.shape)} for query {tuple(query.shape)} (read batch-first)"
            )
        if key.shape[1] != L:
            raise ValueError(
                f"key length S = {key.shape[1]} differs from query length L = {L}: dilated attention pairs "
                "the positions of one sequence, so cross-attention needs keys of the query's length"
            )
        if key_padding_mask is not None and not self_attention:
            raise ValueError(
                "key_padding_mask with cross-attention (key is another tensor than query): dilated "
                "attention packs the real tokens of one sequence, its queries and keys together (SPEC "
                "section 7), so a mask of the memory alone cannot be applied to the target's queries. "
                "Pass the mask to self-attention (query, key and value the same tensor), or run this "
                "cross-attention with nn.MultiheadAttention"
            )
        real = real_tokens_from_torch_mask(key_padding_mask, B, L, batched)
        causal = causal_from_attn_mask(attn_mask, is_causal, B * self.num_heads, L, L)
        bq, bk, bv = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        H, D = self.num_heads, self.head_dim
        q = F.linear(query, self.q_proj_weight, bq).reshape(B, L, H, D)
        k = F.linear(key, self.k_proj_weight, bk).reshape(B, L, H, D)
        v = F.linear(value, self.v_proj_weight, bv).reshape(B, L, H, D)
        weights = None
        if need_weights:
            dropout_p = self.dropout if self.training else 0.0
            segs, rates = self.segment_lengths, self.dilation_rates
            x, weights = dense_dilated_attention(
                q, k, v, segs, rates, is_causal=causal, real=real, dropout_p=dropout_p
            )
            if average:
                weights = weights.mean(1)  # (B, L, S)
            if not batched:
                weights = weights.squeeze(0)
        else:
            x = self.attention(q, k, v, is_causal=causal, key_padding_mask=real)
        out = self.out_proj(x.reshape(B, L, self.embed_dim))
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _forward_nested(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Any,
        need_weights: bool,
        attn_mask: Any,
        average: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention over a batch-first strided nested tensor, as ``nn.TransformerEncoder``
        passes one in eval mode without gradients when its layers were built with
        ``nn.MultiheadAttention`` (it converts a padded batch with ``src_key_padding_mask``): the
        rows are padded, attended with the padding masked, and nested again."""
        if not (key is query and value is query and self.batch_first and query.layout == torch.strided):
            raise ValueError(
                "nested tensors are taken only as nn.TransformerEncoder passes them (self-attention, the "
                "same batch-first strided nested tensor as query, key and value); give a padded tensor "
                "and key_padding_mask instead"
            )
        if key_padding_mask is not None:
            raise ValueError(
                "key_padding_mask with a nested tensor: the nested tensor's lengths are the mask"
            )
        lengths = query._nested_tensor_size()[:, 0].to(query.device)  # (B,) rows of each sequence
        padded = query.to_padded_tensor(0.0)  # (B, longest, E)
        real = torch.arange(padded.shape[1], device=padded.device)[None] < lengths[:, None]
        out, weights = self.forward(padded, padded, padded, ~real, need_weights, attn_mask, average)
        return torch._nested_tensor_from_mask(out, real, mask_check=False), weights

    if TYPE_CHECKING:  # nn.Module.__call__ is typed as returning Any; give callers forward's types
        __call__ = forward

    @classmethod
    def from_torch(
        cls,
        mha: nn.MultiheadAttention,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        *,
        attention_backend: str = "auto",
    ) -> DropInMultiheadAttention:
        """A drop-in with the weights, widths, dropout, ``batch_first``, device, dtype and training
        mode of ``mha``, attending with the given branches. With one branch ``segment_lengths=[w]``,
        ``w >= L``, ``dilation_rates=[1]``, it computes what ``mha`` computes. ``add_bias_kv`` or
        ``add_zero_attn`` in ``mha`` is a ValueError."""
        check_torch_mha(mha)
        ref = mha.out_proj.weight
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            dropout=float(mha.dropout),
            bias=mha.in_proj_bias is not None,
            kdim=mha.kdim,
            vdim=mha.vdim,
            batch_first=mha.batch_first,
            device=ref.device,
            dtype=ref.dtype,
            segment_lengths=segment_lengths,
            dilation_rates=dilation_rates,
            attention_backend=attention_backend,
        )
        new.load_state_dict(mha.state_dict())
        return new.train(mha.training)

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"
        if not self.kdim == self.vdim == self.embed_dim:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        return s + f", batch_first={self.batch_first}, masks: torch's (True = padding)"
