"""The fused ops under torch.func (``grad``, ``vjp``, ``jacrev``, ``vmap``) and torch.export.

:class:`NativeAttention` runs ``torch.ops.dilated_attention.fwd`` and :class:`NativeVarlenAttention`
the packed ``varlen_fwd`` (``.call``: :func:`~.fixed.native_forward`, :func:`~.varlen.native_varlen_forward`):
``autograd.Function``s written with ``setup_context`` (what
torch.func transforms require; the ops' own ``register_autograd`` formulas are the older kind,
which they refuse, and under forward mode give a zero tangent without a word), whose forward and
backward run the ops. The four ops have vmap rules (``torch.library.register_vmap``): the vmapped
dimension is folded into the batch (the packed ops: into the rows, each vmapped example's
sequences after the previous one's), one kernel call for the whole vmapped batch, so ``vmap`` and
``jacrev`` (a vmap over vjps) need no per-example loop. Forward-mode AD (``jvp``, ``jacfwd``,
``hessian``) has no formula: it raises an error that names it. Under torch.compile and
torch.export the op is called directly (Dynamo does not trace autograd.Functions that define
``jvp`` or take one tensor twice, as self-attention's ``q = k = v``), with the same formula
registered on the op (:func:`register_op_autograd`): one formula per op, two registrations.
"""

from __future__ import annotations

from typing import Any

import torch

from .autograd import forward_mode_message, no_double_backward
from .library import _C, dropout_seed_offset

__all__ = [
    "FusedFunction",
    "NativeAttention",
    "NativeVarlenAttention",
    "batched_bwd_rule",
    "batched_fwd_rule",
    "batched_varlen_bwd_rule",
    "batched_varlen_fwd_rule",
    "dropout_args",
    "fused_backward",
    "fused_function",
    "register_op_autograd",
]


def _fold(x: torch.Tensor, bdim: int | None, size: int) -> torch.Tensor:
    """``x`` with its vmapped dimension ``bdim`` (or, unbatched, a broadcast one) folded into the
    batch dimension: (V, B, ...) -> (V * B, ...)."""
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def batched_fwd_rule(name: str) -> Any:
    """The vmap rule of a fixed-length forward op ``dilated_attention::<name>`` (q, k, v, ...) ->
    (out (B, ...), lse (B, ...)): the vmapped dimension folded into the batch, one call."""

    def rule(info: Any, in_dims: tuple[Any, ...], q, k, v, *rest):
        V = info.batch_size
        q, k, v = (_fold(t, d, V) for t, d in zip((q, k, v), in_dims[:3], strict=True))
        out, lse = getattr(torch.ops.dilated_attention, name)(q, k, v, *rest)
        return (out.unflatten(0, (V, -1)), lse.unflatten(0, (V, -1))), (0, 0)

    return rule


def batched_bwd_rule(name: str) -> Any:
    """The vmap rule of a fixed-length backward op ``dilated_attention::<name>`` (dout, q, k, v,
    out, lse, dlse, ...) -> (dq, dk, dv), as :func:`batched_fwd_rule`."""

    def rule(info: Any, in_dims: tuple[Any, ...], dout, q, k, v, out, lse, dlse, *rest):
        V = info.batch_size
        tensors = [
            None if t is None else _fold(t, d, V)
            for t, d in zip((dout, q, k, v, out, lse, dlse), in_dims[:7], strict=True)
        ]
        grads = getattr(torch.ops.dilated_attention, name)(*tensors, *rest)
        return tuple(g.unflatten(0, (V, -1)) for g in grads), (0, 0, 0)

    return rule


def _fold_lse(x: torch.Tensor, bdim: int | None, size: int) -> torch.Tensor:
    """A packed op's lse (Hq, T) with its vmapped dimension folded into the rows: (Hq, V * T)."""
    x = x.movedim(bdim, 0) if bdim is not None else x.unsqueeze(0).expand(size, *x.shape)
    return x.transpose(0, 1).reshape(x.shape[1], size * x.shape[2])


