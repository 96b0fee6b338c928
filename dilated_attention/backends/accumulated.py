"""The merged path of the gather-based backends: kernels on strided views, one accumulator.

Forward: every kernel call (see :mod:`.strided`) reads strided views of q, k and v, and its
``out``/``lse`` are merged by log-sum-exp straight into views of one running merge (SPEC section 3;
:func:`dilated_attention.merge.merge_state_`): the unnormalised output, the largest lse and the sum
of the weights ``exp(lse_i - max)``, in float64 for float32 and float64 inputs (float32 for
float16/bfloat16), normalised once and rounded once at the end. Backward: each call's kernel
backward is fed the *merged* ``out`` and ``lse`` of its rows (as ring attention does), and its
gradients are added in place into strided views of dq, dk and dv (float32 accumulators only where
several calls add into a position of a float16/bfloat16 gradient).

Both directions are ``autograd.Function`` with ``setup_context`` and a ``vmap`` rule that folds
the vmapped dimension into the batch, so ``torch.func.grad``, ``vjp``, ``jacrev`` and ``vmap``
work. The backward is itself a Function whose backward raises: a kernel backward has no
derivative (use ``backend='manual'`` to differentiate twice).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..merge import beside, finish_state, merge_dtype, merge_state_, merged_state, start_state
from ..op.autograd import _message, forward_mode_message
from .base import lse_dtype
from .strided import Call, batches, last_dim_contiguous, view, write

__all__ = ["MergedAttention", "TracedMergedAttention", "kernel_backward", "kernel_values"]


def _is_batched(x: torch.Tensor) -> bool:
    """Whether ``x`` is batched by ``torch.func.vmap`` at some level, also under the wrappers of
    the transforms inside it (``vmap(grad(f))`` hands f a gradient-tracking wrapper of a batched
    tensor, whose values cannot be read either)."""
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(x):
        if f.is_batchedtensor(x):
            return True
        x = f.get_unwrapped(x)
    return False


def _maybe_nonfinite(x: torch.Tensor) -> bool:
    """Whether ``x`` may hold inf or NaN (always True where the values cannot be read here)."""
    if torch.compiler.is_compiling() or _is_batched(x) or x.device.type == "meta":
        return True
    return not bool(torch.isfinite(x).all())


def kernel_values(v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """The values the kernels read, forward and backward: v itself, except that with causal
    masking its non-finite entries are replaced by 0 (a new tensor; v where it has none).

    A masked key's weight is 0, and 0 * inf and 0 * NaN are NaN: a non-finite ``v[x]`` would reach
    the rows before ``x`` in its sub-sequence, forward, and backward their ``dout . v_x`` (so
    ``delta``, which the merged backward sums over every branch of the row, and through it the
    gradients of the row's keys in the other branches). The forward adds the non-finite entries
    back to the rows that read them (``driver._NonFinite``); the backward computes ``dq`` and
    ``dk`` with them taken as 0 (``dv`` does not read v)."""
    if is_causal and _maybe_nonfinite(v):
        return torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    return v


def _fold(x: torch.Tensor | None, d: int | None, V: int) -> torch.Tensor | None:
    """Move the vmapped dim ``d`` of ``x`` into its batch dim (expanding an unbatched ``x``)."""
    if x is None:
        return None
    x = x.unsqueeze(0).expand(V, *x.shape) if d is None else x.movedim(d, 0)
    return x.reshape(V * x.shape[1], *x.shape[2:])


def _lse_of(lse_bnh: torch.Tensor, call: Call, lse_len: int) -> torch.Tensor:
    """The merged lse of the call's rows, (Bb, h, lse_len) contiguous, as the kernel returned it."""
    lg = view(lse_bnh.unsqueeze(-1), call, call.q)[..., 0].transpose(1, 2)
    if lse_len == call.m:
        return lg.contiguous()
    padded = lg.new_zeros((*lg.shape[:-1], lse_len))
    padded[..., : call.m] = lg
    return padded


def _add(dst: torch.Tensor, sl: slice, call: Call, s: Any, val: torch.Tensor) -> torch.Tensor:
    """dst with its view of ``call`` at heads ``s`` (batch slice ``sl``) increased by val (a
    stride-0, shared, head takes the sum); in place but under torch.compile (views.write)."""
    if s.expanded:
        s = type(s)(s.p0, s.dp, s.c0, 1, 1)
        val = val.sum(2, keepdim=True)
    return write(dst, sl, call, s, val, add=True)


def kernel_backward(
    backend: Any,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    extra: Any,
    *,
    is_causal: bool,
    scale: float,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one kernel call's q, k, v given the *merged* ``out`` and ``lse`` of its rows
    and the gradients ``dout`` (Bb, m, h, D) and ``dlse`` (Bb, h, m) of the merged result (either
    may be None). ``lse`` is in the layout the backend's ``attn_forward`` returned.

    With ``rows``, the ``(delta, norm)`` of the call's rows ((Bb, m, h) each, :func:`_merged_rows`),
    one call of the backend's backward does both terms (``dS = P (dP - delta + dlse)``), adding its
    gradients into ``into`` (views of dq, dk, dv, in lse's dtype) where given. Otherwise the
    ``dlse`` term ``dS += P * dlse`` comes from one more backward call with ``v = 0``,
    ``out = e_0`` and ``dout = -dlse * e_0`` (``e_0`` the first unit vector of the head dim), for
    which the kernel's formula gives exactly ``P * dlse``.
    """
    if rows is not None:
        delta = rows[0] if dlse is None else rows[0] - dlse.transpose(1, 2).to(rows[0].dtype)
        return backend.attn_backward(
            q.new_zeros(q.shape) if dout is None else dout.to(q.dtype),
            q,
            k,
            v,
            out,
            lse,
            extra,
            is_causal=is_causal,
            scale=scale,
            delta=delta,
            norm=rows[1],
            into=into,
        )
    grads: list[torch.Tensor] | None = None
    if dout is not None:
        grads = list(
            backend.attn_backward(
                dout.to(q.dtype),
                q,
                k,
                v,
                out.to(q.dtype),
                lse,
                extra,
                is_causal=is_causal,
                scale=scale,
            )
        )
    if dlse is not None:
        unit_out = q.new_zeros(q.shape)
        unit_out[..., 0] = 1
        d_unit = q.new_zeros(q.shape)
        d_unit[..., 0] = -dlse.transpose(1, 2).to(q.dtype)
        g = backend.attn_backward(
            d_unit,
            q,
            k,
            v.new_zeros(v.shape),
            unit_out,
            lse,
            extra,
            is_causal=is_causal,
            scale=scale,
        )
        if grads is None:
            grads = [g[0], g[1], v.new_zeros(v.shape)]
        else:  # summed in the accumulation dtype
            grads[0] = grads[0].to(lse.dtype) + g[0].to(lse.dtype)
            grads[1] = grads[1].to(lse.dtype) + g[1].to(lse.dtype)
    if grads is None:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return grads[0], grads[1], grads[2]


class TracedMergedAttention(torch.autograd.Function):
    """(q, k, v) -> (out (B, N, Hq, D), lse (B, Hq, N), lse (B, N, Hq), kernel aux); what
    torch.compile traces (Dynamo does not trace an autograd.Function that defines ``jvp``).
    :class:`MergedAttention` adds the refusal of forward mode."""

    @staticmethod
    def forward(q, k, v, backend, plan, is_causal, scale, nonfinite):
        B, N, Hq, D = q.shape
        # the running merge (merge.merge_state_): unnormalised out, max lse and sum of weights, in
        # float64 for float32 inputs, normalised once at the end
        wt = merge_dtype(q.dtype, q.device)
        out_acc = q.new_zeros((B, N, Hq, D), dtype=wt)
        m4 = q.new_full((B, N, Hq, 1), -math.inf, dtype=wt)
        l4 = q.new_zeros((B, N, Hq, 1), dtype=wt)
        nf = nonfinite(q, k, v)
        aux = []
        for b, calls in enumerate(plan):
            for call in calls:
                for sl in batches(call, B, N):
                    qv, kv, vv = (
                        view(x[sl], call, s) for x, s in ((q, call.q), (k, call.kv), (nf.v_kernel, call.kv))
                    )
                    og, lg, extra = backend.attn_forward(qv, kv, vv, is_causal=is_causal, scale=scale)
                    aux.append((lg.shape[-1], extra))
                    og, lg = nf.apply(call, og, lg[..., : call.m], sl)
                    lg = beside(lg).to(wt)
                    if torch.compiler.is_compiling():  # out of place (views.write)
                        if b > 0:
                            og, mg, sg = merged_state(
                                view(out_acc[sl], call, call.q),
                                view(m4[sl], call, call.q),
                                view(l4[sl], call, call.q),
                                og,
                                lg,
                            )
                        else:
                            og, mg, sg = start_state(og, lg, wt)
                        out_acc = write(out_acc, sl, call, call.q, og)
                        m4 = write(m4, sl, call, call.q, mg)
                        l4 = write(l4, sl, call, call.q, sg)
                        continue
                    merge_state_(
                        view(out_acc[sl], call, call.q),
                        view(m4[sl], call, call.q),
                        view(l4[sl], call, call.q),
                        og,
                        lg,
                        first=b == 0,
                    )
        out_w, lse4 = finish_state(out_acc, m4, l4)
        lse_acc = lse4[..., 0].to(lse_dtype(q.dtype))
        return out_w.to(q.dtype), lse_acc.transpose(1, 2).contiguous(), lse_acc, aux

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, backend, plan, is_causal, scale, _ = inputs
        out, _, lse_bnh, aux = output
        ctx.save_for_backward(q, k, v, out, lse_bnh)
        ctx.backend, ctx.plan, ctx.is_causal, ctx.scale, ctx.aux = backend, plan, is_causal, scale, aux
        ctx.mark_non_differentiable(lse_bnh)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlse, _dlse_bnh, _aux):
        q, k, v, out, lse_bnh = ctx.saved_tensors
        v = kernel_values(v, ctx.is_causal)  # as the forward's kernels read it
        dq, dk, dv = MergedBackward.apply(
            dout, dlse, q, k, v, out, lse_bnh, ctx.backend, ctx.plan, ctx.is_causal, ctx.scale, ctx.aux
        )
        return dq, dk, dv, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, backend, plan, is_causal, scale, nonfinite):
        V = info.batch_size
        out, lse, lse_bnh, aux = MergedAttention.apply(
            _fold(q, in_dims[0], V),
            _fold(k, in_dims[1], V),
            _fold(v, in_dims[2], V),
            backend,
            plan,
            is_causal,
            scale,
            nonfinite,
        )
        unf = (out.unflatten(0, (V, -1)), lse.unflatten(0, (V, -1)), lse_bnh.unflatten(0, (V, -1)), aux)
        return unf, (0, 0, 0, None)


class MergedAttention(TracedMergedAttention):
    """:class:`TracedMergedAttention` that refuses forward-mode AD by name."""

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(forward_mode_message(ctx.backend.name))


def _kernel_calls(plan, aux, B: int, N: int):
    """The forward's kernel calls in its order: ``(call, batch slice, lse length, kernel aux)``."""
    calls = ((call, sl) for calls in plan for call in calls for sl in batches(call, B, N))
    for (call, sl), (lse_len, extra) in zip(calls, aux, strict=True):
        yield call, sl, lse_len, extra


def _merged_rows(dout, q, k, v, lse_bnh, backend, plan, is_causal, scale, aux):
    """``(delta, norm)`` (B, N, Hq, 1) each, for a backend with
    :meth:`~.driver.StridedBackend.row_dots` (else None): over the keys of every call,
    ``Z = sum_x P(p, x)`` and ``norm = 1 / Z``, ``delta = sum_x P(p, x) (dout_p . v_x) / Z``.

    In exact arithmetic Z = 1 and delta = rowsum(dout * out). Computed from the backward's own
    probabilities, as PyTorch's softmax backward computes them, the probabilities sum to 1 (a
    forward lse from another kernel, an approximate exponential or a float32 rounding of lse would
    scale a whole row) and the rounding of delta cancels against that of ``dout . v_x`` in
    ``dS = P (dout . v_x - delta)``, where the forward's ``out`` (another kernel, another order of
    summation) would leave both in dS, times P ~ 1 for a row whose weight sits on one key (large
    logits): several times plain PyTorch's error in dk."""
    B, N = q.shape[0], q.shape[1]
    dots: torch.Tensor | None = None
    total: torch.Tensor | None = None
    if dout is None:
        dout = q.new_zeros(q.shape)
    for call, sl, lse_len, _ in _kernel_calls(plan, aux, B, N):
        got = backend.row_dots(
            view(dout[sl], call, call.q),
            view(q[sl], call, call.q),
            view(k[sl], call, call.kv),
            view(v[sl], call, call.kv),
            _lse_of(lse_bnh[sl], call, lse_len),
            is_causal=is_causal,
            scale=scale,
        )
        if got is None:
            return None
        if dots is None or total is None:
            dots, total = lse_bnh.new_zeros((*lse_bnh.shape, 1)), lse_bnh.new_zeros((*lse_bnh.shape, 1))
        dots = write(dots, sl, call, call.q, got[0].unsqueeze(-1), add=True)
        total = write(total, sl, call, call.q, got[1].unsqueeze(-1), add=True)
    if dots is None or total is None:
        return None
    norm = torch.where(total > 0, total.reciprocal(), torch.ones_like(total))
    return dots.mul_(norm), norm


class MergedBackward(torch.autograd.Function):
    """(dout, dlse, q, k, v, out, lse) -> (dq, dk, dv); differentiating it again raises."""

    @staticmethod
    def forward(dout, dlse, q, k, v, out, lse_bnh, backend, plan, is_causal, scale, aux):
        # float16/bfloat16 gradients that several calls add into are summed in the accumulation
        # dtype and rounded once; a single branch writes every position once.
        wide = lse_bnh.dtype if q.dtype != lse_bnh.dtype and (len(plan) > 1 or dlse is not None) else q.dtype
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dk = torch.zeros(k.shape, dtype=wide, device=k.device)
        dv = torch.zeros(v.shape, dtype=wide, device=v.device)
        if dout is not None:
            # as every kernel reads it (while tracing, its strides are not known yet)
            dout = dout.to(q.dtype)
            dout = dout.contiguous() if torch.compiler.is_compiling() else last_dim_contiguous(dout)
        dlse_bnh = None if dlse is None else dlse.transpose(1, 2).contiguous().unsqueeze(-1)
        rows = _merged_rows(dout, q, k, v, lse_bnh, backend, plan, is_causal, scale, aux)
        B, N = q.shape[0], q.shape[1]
        for call, sl, lse_len, extra in _kernel_calls(plan, aux, B, N):
            qv, kv, vv = view(q[sl], call, call.q), view(k[sl], call, call.kv), view(v[sl], call, call.kv)
            dov = None if dout is None else view(dout[sl], call, call.q)
            dl = None if dlse_bnh is None else view(dlse_bnh[sl], call, call.q)[..., 0].transpose(1, 2)
            # gradients added in place into the views of dq, dk, dv where the backend can
            into = (
                (view(dq[sl], call, call.q), view(dk[sl], call, call.kv), view(dv[sl], call, call.kv))
                if rows is not None
                and dq.dtype == lse_bnh.dtype
                and not call.kv.expanded
                and not torch.compiler.is_compiling()  # out of place there (views.write)
                else None
            )
            dqg, dkg, dvg = kernel_backward(
                backend,
                dov,
                dl,
                qv,
                kv,
                vv,
                view(out[sl], call, call.q),
                _lse_of(lse_bnh[sl], call, lse_len),
                extra,
                is_causal=is_causal,
                scale=scale,
                rows=None
                if rows is None
                else (view(rows[0][sl], call, call.q)[..., 0], view(rows[1][sl], call, call.q)[..., 0]),
                into=into,
            )
            if into is None:
                dq = _add(dq, sl, call, call.q, dqg)
                dk = _add(dk, sl, call, call.kv, dkg)
                dv = _add(dv, sl, call, call.kv, dvg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.backend_name = inputs[7].name

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_message(ctx.backend_name))

    @staticmethod
    def vmap(info, in_dims, dout, dlse, q, k, v, out, lse_bnh, backend, plan, is_causal, scale, aux):
        V = info.batch_size
        args = [_fold(x, d, V) for x, d in zip((dout, dlse, q, k, v, out, lse_bnh), in_dims[:7], strict=True)]
        grads = MergedBackward.apply(*args, backend, plan, is_causal, scale, aux)
        return tuple(g.unflatten(0, (V, -1)) for g in grads), (0, 0, 0)
