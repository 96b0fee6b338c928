"""The kernels under the ``sdpa`` backend: PyTorch's fused attention operators that return the
log-sum-exp, chosen as PyTorch chooses, and an exact CPU backward.

CUDA, best first (:func:`cuda_kernel`; which one runs is logged once and shown by
``python -m dilated_attention``):

* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` where ``torch.backends.cuda`` would pick
  it: compute capability 9.0 or newer, float16/bfloat16, head dim a multiple of 8 up to 128;
* ``flash``: ``aten._scaled_dot_product_flash_attention``: 8.0 or newer, float16/bfloat16, head dim
  a multiple of 8 up to 256;
* ``efficient``: ``aten._scaled_dot_product_efficient_attention`` (float32, older GPUs).

All three take batch, sequence and head strides as they come (last dimension contiguous), so the
driver hands them strided views; a view whose last dimension is not contiguous is copied first.
Key/value heads are repeated for grouped-query attention.

cuDNN's backward needs more than that. PyTorch caches one cuDNN graph per shape and strides of q,
k and v, and the graph bakes in the strides of ``out``, ``dout`` and the statistics it was first
built with: a later call with the same q, k, v layout but another layout of ``out`` or ``dout``
runs the cached graph, which reads them with the first call's strides (wrong gradients, or reads
outside the tensors). So the backward always hands cuDNN ``out`` and ``dout`` contiguous in the
(B, H, M, D) layout and the statistics in the layout the forward returned, all three a function
of the shapes alone (:func:`cudnn_backward_layouts`).

A call of one row and one key (a branch's tail segment of one position) runs no kernel: cuDNN
refuses it (``s_q = s_kv = 1 is not supported``) and its result is exact in closed form, ``out =
v`` and ``lse = scale (q . k)`` (:func:`one_key_forward`, :func:`one_key_backward`).

CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` forward. Its backward computes the
probabilities with an approximate exponential, which misses the float32 accuracy rule (SPEC
section 4) on large logits and bfloat16 with grouped-query attention, so the CPU backward is
:func:`cpu_exact_backward`: the same formula in plain PyTorch matmuls in the accumulation dtype,
in chunks of bounded size (``CPU_KERNEL_BACKWARD = True`` restores the operator's backward).
"""

from __future__ import annotations

import logging

import torch

from ..op import views
from .strided import last_dim_contiguous

__all__ = [
    "cpp_driver_runs",
    "cpu_exact_backward",
    "cuda_backward",
    "cuda_forward",
    "cuda_kernel",
    "cudnn_backward_layouts",
    "one_key_backward",
    "one_key_forward",
]

logger = logging.getLogger(__name__)

#: Score-chunk budget of :func:`cpu_exact_backward`, in elements (float32: 16 MiB per buffer).
CHUNK_ELEMENTS = 4 * 1024 * 1024

_HALF = (torch.float16, torch.bfloat16)
_logged: set[tuple] = set()