def _fold_cu_seqlens(cu: torch.Tensor, bdim: int | None, size: int, rows: int) -> torch.Tensor:
    """The cu_seqlens of ``size`` packed batches of ``rows`` rows laid one after the other: the
    sequences of vmapped example ``i`` (its own cu_seqlens where they are vmapped too) start at
    row ``i * rows``."""
    cu = cu.movedim(bdim, 0) if bdim is not None else cu.unsqueeze(0).expand(size, *cu.shape)
    starts = torch.arange(size, device=cu.device, dtype=cu.dtype).mul_(rows).unsqueeze(1)
    return torch.cat([cu[0, :1], (cu[:, 1:] + starts).reshape(-1)])


def batched_varlen_fwd_rule(name: str) -> Any:
    """The vmap rule of a packed forward op ``dilated_attention::<name>`` (q, k, v, cu_seqlens,
    ...) -> (out (T, ...), lse (Hq, T)): the vmapped examples' rows one after the other, their
    sequences in one cu_seqlens, one call."""

    def rule(info: Any, in_dims: tuple[Any, ...], q, k, v, cu_seqlens, *rest):
        V = info.batch_size
        q, k, v = (_fold(t, d, V) for t, d in zip((q, k, v), in_dims[:3], strict=True))
        T = q.shape[0] // V
        cu = _fold_cu_seqlens(cu_seqlens, in_dims[3], V, T)
        out, lse = getattr(torch.ops.dilated_attention, name)(q, k, v, cu, *rest)
        return (out.unflatten(0, (V, T)), lse.unflatten(1, (V, T))), (0, 1)

    return rule


def batched_varlen_bwd_rule(name: str) -> Any:
    """The vmap rule of a packed backward op ``dilated_attention::<name>`` (dout, q, k, v, out,
    lse, dlse, cu_seqlens, ...) -> (dq, dk, dv), as :func:`batched_varlen_fwd_rule`."""

    def rule(info: Any, in_dims: tuple[Any, ...], dout, q, k, v, out, lse, dlse, cu_seqlens, *rest):
        V = info.batch_size
        rows = [_fold(t, d, V) for t, d in zip((dout, q, k, v, out), in_dims[:5], strict=True)]
        T = rows[1].shape[0] // V
        lse = _fold_lse(lse, in_dims[5], V)
        dlse = None if dlse is None else _fold_lse(dlse, in_dims[6], V)
        cu = _fold_cu_seqlens(cu_seqlens, in_dims[7], V, T)
        grads = getattr(torch.ops.dilated_attention, name)(*rows, lse, dlse, cu, *rest)
        return tuple(g.unflatten(0, (V, T)) for g in grads), (0, 0, 0)

    return rule


if _C is not None:
    torch.library.register_vmap("dilated_attention::fwd", batched_fwd_rule("fwd"))
    torch.library.register_vmap("dilated_attention::bwd", batched_bwd_rule("bwd"))
    torch.library.register_vmap("dilated_attention::varlen_fwd", batched_varlen_fwd_rule("varlen_fwd"))
    torch.library.register_vmap("dilated_attention::varlen_bwd", batched_varlen_bwd_rule("varlen_bwd"))


def fused_backward(
    op: Any, ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None, backend: str = "native"
) -> tuple[Any, ...]:
    """The backward of :class:`NativeAttention`, :class:`NativeVarlenAttention` and the views
    driver's ``ViewsAttention``: the op's backward ``op`` on the saved ``(q, k, v, out, lse,
    *extra)`` and ``ctx.config``; no gradient for ``extra`` (cu_seqlens) and the configuration;
    ``backend`` names the backend in the error of a second derivative."""
    q, k, v, out, lse, *extra = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = op(dout, q, k, v, out, lse, dlse, *extra, *ctx.config)
    dq, dk, dv = no_double_backward(backend, (dq, dk, dv), (dout, dlse, q, k, v))
    return (dq, dk, dv) + (None,) * (len(extra) + len(ctx.config))


