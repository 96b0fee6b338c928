"""Backward passes that have no derivative of their own say so when differentiated again."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["first_order_only", "forward_mode_message", "no_double_backward"]


_ADVICE = "differentiate twice with backend='manual', which autograd differentiates end to end"


def forward_mode_message(backend: str) -> str:
    """The error of a fused backend under forward-mode AD, naming the transforms it refuses."""
    return (
        f"dilated_attention: the {backend!r} backend has no forward-mode gradients (torch.func.jvp, "
        "jacfwd, hessian, torch.autograd.forward_ad): its backward is a fused reverse-mode kernel; use "
        "reverse mode (torch.func.grad, vjp, jacrev) or backend='manual', which autograd "
        "differentiates end to end"
    )


def _message(backend: str, advice: str | None = None) -> str:
    return (
        f"dilated_attention: the {backend!r} backend has no second-order gradients (its backward is "
        f"a fused kernel); {advice or _ADVICE}"
    )


class _NoDoubleBackward(torch.autograd.Function):
    """The identity on ``grads``, connected to ``inputs``; its backward raises ``message``.

    Written with ``setup_context`` and a generated vmap rule, so that torch.func transforms
    (``grad``, ``vjp``, ``jacrev``, ``vmap``) can run the backward passes that return through it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(message, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(ctx.message)


def no_double_backward(
    backend: str,
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor | None],
    advice: str | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """``grads`` as they are, unless the backward runs with ``create_graph=True``: then they are
    returned connected to ``inputs`` through a node that raises a ``RuntimeError`` naming ``backend``
    when a second backward reaches it, instead of silently giving zero or wrong second-order
    gradients. ``advice`` replaces the message's default way out (``backend='manual'``)."""
    if not torch.is_grad_enabled():
        return tuple(grads)
    deps = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    present = [g for g in grads if g is not None]
    if not deps or not present:
        return tuple(grads)
    wrapped = iter(_NoDoubleBackward.apply(_message(backend, advice), len(present), *present, *deps))
    return tuple(None if g is None else next(wrapped) for g in grads)


class _FirstOrderOnly(torch.autograd.Function):
    """The identity; its backward passes the gradient on, marked with :func:`no_double_backward`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(backend, x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.backend = inputs[0]

    @staticmethod
    def backward(ctx, grad):
        (grad,) = no_double_backward(ctx.backend, (grad,), (grad,))
        return None, grad


def first_order_only(backend: str, x: torch.Tensor) -> torch.Tensor:
    """``x``, through a node whose gradient is exact to first order only: any second backward
    through it raises a ``RuntimeError`` naming ``backend``."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return x
    return _FirstOrderOnly.apply(backend, x)