def cuda_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``"cudnn"``, ``"flash"`` or ``"efficient"``: the operator the sdpa backend runs on ``device``
    for ``dtype`` and ``head_dim`` (the capability comes from :mod:`dilated_attention.hardware`)."""
    from .. import hardware

    cap = hardware.compute_capability(device)
    half = dtype in _HALF and head_dim % 8 == 0
    aten = torch.ops.aten
    if (
        half
        and cap is not None
        and cap >= (9, 0)
        and head_dim <= 128
        and hasattr(aten, "_scaled_dot_product_cudnn_attention")
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
    ):
        return "cudnn"
    if (
        half
        and cap is not None
        and cap >= (8, 0)
        and head_dim <= 256
        and torch.backends.cuda.flash_sdp_enabled()
    ):
        return "flash"
    return "efficient"


def _aten():
    """The ATen operator namespace (one place to look it up, so tests can stand in for it)."""
    return torch.ops.aten


def _log(kind: str, q: torch.Tensor) -> None:
    key = (kind, q.device, q.dtype, int(q.shape[-1]))
    if key not in _logged:
        _logged.add(key)
        logger.info("sdpa on %s %s, head dim %d: %s attention kernel", q.device, q.dtype, q.shape[-1], kind)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (B, M, H, D) <-> (B, H, M, D), a view


def _heads(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Key/value heads repeated to q's (the CUDA operators take as many as q has); a stride-0 head
    dim (one key/value head shared by the call) is materialised, as the operators' backward writes
    one gradient per head."""
    h, hk = q.shape[2], x.shape[2]
    if h != hk:
        return x.repeat_interleave(h // hk, dim=2)
    return x.contiguous() if h > 1 and x.stride(2) == 0 else x


def _is_one_key(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[1] == 1 and k.shape[1] == 1


def one_key_forward(q, k, v, *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (Bb, 1, h, D) in q's dtype, lse (Bb, h, 1) float32) of a call of one row and one key:
    the one weight is 1, so ``out = v`` and ``lse = scale (q . k)``, in float32."""
    kh = _heads(q, k).float()
    s = (q.float() * kh).sum(-1) * scale  # (Bb, 1, h)
    return _heads(q, v).to(q.dtype), s.transpose(1, 2).contiguous()


def one_key_backward(dout, q, k, v, out, lse, *, scale: float):
    """(dq, dk, dv) (h heads each, float32) of a call of one row and one key fed the merged
    ``out`` and ``lse`` (Bb, h, >= 1): ``P = exp(scale (q . k) - lse)``, ``dv = P dout``,
    ``dS = P (dout . v - dout . out)``, ``dq = scale dS k``, ``dk = scale dS q``."""
    qf, kf, vf = q.float(), _heads(q, k).float(), _heads(q, v).float()
    dof = dout.float()
    s = (qf * kf).sum(-1, keepdim=True) * scale  # (Bb, 1, h, 1)
    p = torch.exp(s - lse[..., :1].transpose(1, 2).unsqueeze(-1).float())
    ds = p * ((dof * vf).sum(-1, keepdim=True) - (dof * out.float()).sum(-1, keepdim=True))
    return ds * kf * scale, ds * qf * scale, p * dof


def cudnn_backward_layouts(out: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``dout`` (B, H, M, D) as cuDNN's backward gets them: contiguous, so that their
    strides follow from the shapes alone. PyTorch keys its cache of cuDNN backward graphs on the
    shapes and strides of q, k and v only, while a graph bakes in the strides of ``out`` and
    ``dout``; two calls whose q, k, v agree but whose ``out`` or ``dout`` are laid out differently
    would otherwise share a graph that reads the second call's tensors with the first call's
    strides."""
    return out.contiguous(), dout.contiguous()


def cuda_forward(q, k, v, *, is_causal: bool, scale: float):
    """(out (Bb, m, h, D), lse (Bb, h, >= m) float32, extra) on the chosen CUDA operator."""
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    if _is_one_key(q, k):
        out, lse = one_key_forward(q, k, v, scale=scale)
        return out, lse, ("one-key",)
    kind = cuda_kernel(q.device, q.dtype, int(q.shape[-1]))
    _log(kind, q)
    k, v = _heads(q, k), _heads(q, v)
    aten = _aten()
    if kind == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention(
            _t(q), _t(k), _t(v), None, True, 0.0, is_causal, False, scale=scale
        )
        # cuDNN's softmax statistics: (B, H, M, 1) in recent PyTorch (possibly a transposed view),
        # (B, H, M) in older ones. The merge takes (B, H, M); the backward gets the forward's layout.
        stats = res[1]
        lse = stats.squeeze(-1) if stats.dim() == 4 else stats
        layout = (tuple(stats.shape), stats.stride())
        return _t(res[0]), lse, (kind, res[2], res[3], res[4], res[5], res[6], res[7], layout)
    if kind == "flash":
        res = aten._scaled_dot_product_flash_attention(
            _t(q), _t(k), _t(v), 0.0, is_causal, False, scale=scale
        )
        return _t(res[0]), res[1], (kind, res[2], res[3], res[4], res[5], res[6], res[7])
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        _t(q), _t(k), _t(v), None, True, 0.0, is_causal, scale=scale
    )
    return _t(out), lse, (kind, seed, offset)


def _cudnn_stats(lse: torch.Tensor, layout: tuple) -> torch.Tensor:
    """The merged ``lse`` (B, H, M) in the shape and strides of the cuDNN forward's statistics
    (``layout``), which cuDNN's backward reads as such."""
    shape, stride = layout
    stats = lse.new_empty_strided(shape, stride)
    (stats.squeeze(-1) if len(shape) == 4 else stats).copy_(lse[..., : shape[2]])
    return stats


def cuda_backward(dout, q, k, v, out, lse, extra, *, is_causal: bool, scale: float):
    """(dq, dk, dv) of one call on the operator its forward ran on, fed ``out`` and ``lse``."""
    hk = k.shape[2]
    dout, q, k, v, out = (last_dim_contiguous(x) for x in (dout, q, k, v, out))
    kind = extra[0]
    if kind == "one-key":
        dq, dk, dv = one_key_backward(dout, q, k, v, out, lse, scale=scale)
        if hk != q.shape[2]:
            dk = dk.unflatten(2, (hk, -1)).sum(3)
            dv = dv.unflatten(2, (hk, -1)).sum(3)
        return dq, dk, dv
    ke, ve = _heads(q, k), _heads(q, v)
    aten = _aten()
    if kind == "cudnn":
        cq, ck, mq, mk, seed, offset, layout = extra[1:]
        o_bhmd, do_bhmd = cudnn_backward_layouts(_t(out), _t(dout))
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            do_bhmd,
            _t(q),
            _t(ke),
            _t(ve),
            o_bhmd,
            _cudnn_stats(lse, layout),
            seed,
            offset,
            None,
            cq,
            ck,
            mq,
            mk,
            0.0,
            is_causal,
            scale=scale,
        )
    elif kind == "flash":
        cq, ck, mq, mk, seed, offset = extra[1:]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            _t(dout),
            _t(q),
            _t(ke),
            _t(ve),
            _t(out),
            lse,
            cq,
            ck,
            mq,
            mk,
            0.0,
            is_causal,
            seed,
            offset,
            scale=scale,
        )
    else:
        seed, offset = extra[1:]
        # in half precision its kernel computes delta from out stepping its rows by H * D, whatever
        # the strides say: out packed (B, M, H, D)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _t(dout),
            _t(q),
            _t(ke),
            _t(ve),
            None,
            _t(out.contiguous()),
            lse.contiguous(),
            seed,
            offset,
            0.0,
            [True, True, True, False],
            is_causal,
            scale=scale,
        )
    dq, dk, dv = _t(dq), _t(dk), _t(dv)
    if hk != q.shape[2]:
        dk = dk.unflatten(2, (hk, -1)).sum(3)
        dv = dv.unflatten(2, (hk, -1)).sum(3)
    return dq, dk, dv


