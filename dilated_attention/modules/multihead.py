"""``MultiheadDilatedAttention``: the LongNet/torchscale multi-head layer, batch-first, with this
library's bool padding mask (True = a real token) and ``nn.MultiheadAttention``'s float masks
(0 = keep, -inf = ignore). For ``nn.MultiheadAttention``'s exact conventions (a bool mask's True =
padding, sequence-first by default), see :mod:`.drop_in`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn

from .. import _validation as V
from .._warnings import LayoutWarning, warn_once
from ._options import check_embed_heads, check_torch_mha, pick, resolve_dtype
from ._script import NotScriptable
from ._torch_masks import causal_from_attn_mask, multihead_real_tokens, refuse_torch_layer_mask
from .dilated import BranchesOfInner, DilatedAttention

__all__ = ["DilatedAttention", "MultiheadDilatedAttention"]


class MultiheadDilatedAttention(NotScriptable, BranchesOfInner, nn.Module):
    """Multi-head dilated attention with ``nn.MultiheadAttention(batch_first=True)``'s argument names.

    **Not a drop-in for nn.MultiheadAttention**: its ``key_padding_mask`` reads **True as a real
    token** (SPEC section 7), the opposite of torch's. To replace an ``nn.MultiheadAttention``
    (e.g. the ``self_attn`` of ``nn.TransformerEncoderLayer``), use
    :class:`~dilated_attention.DropInMultiheadAttention`, which takes torch's masks as they are.

    LongNet/torchscale layout: q, k, v projections, dilated attention over the heads, a sub-layer
    LayerNorm before the output projection (``layer_norm=True``, MAGNETO/torchscale "subln"), and
    the output projection. Weights are Xavier-normal initialised, with gain ``gamma_init`` on the
    value and output projections (MAGNETO); biases are zero.

    Args:
        embed_dim (or ``dim``): model width E, a multiple of ``num_heads``.
        num_heads (or ``heads``): number of heads H; head dim ``E // H`` must be <= 256.
        segment_lengths, dilation_rates: the branches (see :class:`DilatedAttention`).
        dropout: dropout on the attention weights, in training mode only.
        bias: biases in the projections.
        layer_norm: the sub-layer LayerNorm before ``out_proj``. With ``layer_norm=False``, one
            branch whose segment covers the whole sequence (``segment_lengths=[w]`` with
            ``w >= N``, ``dilation_rates=[1]``) and the same weights, the module computes what
            ``nn.MultiheadAttention(batch_first=True)`` computes (see :meth:`from_torch`).
        gamma_init: Xavier gain of ``v_proj`` and ``out_proj``.
        device, dtype: of the parameters; ``dtype="auto"`` takes
            :func:`dilated_attention.hardware.recommended_dtype` of ``device``.
        attention_backend, ordering, grid: see :class:`DilatedAttention`.
        layer_norm_eps: epsilon of the LayerNorm.

    Both spellings of the width and head count are accepted (``embed_dim``/``dim``,
    ``num_heads``/``heads``); giving both with different values is an error.

    ``forward(query, key=None, value=None, key_padding_mask=None, need_weights=None,
    attn_mask=None, average_attn_weights=True, is_causal=False) -> (out, None)``: the arguments
    of ``nn.MultiheadAttention.forward``, in its order. query, key and value are (B, N, E) (or
    (N, E) unbatched), all of the same length N; ``forward(x)`` is self-attention.
    ``key_padding_mask`` (B, N) (or (N,) unbatched), bool or integer 0/1: **True (1) = a real
    token**, False (0) = padding (**the opposite of** ``nn.MultiheadAttention``'s bool mask). A
    floating mask is read as ``nn.MultiheadAttention`` reads it, added to the scores: **0 = a real
    key, -inf = padding** (any other value, a per-key bias or a 0/1 mask given as floats, is a
    ValueError naming it). That is the form ``nn.TransformerEncoderLayer`` passes its
    ``src_key_padding_mask`` on in (it converts torch's bool mask, True = padding, to the input's
    dtype), so inside that layer give ``src_key_padding_mask`` in torch's convention.
    ``nn.TransformerDecoderLayer`` passes its masks on as given, with ``need_weights=False``: a
    bool ``key_padding_mask`` in a call that names ``need_weights`` (the way torch's layers call
    their ``self_attn``) is therefore a ValueError, since it would arrive in torch's convention and
    be read in this one's, and an integer one a TypeError, as ``nn.MultiheadAttention`` refuses it
    (only bool and floating masks); use :class:`~dilated_attention.DropInMultiheadAttention` there. Each row's real tokens must be
    one contiguous run and are attended as a sequence of their own (see :class:`DilatedAttention`);
    padded positions get attention output 0 (the output projection's bias still applies) and pass
    no gradient to the real tokens. The second
    result stands where ``nn.MultiheadAttention`` returns its attention weights, which dilated
    attention never forms: ``need_weights=True`` is an error, and ``average_attn_weights`` is
    accepted and changes nothing (``need_weights`` None or False: no weights). ``attn_mask`` (N, N) or (B * H, N, N) may be the causal mask
    (boolean, True above the diagonal, or float, -inf above the diagonal and 0 elsewhere), which
    means ``is_causal=True``, or a mask that masks nothing (all False, or all 0), which means no
    mask; any other mask is an error, since a dilated pattern is not a dense mask, and so is
    ``is_causal=True`` with a mask that is not causal. The module is batch-first only: inside
    ``nn.TransformerEncoderLayer`` build the layer with ``batch_first=True``.
    :meth:`from_torch` converts an ``nn.MultiheadAttention`` with its weights.
    """

    batch_first = True
    # Separate q/k/v projections: torch's transformer layers skip their fused dense fast path and
    # call forward, whose checks then apply in train and eval mode alike.
    _qkv_same_embed_dim = False
    # The end of the error for a nested query, key or value: what takes sequences of different lengths.
    _ragged_hint: ClassVar[str] = (
        "for sequences of different lengths pad them to one length and pass key_padding_mask "
        "(True = a real token)"
    )
    embed_dim: int
    num_heads: int
    head_dim: int
    dropout: float
    gamma_init: float
    attention: DilatedAttention
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    norm: nn.LayerNorm | None
    out_proj: nn.Linear

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
        dtype: str | torch.dtype | None = None,
        attention_backend: str = "auto",
        ordering: str = "sequence",
        grid: Sequence[int] | None = None,
        *,
        dim: int | None = None,
        heads: int | None = None,
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        E = pick("embed_dim", embed_dim, "dim", dim)
        H = pick("num_heads", num_heads, "heads", heads)
        check_embed_heads(E, H)
        if segment_lengths is None or dilation_rates is None:
            raise TypeError("segment_lengths and dilation_rates are required")
        bias = V.check_bool(bias, "bias")
        layer_norm = V.check_bool(layer_norm, "layer_norm")
        if (
            isinstance(gamma_init, bool)
            or not isinstance(gamma_init, numbers.Real)
            or not math.isfinite(gamma_init)
            or gamma_init <= 0
        ):
            raise ValueError(f"gamma_init must be a finite number > 0, got {gamma_init!r}")
        if (
            isinstance(layer_norm_eps, bool)
            or not isinstance(layer_norm_eps, numbers.Real)
            or not layer_norm_eps > 0
        ):
            raise ValueError(f"layer_norm_eps must be a number > 0, got {layer_norm_eps!r}")
        param_dtype = resolve_dtype(dtype, device)
        factory = {"device": device, "dtype": param_dtype}

        self.embed_dim, self.num_heads, self.head_dim = E, H, E // H
        self.dropout = V.check_dropout(dropout)
        self.gamma_init = float(gamma_init)
        self.attention = DilatedAttention(
            segment_lengths,
            dilation_rates,
            attention_dropout=self.dropout,
            attention_backend=attention_backend,
            ordering=ordering,
            grid=grid,
        )
        self.attention._selector.owner = type(self).__name__  # the name in the backend log lines
        self.q_proj = nn.Linear(E, E, bias=bias, **factory)
        self.k_proj = nn.Linear(E, E, bias=bias, **factory)
        self.v_proj = nn.Linear(E, E, bias=bias, **factory)
        self.norm = nn.LayerNorm(E, eps=float(layer_norm_eps), **factory) if layer_norm else None
        self.out_proj = nn.Linear(E, E, bias=bias, **factory)
        self._reset_parameters()

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        """The q, k and v biases stacked, (3E,), as ``nn.MultiheadAttention`` holds them (a new
        tensor); None without biases."""
        biases: list[torch.Tensor] = [
            p.bias for p in (self.q_proj, self.k_proj, self.v_proj) if p.bias is not None
        ]
        return torch.cat(biases) if len(biases) == 3 else None

    # Names that users of LongNet-style code know.
    @property
    def dim(self) -> int:
        return self.embed_dim

    @property
    def heads(self) -> int:
        return self.num_heads

    @property
    def attention_backend(self) -> str:
        return self.attention.attention_backend

    def _reset_parameters(self) -> None:
        nn.init.xavier_normal_(self.q_proj.weight)
        nn.init.xavier_normal_(self.k_proj.weight)
        nn.init.xavier_normal_(self.v_proj.weight, gain=self.gamma_init)
        nn.init.xavier_normal_(self.out_proj.weight, gain=self.gamma_init)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool | None = None,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """``(out, None)``; see the class docstring for the arguments."""
        if need_weights is not None:
            V.check_bool(need_weights, "need_weights")
        V.check_bool(average_attn_weights, "average_attn_weights")
        is_causal = V.check_bool(is_causal, "is_causal")
        if need_weights:
            raise ValueError(
                "need_weights=True: dilated attention never forms the (N, N) attention weights (its "
                "memory stays linear in N; a query attends to a few dilated segments, not to a dense "
                "row), so there are none to return. Pass need_weights=False; the second result is None."
            )
        if need_weights is not None:
            refuse_torch_layer_mask(key_padding_mask)
        if (key is None) != (value is None):
            raise ValueError(
                "give both key and value, or neither (self-attention), got only "
                f"{'key' if value is None else 'value'}"
            )
        if key is None or value is None:
            key = value = query
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.is_nested or t.layout != torch.strided:
                kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
                raise TypeError(f"{name} must be a dense (strided) tensor, got {kind}; {self._ragged_hint}")
            if t.dim() not in (2, 3) or t.shape[-1] != self.embed_dim:
                raise ValueError(
                    f"{name} must be (B, N, {self.embed_dim}) or (N, {self.embed_dim}), "
                    f"got shape {tuple(t.shape)}"
                )
            weight = self.q_proj.weight
            if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
                raise ValueError(
                    f"{name} is {t.dtype} but the module's weights are {weight.dtype}; convert one of "
                    f"them (module.to({t.dtype}) or {name}.to({weight.dtype}))"
                )
        if not query.shape == key.shape == value.shape:
            raise ValueError(
                f"query, key and value must have the same shape (dilated attention needs one "
                f"sequence length), got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dim() == 1:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        B, N, _ = query.shape
        is_causal = causal_from_attn_mask(attn_mask, is_causal, B * self.num_heads, N, N)
        key_padding_mask = multihead_real_tokens(key_padding_mask, B, N)
        if not torch.compiler.is_compiling():
            self._check_layout(query)
        q = self.q_proj(query).view(B, N, self.num_heads, self.head_dim)  # (B, N, H, D)
        k = self.k_proj(key).view(B, N, self.num_heads, self.head_dim)
        v = self.v_proj(value).view(B, N, self.num_heads, self.head_dim)
        if key_padding_mask is None:
            x = self.attention(q, k, v, is_causal=is_causal)
        elif isinstance(self.attention, DilatedAttention):
            x = self.attention(q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask)
        else:
            raise ValueError(f"key_padding_mask is not supported by {type(self.attention).__name__}")
        x = x.reshape(B, N, self.embed_dim)  # (B, N, E)
        if self.norm is not None:
            x = self.norm(x)
        x = self.out_proj(x)
        return (x.squeeze(0) if unbatched else x), None

    if TYPE_CHECKING:  # nn.Module.__call__ is typed as returning Any; give callers forward's types
        __call__ = forward

    def _check_layout(self, query: torch.Tensor) -> None:
        """Warn once when a (B, N, E) input looks sequence-first, (N, B, E): the first dimension
        reaches the longest segment while the second is shorter and at most an eighth of it."""
        first, second = int(query.shape[0]), int(query.shape[1])
        longest = max(self.segment_lengths)
        if second < longest <= first and first >= 8 * second:
            warn_once(
                ("sequence-first", first, second),
                f"{type(self).__name__}: input of shape {tuple(query.shape)} is read as (B, N, E) = "
                f"batch {first}, {second} positions, shorter than the segment length {longest}. If it "
                f"is sequence-first (N, B, E), as nn.MultiheadAttention takes by default, pass "
                f"x.transpose(0, 1) (the output is then (B, N, E)).",
                LayoutWarning,
            )

    @classmethod
    def from_torch(
        cls,
        mha: nn.MultiheadAttention,
        segment_lengths: int | Sequence[int],
        dilation_rates: int | Sequence[int],
        *,
        layer_norm: bool = False,
        attention_backend: str = "auto",
        ordering: str = "sequence",
        grid: Sequence[int] | None = None,
    ) -> MultiheadDilatedAttention:
        """A module with the weights of ``mha`` (its in_proj, split into q/k/v, and out_proj),
        dropout, device and dtype, attending with the given branches.

        ``layer_norm=False`` (the default here) keeps ``nn.MultiheadAttention``'s layout, so that
        with ``segment_lengths=[w]``, ``w >= N``, and ``dilation_rates=[1]`` the result equals
        ``mha(x, x, x, need_weights=False)`` for (B, N, E) inputs. The converted module is batch-first:
        an ``mha`` built with ``batch_first=False`` gives a :class:`LayoutWarning` saying so.
        Separate key/value widths (``kdim``/``vdim``), ``add_bias_kv`` and ``add_zero_attn`` have
        no counterpart and are a ``ValueError``.
        """
        check_torch_mha(mha)
        E, H = mha.embed_dim, mha.num_heads
        if not mha._qkv_same_embed_dim:
            raise ValueError(
                f"mha has kdim={mha.kdim} and vdim={mha.vdim} besides embed_dim={E}; "
                "MultiheadDilatedAttention projects keys and values of width embed_dim only"
            )
        if not mha.batch_first:
            warn_once(
                ("from_torch-batch-first",),
                "MultiheadDilatedAttention.from_torch: the source module takes sequence-first inputs "
                "(batch_first=False); the converted module takes (B, N, E): pass x.transpose(0, 1).",
                LayoutWarning,
            )
        weight = mha.in_proj_weight
        has_bias = mha.in_proj_bias is not None
        new = cls(
            E,
            H,
            segment_lengths,
            dilation_rates,
            dropout=float(mha.dropout),
            bias=has_bias,
            layer_norm=layer_norm,
            device=weight.device,
            dtype=weight.dtype,
            attention_backend=attention_backend,
            ordering=ordering,
            grid=grid,
        )
        with torch.no_grad():
            for i, proj in enumerate((new.q_proj, new.k_proj, new.v_proj)):
                proj.weight.copy_(weight[i * E : (i + 1) * E])
                if proj.bias is not None and mha.in_proj_bias is not None:
                    proj.bias.copy_(mha.in_proj_bias[i * E : (i + 1) * E])
            new.out_proj.weight.copy_(mha.out_proj.weight)
            if new.out_proj.bias is not None:
                if mha.out_proj.bias is not None:
                    new.out_proj.bias.copy_(mha.out_proj.bias)
                else:
                    new.out_proj.bias.zero_()
        new.train(mha.training)
        return new

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"gamma_init={self.gamma_init}, attention_backend={self.attention_backend!r} "
            f"(in use: {self.attention.selected_backends})"
        )
