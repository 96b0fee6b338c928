"""``torch.func.vmap(torch.func.grad(f))`` with the vmapped dimension on any one of q, k and v.

Under ``vmap(grad(f))`` f sees gradient-tracking wrappers of batched tensors. The gather backends'
causal path asks whether v has non-finite entries (``merged._maybe_nonfinite``), which reads v on
the host unless v is batched: it looked only at the outermost wrapper, so with v vmapped (q or k
worked) the manual backend raised PyTorch's "calling .item()" error. Each backend's result is
checked against a float64 loop of ``torch.func.grad`` of the reference over the vmapped dimension.
"""

from __future__ import annotations

import pytest
import torch
from common import one_thread  # noqa: F401
from reference import reference_attention

from dilated_attention import dilated_attention as dattn

SEGS, RATES = [4, 8], [1, 2]


def _loss(attend):
    """f(q, k, v) = <out, W> + <lse, Wl> for fixed weights W, Wl."""
    g = torch.Generator().manual_seed(7)
    W = torch.randn(1, 8, 4, 16, generator=g, dtype=torch.float64)
    Wl = torch.randn(1, 4, 8, generator=g, dtype=torch.float64)

    def f(q, k, v):
        out, lse = attend(q, k, v)
        return (out * W.to(out.dtype)).sum() + (lse * Wl.to(lse.dtype)).sum()

    return f


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batched", ["q", "k", "v"])
@pytest.mark.parametrize("backend", ["manual", "sdpa", "native"])
def test_vmap_of_grad_with_any_input_batched(backend, batched, is_causal):
    g = torch.Generator().manual_seed(0)
    V = 3
    q = torch.randn(V, 1, 8, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(V, 1, 8, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(V, 1, 8, 2, 16, generator=g, dtype=torch.float64)
    which = "qkv".index(batched)
    full = [q, k, v]
    args = [x if i == which else x[0] for i, x in enumerate(full)]
    in_dims = tuple(0 if i == which else None for i in range(3))

    f = _loss(
        lambda q, k, v: dattn(q, k, v, SEGS, RATES, is_causal=is_causal, return_lse=True, backend=backend)
    )
    got = torch.func.vmap(torch.func.grad(f, argnums=(0, 1, 2)), in_dims=in_dims)(*(a.float() for a in args))

    ref = _loss(lambda q, k, v: reference_attention(q, k, v, SEGS, RATES, is_causal))
    for j in range(V):
        one = [x[j] if i == which else x for i, x in enumerate(args)]
        want = torch.func.grad(ref, argnums=(0, 1, 2))(*one)
        for name, a, e in zip("qkv", got, want, strict=True):
            # an unbatched input's gradient is batched too: one per vmapped element
            torch.testing.assert_close(a[j].double(), e, rtol=1e-4, atol=1e-5, msg=f"d{name}[{j}]")