def _cpu_chunks(q, k, v, lse, *, is_causal: bool, scale: float):
    """The call in chunks of batch rows and query rows of at most :data:`CHUNK_ELEMENTS` scores, in
    the dtype of ``lse``: yields ``(b, i, heads_first, kh, vh, p)``, b and i the chunk's batch and
    query slices, ``heads_first`` the layout of its rows ((c, n, h, D) -> (c hk, g n, D)), kh and
    vh its keys and values (c hk, mk, D) and ``P = exp(scale (q k^T) - lse)`` (c hk, g n, mk),
    causal: top-left aligned, as the operator. The same inputs give the same P bit for bit."""
    ct = lse.dtype
    Bb, m, h, D = q.shape
    mk, hk = k.shape[1], k.shape[2]
    g = h // hk
    rows = max(1, min(m, CHUNK_ELEMENTS // max(1, h * mk)))
    nb = max(1, min(Bb, CHUNK_ELEMENTS // max(1, h * mk * rows)))
    lse = lse[..., :m]
    for b0 in range(0, Bb, nb):
        b = slice(b0, b0 + nb)
        c = k[b].shape[0]
        # (c hk, mk, D), contiguous: one batched matmul per product
        kh = k[b].to(ct).permute(0, 2, 1, 3).reshape(c * hk, mk, D)
        vh = v[b].to(ct).permute(0, 2, 1, 3).reshape(c * hk, mk, D)

        def heads_first(x: torch.Tensor, c: int = c) -> torch.Tensor:
            return x.to(ct).permute(0, 2, 1, 3).reshape(c * hk, g * x.shape[1], x.shape[-1])

        for i0 in range(0, m, rows):
            i = slice(i0, min(m, i0 + rows))
            n = i.stop - i0
            lc = lse[b, :, i].reshape(c * hk, g * n, 1)
            lc = torch.where(torch.isneginf(lc), torch.zeros_like(lc), lc)
            # the dot products scaled once rounded, as PyTorch's own scores (a matmul given the
            # scale may fold it into q: one more rounding per term)
            p = torch.bmm(heads_first(q[b, i]), kh.mT).mul_(scale).sub_(lc).exp_()
            if is_causal:
                future = torch.ones(n, mk, dtype=torch.bool, device=q.device).triu_(i0 + 1)
                p.view(c * hk, g, n, mk).masked_fill_(future, 0)
            yield b, i, heads_first, kh, vh, p


def _rows_last(x: torch.Tensor, c: int, hk: int, n: int) -> torch.Tensor:
    """(c hk, g n, ...) -> (c, n, h, ...): the chunk's rows back in the (B, m, h) layout."""
    g = x.shape[1] // n
    return x.view(c, hk, g, n, *x.shape[2:]).movedim(3, 1).reshape(c, n, hk * g, *x.shape[2:])


def cpu_row_dots(dout, q, k, v, lse, *, is_causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_x P(p, x) (dout_p . v_x), sum_x P(p, x))`` of one call, each (Bb, m, h) in lse's
    dtype, from the same P as :func:`cpu_exact_backward`."""
    dots = torch.empty(q.shape[:3], dtype=lse.dtype, device=q.device)
    total = torch.empty(q.shape[:3], dtype=lse.dtype, device=q.device)
    hk = k.shape[2]
    for b, i, heads_first, _, vh, p in _cpu_chunks(q, k, v, lse, is_causal=is_causal, scale=scale):
        c, n = vh.shape[0] // hk, i.stop - i.start
        total[b, i] = _rows_last(p.sum(-1), c, hk, n)
        dots[b, i] = _rows_last(p.mul_(torch.bmm(heads_first(dout[b, i]), vh.mT)).sum(-1), c, hk, n)
    return dots, total


def cpu_exact_backward(
    dout, q, k, v, out, lse, *, is_causal: bool, scale: float, delta=None, norm=None, into=None
):
    """(dq, dk, dv) of one call, in the dtype of ``lse`` (float32, float64 for float64 inputs):
    ``P = exp(scale q k^T - lse) * norm``, ``dV = P^T dout``, ``dS = P (dout v^T - delta)``,
    ``dQ = scale dS k``, ``dK = scale dS^T q`` (causal: top-left aligned, as the operator), in
    chunks (:func:`_cpu_chunks`). q (Bb, m, h, D), k and v (Bb, mk, hk, D), lse (Bb, h, >= m);
    ``delta`` and ``norm`` (Bb, m, h), by default ``rowsum(dout * out)`` and 1. ``into``: three
    tensors (views) of those shapes in lse's dtype that the gradients are added into and that are
    returned, instead of new ones."""
    ct = lse.dtype
    hk = k.shape[2]
    if into is None:
        into = (
            torch.zeros(q.shape, dtype=ct, device=q.device),
            torch.zeros(k.shape, dtype=ct, device=q.device),
            torch.zeros(v.shape, dtype=ct, device=q.device),
        )
    dq, dk, dv = into
    if delta is None:
        delta = (dout.to(ct) * out.to(ct)).sum(-1)
    for b, i, heads_first, kh, vh, p in _cpu_chunks(q, k, v, lse, is_causal=is_causal, scale=scale):
        c, n = kh.shape[0] // hk, i.stop - i.start
        qh, doh = heads_first(q[b, i]), heads_first(dout[b, i])
        if norm is not None:
            p.mul_(heads_first(norm[b, i].unsqueeze(-1)))
        dvh = torch.bmm(p.mT, doh)
        ds = torch.baddbmm(heads_first(delta[b, i].unsqueeze(-1)), doh, vh.mT, beta=-1).mul_(p)  # dS / scale
        dq[b, i] += _rows_last(torch.bmm(ds, kh).mul_(scale), c, hk, n)
        dkh = torch.bmm(ds.mT, qh).mul_(scale)
        dk[b] += dkh.view(c, hk, -1, dkh.shape[-1]).transpose(1, 2)
        dv[b] += dvh.view(c, hk, -1, dvh.shape[-1]).transpose(1, 2)
    return dq, dk, dv


def cpp_driver_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """Whether the sdpa backend runs the C++ driver: no dropout and a device the extension
    registers it for (on CUDA on the operator :func:`cuda_kernel` picks, as the Python driver).
    torch.func transforms run it too (:class:`~dilated_attention.op.views.ViewsAttention`);
    forward-mode AD raises there, as in the Python driver, naming the backend."""
    if dropout_p != 0.0:
        return False
    dev = q.device.type
    if not views.available(dev):
        return False
    if dev == "cuda":
        kind = cuda_kernel(q.device, q.dtype, int(q.shape[-1]))
        if not torch.compiler.is_compiling():
            _log(kind, q)  # the kernel in use, once at INFO, as the Python driver logs it
        return True
    return dev == "cpu"