class FusedFunction(torch.autograd.Function):
    """What :func:`fused_function` makes: an ``autograd.Function`` over one op, and :meth:`call`."""

    @classmethod
    def call(cls, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: the Function applied to ``args``, or, under torch.compile and
        torch.export, the op itself (Dynamo traces it and its ``register_autograd`` formula, which
        saves the same lse; it does not trace autograd.Functions that define ``jvp`` or take one
        tensor twice, as self-attention's ``q = k = v``)."""
        if torch.compiler.is_compiling():
            return cls.forward(*args)
        out, lse = cls.apply(*args)
        return out, lse


def fused_function(
    name: str, fwd: str, bwd: str, tensors: int, backend: str, lse64_at: int | None, doc: str
) -> type[FusedFunction]:
    """A :class:`FusedFunction` (``setup_context`` style, what torch.func transforms take) whose
    forward runs ``torch.ops.dilated_attention.<fwd>`` on its inputs (with ``float64_lse=True``
    inserted at ``lse64_at`` where given) and whose backward runs ``<bwd>`` through
    :func:`fused_backward`. It saves q, k, v, out, lse and the tensor inputs ``3 .. tensors - 1``
    (cu_seqlens), and keeps the other inputs as the configuration the backward op takes after
    them; forward mode raises an error naming ``backend``."""

    def forward(*args: Any) -> Any:
        op = getattr(torch.ops.dilated_attention, fwd)
        return op(*args) if lse64_at is None else op(*args[:lse64_at], True, *args[lse64_at:])

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        out, lse = output
        ctx.save_for_backward(*inputs[:3], out, lse, *inputs[3:tensors])
        ctx.config = tuple(inputs[tensors:])
        ctx.set_materialize_grads(False)  # no zeros for an unused out or lse

    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
        return fused_backward(getattr(torch.ops.dilated_attention, bwd), ctx, dout, dlse, backend)

    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise RuntimeError(forward_mode_message(backend))

    body = {
        "__doc__": doc,
        "__module__": __name__,
        "generate_vmap_rule": True,
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp),
    }
    return type(name, (FusedFunction,), body)


def register_op_autograd(fn: type[FusedFunction], op: str, lse64_at: int | None) -> None:
    """Registers the formula of ``fn`` (its ``setup_context`` and ``backward``) as the autograd of
    the op ``dilated_attention::<op>`` itself, which torch.compile and torch.export trace.

    One formula serves every path: eager and torch.func run ``fn`` (torch.func transforms refuse an
    op's ``register_autograd`` formula), torch.compile runs the op with this registration (Dynamo
    does not trace autograd.Functions that define ``jvp`` or take one tensor twice). Where ``fn``
    inserts ``float64_lse`` into the op's arguments (at ``lse64_at``), the op's inputs hold it and
    its gradient is None."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if lse64_at is not None:
            inputs = inputs[:lse64_at] + inputs[lse64_at + 1 :]
        fn.setup_context(ctx, inputs, output)

    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
        grads = fn.backward(ctx, dout, dlse)
        return grads if lse64_at is None else (*grads[:lse64_at], None, *grads[lse64_at:])

    torch.library.register_autograd(f"dilated_attention::{op}", backward, setup_context=setup_context)


NativeAttention = fused_function(
    "NativeAttention",
    "fwd",
    "bwd",
    3,
    "native",
    7,
    """``(out, lse)`` of the fused op, lse in float64 (the op's ``float64_lse=True``), so that the
    backward recomputes the probabilities without lse's rounding to float32 (see :mod:`.fixed`);
    inputs ``(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, *dropout)``.""",
)

NativeVarlenAttention = fused_function(
    "NativeVarlenAttention",
    "varlen_fwd",
    "varlen_bwd",
    4,
    "native",
    9,
    """``(out, lse)`` of the fused packed op (lse in float64, as :class:`NativeAttention`); inputs
    ``(q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates, is_causal, softmax_scale,
    *dropout)``.""",
)


def dropout_args(dropout_p: float) -> tuple[float, int, int] | tuple[()]:
    """The trailing inputs ``*dropout`` of :class:`NativeAttention` and
    :class:`NativeVarlenAttention` for attention dropout with probability ``dropout_p``:
    ``(dropout_p, dropout_seed, dropout_offset)`` with a new seed and offset
    (:func:`~.library.dropout_seed_offset`); none without dropout (the ops' defaults)."""
    return (float(dropout_p), *dropout_seed_offset()) if dropout_p > 0 else ()
